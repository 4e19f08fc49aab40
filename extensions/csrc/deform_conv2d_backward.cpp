// The deterministic backward of torchvision::deform_conv2d on every device: two ops on its columns, laid
// out as torchvision's [C, kh * kw, N, out_h * out_w] (deform_conv2d_backward.h).
//
//   deform_conv2d_grad_input(columns, offset [N, 2 G kh kw, out_h, out_w], mask [N, G kh kw, out_h, out_w]
//                            (any shape when use_mask is false), height, width, kernel_h, kernel_w, stride_h,
//                            stride_w, pad_h, pad_w, dilation_h, dilation_w, offset_groups, use_mask)
//                            -> grad_input [N, C, H, W]
//   deform_conv2d_sample_grads(columns (rewritten), input [N, C, H, W], offset, mask, kernel_h, kernel_w,
//                              stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w, offset_groups,
//                              use_mask) -> (grad_offset, grad_mask)
//
// columns is weight^T . grad_output (deepep_lightning/ops/deform_conv2d.py forms it with a matmul).
// deform_conv2d_grad_input is torchvision's col2im without its float atomicAdd: channel-independent entries
// per deformable sample, a stable sort by pixel and the fixed-order gather of roi_csr_gather.h. Samples go
// in chunks of at most max(2^18, |grad_input| / 800 bytes), as in roi_align_backward.cpp; their count is a
// function of the shapes, so nothing syncs the host. deform_conv2d_sample_grads is torchvision's
// col2im_coord and im2col in one pass, one sample per thread: it returns the offset and mask gradients and
// leaves the im2col in columns, for grad_weight's matmul. grad_mask is zeros shaped like mask when
// use_mask is false, as torchvision's.
//
// Arguments are validated in Python before these ops run (DESIGN.md section 7); the checks here guard
// direct torch.ops callers.
#include "deform_conv2d_backward.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <torch/library.h>

#include <algorithm>

namespace deepep_lightning::roi {

namespace {

// The shape checks of both ops: columns [C, kh * kw, N, L] against offset (and mask).
void check_columns(const char* op, const at::Tensor& columns, const at::Tensor& offset, const at::Tensor& mask,
                   int64_t kernel_h, int64_t kernel_w, int64_t offset_groups, bool use_mask) {
  TORCH_CHECK(columns.dim() == 4 && offset.dim() == 4 && columns.size(1) == kernel_h * kernel_w &&
                  offset_groups > 0 && columns.size(0) % offset_groups == 0,
              op, ": columns must be [C, kh * kw, N, L] with C a multiple of offset_groups, got ", columns.sizes(),
              " and offset_groups ", offset_groups);
  TORCH_CHECK(offset.size(0) == columns.size(2) && offset.size(1) == 2 * offset_groups * kernel_h * kernel_w &&
                  offset.size(2) * offset.size(3) == columns.size(3),
              op, ": offset must be [N, 2 * G * kh * kw, out_h, out_w] matching columns ", columns.sizes(), ", got ",
              offset.sizes());
  TORCH_CHECK(offset.scalar_type() == columns.scalar_type() && at::isFloatingType(columns.scalar_type()) &&
                  offset.device() == columns.device() && (!use_mask || (mask.scalar_type() == columns.scalar_type() &&
                                                                       mask.device() == columns.device() &&
                                                                       mask.numel() == offset.numel() / 2)),
              op, ": columns, offset and mask must share one floating dtype and device");
}

DeformArgs deform_args(const at::Tensor& columns, const at::Tensor& offset, int64_t height, int64_t width,
                       int64_t kernel_h, int64_t kernel_w, int64_t stride_h, int64_t stride_w, int64_t pad_h,
                       int64_t pad_w, int64_t dilation_h, int64_t dilation_w, int64_t offset_groups, bool use_mask) {
  const int64_t batch = columns.size(2);
  return DeformArgs{batch,      offset_groups,  columns.size(0) / offset_groups,
                    height,     width,          kernel_h,
                    kernel_w,   offset.size(2), offset.size(3),
                    stride_h,   stride_w,       pad_h,
                    pad_w,      dilation_h,     dilation_w,
                    batch * offset_groups * height * width, use_mask};
}

}  // namespace

at::Tensor deform_conv2d_grad_input_with(const DeformLaunches& launches, const at::Tensor& columns,
                                         const at::Tensor& offset, const at::Tensor& mask, int64_t height,
                                         int64_t width, int64_t kernel_h, int64_t kernel_w, int64_t stride_h,
                                         int64_t stride_w, int64_t pad_h, int64_t pad_w, int64_t dilation_h,
                                         int64_t dilation_w, int64_t offset_groups, bool use_mask) {
  check_columns("deform_conv2d_grad_input", columns, offset, mask, kernel_h, kernel_w, offset_groups, use_mask);
  const int64_t batch = columns.size(2);
  const int64_t channels = columns.size(0);
  const int64_t destinations = batch * offset_groups * height * width;
  const int64_t total = offset_groups * kernel_h * kernel_w * batch * columns.size(3);
  TORCH_CHECK(destinations < INT32_MAX && total < INT32_MAX,
              "deform_conv2d_grad_input: N * G * H * W and N * G * kh * kw * L must be below 2^31 - 1");
  const at::Device device = columns.device();
  at::Tensor out = launches.empty({batch, channels, height, width}, columns.scalar_type(), device);
  if (total == 0 || channels == 0 || destinations == 0) return out.zero_();
  const at::Tensor columns_c = columns.contiguous();
  const at::Tensor offset_c = offset.contiguous();
  const at::Tensor mask_c = use_mask ? mask.contiguous() : offset_c;  // not read without a mask
  const DeformArgs args = deform_args(columns, offset, height, width, kernel_h, kernel_w, stride_h, stride_w, pad_h,
                                      pad_w, dilation_h, dilation_w, offset_groups, use_mask);
  // source s reads columns[(g * C / G + c) * bins + s % bins]: the generic gather with one "RoI" per offset
  // group and bins = kh * kw * N * L
  const GatherArgs gather_args{batch,
                               (args.channels + kGroup - 1) / kGroup,
                               args.channels,
                               offset_groups,
                               height * width,
                               kernel_h * kernel_w * batch * columns.size(3),
                               /*accumulate=*/false,
                               /*plane_major=*/true};
  const int64_t chunk =
      std::max(int64_t{1} << 18, out.numel() * static_cast<int64_t>(out.element_size()) / int64_t{800});
  const at::ScalarType weight_dtype = columns.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  for (int64_t first = 0; first < total; first += chunk) {
    const int64_t count = std::min(chunk, total - first);
    at::Tensor keys = launches.empty({count * kCorners}, at::kInt, device);
    at::Tensor sources = launches.empty({count * kCorners}, at::kInt, device);
    at::Tensor weights = launches.empty({count * kCorners}, weight_dtype, device);
    launches.entries(first, count, offset_c, mask_c, args, keys, sources, weights);
    GatherArgs chunk_args = gather_args;
    chunk_args.accumulate = first > 0;
    sort_and_gather(keys, sources, weights, destinations, columns_c, chunk_args, launches.gather, out);
  }
  return out;
}

std::tuple<at::Tensor, at::Tensor> deform_conv2d_sample_grads_with(
    const DeformLaunches& launches, at::Tensor& columns, const at::Tensor& input, const at::Tensor& offset,
    const at::Tensor& mask, int64_t kernel_h, int64_t kernel_w, int64_t stride_h, int64_t stride_w, int64_t pad_h,
    int64_t pad_w, int64_t dilation_h, int64_t dilation_w, int64_t offset_groups, bool use_mask) {
  check_columns("deform_conv2d_sample_grads", columns, offset, mask, kernel_h, kernel_w, offset_groups, use_mask);
  TORCH_CHECK(columns.is_contiguous(), "deform_conv2d_sample_grads: columns must be contiguous (it is rewritten)");
  TORCH_CHECK(input.dim() == 4 && input.size(0) == columns.size(2) && input.size(1) == columns.size(0) &&
                  input.scalar_type() == columns.scalar_type() && input.device() == columns.device(),
              "deform_conv2d_sample_grads: input must be [N, C, H, W] of columns' dtype and device, got ",
              input.sizes());
  const int64_t total = offset_groups * kernel_h * kernel_w * columns.size(2) * columns.size(3);
  at::Tensor grad_offset = launches.empty(offset.sizes(), offset.scalar_type(), columns.device());
  at::Tensor grad_mask = use_mask ? launches.empty(mask.sizes(), mask.scalar_type(), columns.device())
                                  : launches.empty(mask.sizes(), mask.scalar_type(), mask.device()).zero_();
  if (total == 0) return {grad_offset.zero_(), grad_mask.zero_()};
  const at::Tensor input_c = input.contiguous();
  const at::Tensor offset_c = offset.contiguous();
  const at::Tensor mask_c = use_mask ? mask.contiguous() : offset_c;  // not read without a mask
  const DeformArgs args = deform_args(columns, offset, input.size(2), input.size(3), kernel_h, kernel_w, stride_h,
                                      stride_w, pad_h, pad_w, dilation_h, dilation_w, offset_groups, use_mask);
  launches.grads(input_c, offset_c, mask_c, args, columns, grad_offset, use_mask ? grad_mask : grad_offset);
  return {grad_offset, grad_mask};
}


namespace {

void deform_entries_cpu(int64_t first, int64_t count, const at::Tensor& offset, const at::Tensor& mask,
                        const DeformArgs& args, at::Tensor& keys, at::Tensor& sources, at::Tensor& weights) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, offset.scalar_type(), "deform_conv2d_grad_input_cpu", [&] {
    using T = at::opmath_type<scalar_t>;
    for (int64_t i = 0; i < count; ++i) {
      deform_sample_entries<scalar_t, T>(first + i, i * kCorners, offset.const_data_ptr<scalar_t>(),
                                         mask.const_data_ptr<scalar_t>(), args, keys.data_ptr<int32_t>(),
                                         sources.data_ptr<int32_t>(), weights.data_ptr<T>());
    }
  });
}

void deform_grads_cpu(const at::Tensor& input, const at::Tensor& offset, const at::Tensor& mask,
                      const DeformArgs& args, at::Tensor& columns, at::Tensor& grad_offset, at::Tensor& grad_mask) {
  const int64_t total = args.offset_groups * args.kernel_h * args.kernel_w * args.batch * args.out_h * args.out_w;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "deform_conv2d_sample_grads_cpu", [&] {
    using T = at::opmath_type<scalar_t>;
    for (int64_t s = 0; s < total; ++s) {
      deform_sample_grads<scalar_t, T>(s, input.const_data_ptr<scalar_t>(), offset.const_data_ptr<scalar_t>(),
                                       mask.const_data_ptr<scalar_t>(), args, columns.data_ptr<scalar_t>(),
                                       grad_offset.data_ptr<scalar_t>(), grad_mask.data_ptr<scalar_t>());
    }
  });
}

at::Tensor empty_cpu(at::IntArrayRef sizes, at::ScalarType dtype, at::Device device) {
  return at::empty(sizes, at::TensorOptions().dtype(dtype).device(device));
}

const DeformLaunches kCpuLaunches{&deform_entries_cpu, &csr_gather_cpu, &deform_grads_cpu, &empty_cpu};

at::Tensor deform_conv2d_grad_input_cpu(const at::Tensor& columns, const at::Tensor& offset, const at::Tensor& mask,
                                        int64_t height, int64_t width, int64_t kernel_h, int64_t kernel_w,
                                        int64_t stride_h, int64_t stride_w, int64_t pad_h, int64_t pad_w,
                                        int64_t dilation_h, int64_t dilation_w, int64_t offset_groups, bool use_mask) {
  TORCH_CHECK(columns.is_cpu(), "deform_conv2d_grad_input_cpu: columns must be a CPU tensor, got ", columns.device());
  return deform_conv2d_grad_input_with(kCpuLaunches, columns, offset, mask, height, width, kernel_h, kernel_w,
                                       stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w, offset_groups,
                                       use_mask);
}

std::tuple<at::Tensor, at::Tensor> deform_conv2d_sample_grads_cpu(at::Tensor& columns, const at::Tensor& input,
                                                                  const at::Tensor& offset, const at::Tensor& mask,
                                                                  int64_t kernel_h, int64_t kernel_w, int64_t stride_h,
                                                                  int64_t stride_w, int64_t pad_h, int64_t pad_w,
                                                                  int64_t dilation_h, int64_t dilation_w,
                                                                  int64_t offset_groups, bool use_mask) {
  TORCH_CHECK(columns.is_cpu(), "deform_conv2d_sample_grads_cpu: columns must be a CPU tensor, got ",
              columns.device());
  return deform_conv2d_sample_grads_with(kCpuLaunches, columns, input, offset, mask, kernel_h, kernel_w, stride_h,
                                         stride_w, pad_h, pad_w, dilation_h, dilation_w, offset_groups, use_mask);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(deepep_lightning, m) {
  m.def(
      "deform_conv2d_grad_input(Tensor columns, Tensor offset, Tensor mask, int height, int width, int kernel_h, "
      "int kernel_w, int stride_h, int stride_w, int pad_h, int pad_w, int dilation_h, int dilation_w, "
      "int offset_groups, bool use_mask) -> Tensor");
  m.def(
      "deform_conv2d_sample_grads(Tensor(a!) columns, Tensor input, Tensor offset, Tensor mask, int kernel_h, "
      "int kernel_w, int stride_h, int stride_w, int pad_h, int pad_w, int dilation_h, int dilation_w, "
      "int offset_groups, bool use_mask) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(deepep_lightning, CPU, m) {
  m.impl("deform_conv2d_grad_input", &deform_conv2d_grad_input_cpu);
  m.impl("deform_conv2d_sample_grads", &deform_conv2d_sample_grads_cpu);
}

}  // namespace deepep_lightning::roi
