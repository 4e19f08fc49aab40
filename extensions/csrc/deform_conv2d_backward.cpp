// deepep_lightning::deform_conv2d_grad_input: the input gradient of torchvision::deform_conv2d from its columns,
// deterministic on every device.
//
//   deform_conv2d_grad_input(columns [N, C, kh * kw, out_h * out_w], offset [N, 2 G kh kw, out_h, out_w],
//                            mask [N, G kh kw, out_h, out_w] (any shape when use_mask is false), height,
//                            width, kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, dilation_h,
//                            dilation_w, offset_groups, use_mask) -> grad_input [N, C, H, W]
//
// columns[n, c, k, l] is weight^T . grad_output (deepep_lightning/ops/deform_conv2d.py forms it with a
// matmul); this op is torchvision's col2im without its float atomicAdd: channel-independent entries per
// deformable sample (deform_conv2d_backward.h), a stable sort by pixel and the fixed-order gather of
// roi_csr_gather.h. Samples go in chunks of at most max(2^18, |grad_input| / 800 bytes), as in
// roi_align_backward.cpp; their count is a function of the shapes, so nothing syncs the host.
//
// Arguments are validated in Python before this op runs (DESIGN.md section 7); the checks here guard
// direct torch.ops callers.
#include "deform_conv2d_backward.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <torch/library.h>

#include <algorithm>

namespace deepep_lightning::roi {

at::Tensor deform_conv2d_grad_input_with(const DeformLaunches& launches, const at::Tensor& columns,
                                         const at::Tensor& offset, const at::Tensor& mask, int64_t height,
                                         int64_t width, int64_t kernel_h, int64_t kernel_w, int64_t stride_h,
                                         int64_t stride_w, int64_t pad_h, int64_t pad_w, int64_t dilation_h,
                                         int64_t dilation_w, int64_t offset_groups, bool use_mask) {
  TORCH_CHECK(columns.dim() == 4 && offset.dim() == 4 && columns.size(2) == kernel_h * kernel_w &&
                  offset_groups > 0 && columns.size(1) % offset_groups == 0,
              "deform_conv2d_grad_input: columns must be [N, C, kh * kw, L] with C a multiple of offset_groups, got ",
              columns.sizes(), " and offset_groups ", offset_groups);
  TORCH_CHECK(offset.size(0) == columns.size(0) && offset.size(1) == 2 * offset_groups * kernel_h * kernel_w &&
                  offset.size(2) * offset.size(3) == columns.size(3),
              "deform_conv2d_grad_input: offset must be [N, 2 * G * kh * kw, out_h, out_w] matching columns ",
              columns.sizes(), ", got ", offset.sizes());
  TORCH_CHECK(offset.scalar_type() == columns.scalar_type() && at::isFloatingType(columns.scalar_type()) &&
                  offset.device() == columns.device() && (!use_mask || (mask.scalar_type() == columns.scalar_type() &&
                                                                       mask.device() == columns.device() &&
                                                                       mask.numel() == offset.numel() / 2)),
              "deform_conv2d_grad_input: columns, offset and mask must share one floating dtype and device");
  const int64_t batch = columns.size(0);
  const int64_t channels = columns.size(1);
  const int64_t destinations = batch * offset_groups * height * width;
  const int64_t total = batch * offset_groups * kernel_h * kernel_w * columns.size(3);
  TORCH_CHECK(destinations < INT32_MAX && total < INT32_MAX,
              "deform_conv2d_grad_input: N * G * H * W and N * G * kh * kw * L must be below 2^31 - 1");
  const at::Device device = columns.device();
  at::Tensor out = launches.empty({batch, channels, height, width}, columns.scalar_type(), device);
  if (total == 0 || channels == 0 || destinations == 0) return out.zero_();
  const at::Tensor columns_c = columns.contiguous();
  const at::Tensor offset_c = offset.contiguous();
  const at::Tensor mask_c = use_mask ? mask.contiguous() : offset_c;  // not read without a mask
  const DeformArgs args{batch,    offset_groups, height,   width,  kernel_h,   kernel_w,   offset.size(2),
                        offset.size(3), stride_h, stride_w, pad_h, pad_w,      dilation_h, dilation_w,
                        destinations,   use_mask};
  const int64_t group_channels = channels / offset_groups;
  const GatherArgs gather_args{batch,    (group_channels + kGroup - 1) / kGroup, group_channels, offset_groups,
                               height * width, kernel_h * kernel_w * columns.size(3), /*accumulate=*/false,
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

at::Tensor empty_cpu(at::IntArrayRef sizes, at::ScalarType dtype, at::Device device) {
  return at::empty(sizes, at::TensorOptions().dtype(dtype).device(device));
}

at::Tensor deform_conv2d_grad_input_cpu(const at::Tensor& columns, const at::Tensor& offset, const at::Tensor& mask,
                                        int64_t height, int64_t width, int64_t kernel_h, int64_t kernel_w,
                                        int64_t stride_h, int64_t stride_w, int64_t pad_h, int64_t pad_w,
                                        int64_t dilation_h, int64_t dilation_w, int64_t offset_groups, bool use_mask) {
  TORCH_CHECK(columns.is_cpu(), "deform_conv2d_grad_input_cpu: columns must be a CPU tensor, got ", columns.device());
  static const DeformLaunches launches{&deform_entries_cpu, &csr_gather_cpu, &empty_cpu};
  return deform_conv2d_grad_input_with(launches, columns, offset, mask, height, width, kernel_h, kernel_w, stride_h,
                                       stride_w, pad_h, pad_w, dilation_h, dilation_w, offset_groups, use_mask);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(deepep_lightning, m) {
  m.def(
      "deform_conv2d_grad_input(Tensor columns, Tensor offset, Tensor mask, int height, int width, int kernel_h, "
      "int kernel_w, int stride_h, int stride_w, int pad_h, int pad_w, int dilation_h, int dilation_w, "
      "int offset_groups, bool use_mask) -> Tensor");
}

TORCH_LIBRARY_IMPL(deepep_lightning, CPU, m) { m.impl("deform_conv2d_grad_input", &deform_conv2d_grad_input_cpu); }

}  // namespace deepep_lightning::roi
