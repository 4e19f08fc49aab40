// deepep_lightning::roi_pool_backward: torchvision's _roi_pool_backward (its arguments but spatial_scale, which
// the backward does not read) as a fixed-point scatter-add (roi_fixed_point.h, fixed_point_sum.h): bitwise
// reproducible, the same bits on the CPU and CUDA, no host synchronisation and no data-dependent allocation
// (CUDA-graph capturable).
//
//   roi_pool_backward(grad [K, C, PH, PW], rois [K, 5], argmax [K, C, PH, PW] int32, batch_size, channels,
//                     height, width) -> [N, C, H, W]
//
// float16, bfloat16 and float32 (a 64-bit fixed-point sum holds about 46 bits below the largest term, more
// than float32 and less than float64: float64 stays with the sorted double sums of ops/roi_pool.py). The CPU
// loops run the per-thread functions of the header in order.
//
// Arguments are validated in Python before this op runs; the checks here guard direct torch.ops callers.
#include "roi_fixed_point.h"

#include <ATen/Dispatch.h>
#include <ATen/EmptyTensor.h>
#include <ATen/OpMathType.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>

namespace deepep_lightning::roi_fixed_point {

namespace {

void check_args(const at::Tensor& grad, const at::Tensor& rois, const at::Tensor& argmax, int64_t batch_size,
                int64_t channels, int64_t height, int64_t width) {
  const char* name = "roi_pool_backward";
  TORCH_CHECK(grad.dim() == 4, name, ": grad must be 4-D [K, C, PH, PW], got shape ", grad.sizes());
  TORCH_CHECK(grad.scalar_type() == at::kFloat || grad.scalar_type() == at::kHalf ||
                  grad.scalar_type() == at::kBFloat16,
              name, ": grad must be float32, float16 or bfloat16, got ", grad.scalar_type());
  TORCH_CHECK(rois.dim() == 2 && rois.size(1) == 5 && rois.size(0) == grad.size(0), name,
              ": rois must be [K, 5] with K = ", grad.size(0), ", got shape ", rois.sizes());
  TORCH_CHECK(rois.scalar_type() == grad.scalar_type() && rois.device() == grad.device(), name,
              ": rois must have grad's dtype and device, got ", rois.scalar_type(), " on ", rois.device());
  TORCH_CHECK(batch_size >= 0 && height >= 0 && width >= 0 && channels == grad.size(1), name,
              ": batch_size, height, width must be >= 0 and channels = ", grad.size(1), ", got ", batch_size, ", ",
              channels, ", ", height, ", ", width);
  TORCH_CHECK(height < INT32_MAX && width < INT32_MAX, name, ": height and width must be below 2^31 - 1");
  TORCH_CHECK(argmax.sizes() == grad.sizes() && argmax.scalar_type() == at::kInt && argmax.device() == grad.device(),
              name, ": argmax must be int32 of grad's shape and device, got ", argmax.scalar_type(), " ",
              argmax.sizes(), " on ", argmax.device());
}

// ---------------------------------------------------------------- CPU launches

void add_term(int64_t* sums, uint32_t* flags, const Shape& shape, const Slot& slot, double term, int s) {
  if (std::isfinite(term)) {
    sums[sum_index(shape, slot)] += fixed_point::quantize(term, s);  // bounded: never wraps
  } else {
    flags[flag_word(shape, slot)] |= fixed_point::flag_of(term) << fixed_point::flag_shift(slot.position);
  }
}

void accumulate_cpu(const at::Tensor& grad, const at::Tensor& rois, const at::Tensor& argmax, const Shape& shape,
                    const Chunk& chunk, const at::Tensor& max_bits, at::Tensor& sums, at::Tensor& flags) {
  const int s = fixed_point::scale_exponent(fixed_point::max_finite_abs_of(max_bits), shape.terms_bits);
  int64_t* sum_data = sums.data_ptr<int64_t>();
  uint32_t* flag_data = reinterpret_cast<uint32_t*>(flags.data_ptr<int32_t>());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "roi_pool_backward_cpu", [&] {
    const scalar_t* grad_data = grad.const_data_ptr<scalar_t>();
    const scalar_t* roi_data = rois.const_data_ptr<scalar_t>();
    const int32_t* argmax_data = argmax.const_data_ptr<int32_t>();
    Slot slot{0, 0};
    int64_t source = 0;
    const int64_t threads = shape.num_rois * chunk.count * shape.pooled_h * shape.pooled_w;
    for (int64_t i = 0; i < threads; ++i) {
      if (roi_pool_term(i, roi_data, argmax_data, shape, chunk, &slot, &source)) {
        add_term(sum_data, flag_data, shape, slot, static_cast<double>(grad_data[source]), s);
      }
    }
  });
}

void finish_cpu(const Shape& shape, const Chunk& chunk, const at::Tensor& max_bits, at::Tensor& sums,
                at::Tensor& flags, at::Tensor& out) {
  const int s = fixed_point::scale_exponent(fixed_point::max_finite_abs_of(max_bits), shape.terms_bits);
  const int64_t plane_size = shape.height * shape.width;
  const int64_t* sum_data = sums.const_data_ptr<int64_t>();
  const uint32_t* flag_data = reinterpret_cast<const uint32_t*>(flags.const_data_ptr<int32_t>());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "roi_pool_backward_cpu", [&] {
    scalar_t* out_data = out.data_ptr<scalar_t>();
    for (int64_t plane = 0; plane < shape.batch * chunk.count; ++plane) {
      const int64_t n = plane / chunk.count;
      scalar_t* destination = out_data + (n * shape.channels + chunk.first + plane % chunk.count) * plane_size;
      for (int64_t p = 0; p < plane_size; ++p) {
        const Slot slot{plane, p};
        const uint32_t flag = (flag_data[flag_word(shape, slot)] >> fixed_point::flag_shift(p)) & 0xff;
        const double value = fixed_point::finish(sum_data[sum_index(shape, slot)], flag, s);
        destination[p] = static_cast<scalar_t>(static_cast<float>(value));
      }
    }
  });
  sums.zero_();
  flags.zero_();
}

at::Tensor empty_cpu(at::IntArrayRef sizes, at::ScalarType dtype, at::Device device) {
  return at::detail::empty_cpu(sizes, dtype, /*pin_memory=*/false, std::nullopt);
}

const Launches kCpuLaunches{&fixed_point::max_finite_abs_cpu, &accumulate_cpu, &finish_cpu, &empty_cpu};

at::Tensor roi_pool_backward_cpu(const at::Tensor& grad, const at::Tensor& rois, const at::Tensor& argmax,
                                 int64_t batch_size, int64_t channels, int64_t height, int64_t width) {
  TORCH_CHECK(grad.is_cpu(), "roi_pool_backward_cpu: grad must be a CPU tensor, got ", grad.device());
  return backward_with(kCpuLaunches, grad, rois, argmax, batch_size, channels, height, width);
}

}  // namespace

at::Tensor backward_with(const Launches& launches, const at::Tensor& grad, const at::Tensor& rois,
                         const at::Tensor& argmax, int64_t batch_size, int64_t channels, int64_t height, int64_t width) {
  check_args(grad, rois, argmax, batch_size, channels, height, width);
  const at::Device device = grad.device();
  const int64_t num_rois = grad.size(0);
  const int64_t pooled_height = grad.size(2);
  const int64_t pooled_width = grad.size(3);
  const int64_t plane = height * width;
  at::Tensor out = launches.empty({batch_size, channels, height, width}, grad.scalar_type(), device);
  if (num_rois == 0 || out.numel() == 0) return out.zero_();
  const Shape shape{num_rois,      batch_size,   channels, height, width,
                    pooled_height, pooled_width, fixed_point::term_bits(num_rois * pooled_height * pooled_width)};
  const at::Tensor grad_c = grad.contiguous();
  const at::Tensor rois_c = rois.contiguous();
  const at::Tensor argmax_c = argmax.contiguous();
  at::Tensor max_bits = at::zeros({1}, at::TensorOptions().dtype(at::kInt).device(device));
  launches.max_abs(grad_c, max_bits);
  const int64_t per_chunk = fixed_point::rows_per_chunk(channels, batch_size * plane);
  const int64_t chunk_planes = batch_size * std::min(per_chunk, channels);
  at::Tensor sums = at::zeros({chunk_planes * plane}, at::TensorOptions().dtype(at::kLong).device(device));
  at::Tensor flags =
      at::zeros({chunk_planes * words_per_plane(shape)}, at::TensorOptions().dtype(at::kInt).device(device));
  for (int64_t first = 0; first < channels; first += per_chunk) {
    const Chunk chunk{first, std::min(per_chunk, channels - first)};
    launches.accumulate(grad_c, rois_c, argmax_c, shape, chunk, max_bits, sums, flags);
    launches.finish(shape, chunk, max_bits, sums, flags, out);
  }
  return out;
}

TORCH_LIBRARY_FRAGMENT(deepep_lightning, m) {
  m.def(
      "roi_pool_backward(Tensor grad, Tensor rois, Tensor argmax, int batch_size, int channels, int height, "
      "int width) -> Tensor");
}

TORCH_LIBRARY_IMPL(deepep_lightning, CPU, m) {
  m.impl("roi_pool_backward", &roi_pool_backward_cpu);
}

}  // namespace deepep_lightning::roi_fixed_point
