// Deterministic CUDA backward of bicubic upsampling (F.interpolate(mode="bicubic"), 4-D input,
// antialias=False); the forward is PyTorch's own kernel.
//
// PyTorch's upsample_bicubic2d_backward adds each grad_output element into the 4 x 4 input pixels of its
// taps with float atomicAdd (refused under torch.use_deterministic_algorithms(True)). The map is
// separable: along an axis, output o has source s(o) = area_pixel_compute_source_index(scale, o,
// align_corners, cubic=true), i0(o) = floor(s(o)), and reads inputs clamp(i0(o) - 1 + k, 0, I - 1) for
// k = 0..3 with PyTorch's cubic coefficients of t = s(o) - i0(o) (UpSample.cuh, A = -0.75). Its weight
// on input i, A(o, i), is the sum of the coefficients of the taps that land on i. i0 is non-decreasing
// in o, so the outputs reading input i are one contiguous range: i0(o) in [i - 2, i + 1], open below for
// i = 0 and above for i = I - 1 (the clamped taps), found by binary search over PyTorch's formula.
// Thread (plane, y, x) sums A_h(oh, y) * A_w(ow, x) * grad_output(oh, ow) over that box in increasing
// oh, then ow, and writes grad_input once. Why deterministic: a fixed set of terms per element, summed in
// a fixed order. Sums are in accscalar_t; divisions go through IntDivider (gather_launch.cuh).
// All work is on the current stream, no sync.
#include <ATen/ATen.h>
#include <ATen/AccumulateType.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/EmptyTensor.h>
#include <ATen/native/cuda/UpSample.cuh>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <climits>
#include <optional>

#include "gather_launch.cuh"

namespace deepep_lightning {

// Defined in ../upsample_bicubic_backward.cpp.
void check_upsample_bicubic_args(const at::Tensor& grad_output, at::IntArrayRef input_size);

namespace {

using gather::Divider;
using gather::kThreads;

template <typename accscalar_t>
struct CubicAxis {
  accscalar_t scale;  // area_pixel_compute_scale
  int in_size, out_size;
  bool align_corners;

  __device__ __forceinline__ accscalar_t source(int o) const {
    return at::native::area_pixel_compute_source_index<accscalar_t>(scale, o, align_corners, /*cubic=*/true);
  }
  __device__ __forceinline__ int first_tap(int o) const { return static_cast<int>(floor(source(o))); }

  // A(o, i): the coefficients of output o's taps that land on input i.
  __device__ __forceinline__ accscalar_t weight(int o, int i) const {
    const accscalar_t real = source(o);
    const accscalar_t floored = floor(real);
    const int i0 = static_cast<int>(floored);
    accscalar_t coefficients[4];
    at::native::get_cubic_upsampling_coefficients<accscalar_t>(coefficients, real - floored);
    accscalar_t result = 0;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int tap = min(max(i0 - 1 + k, 0), in_size - 1);
      if (tap == i) result += coefficients[k];
    }
    return result;
  }

  // First o in [0, out_size] with first_tap(o) >= bound (out_size when none).
  __device__ __forceinline__ int first_output_at_least(int bound) const {
    int low = 0, high = out_size;
    while (low < high) {
      const int mid = low + (high - low) / 2;
      if (first_tap(mid) >= bound) {
        high = mid;
      } else {
        low = mid + 1;
      }
    }
    return low;
  }

  // The outputs reading input i: [begin, end).
  __device__ __forceinline__ int begin(int i) const { return i == 0 ? 0 : first_output_at_least(i - 2); }
  __device__ __forceinline__ int end(int i) const {
    return i == in_size - 1 ? out_size : first_output_at_least(i + 2);
  }
};

template <typename scalar_t, typename accscalar_t, typename index_t>
__global__ void __launch_bounds__(kThreads)
    upsample_bicubic2d_backward_kernel(const scalar_t* __restrict__ grad_output, scalar_t* __restrict__ grad_input,
                                       index_t total, Divider<index_t> by_width, Divider<index_t> by_height,
                                       CubicAxis<accscalar_t> rows, CubicAxis<accscalar_t> columns) {
  const index_t step = static_cast<index_t>(gridDim.x) * kThreads;
  const index_t out_plane = static_cast<index_t>(rows.out_size) * columns.out_size;
  for (index_t index = static_cast<index_t>(blockIdx.x) * kThreads + threadIdx.x; index < total; index += step) {
    const auto by_x = by_width.divmod(index);
    const auto by_y = by_height.divmod(by_x.div);
    const int x = static_cast<int>(by_x.mod), y = static_cast<int>(by_y.mod);
    const scalar_t* plane_grad = grad_output + by_y.div * out_plane;
    const int oh1 = rows.end(y), ow0 = columns.begin(x), ow1 = columns.end(x);
    accscalar_t sum = 0;
    for (int oh = rows.begin(y); oh < oh1; ++oh) {
      const accscalar_t row_weight = rows.weight(oh, y);
      const scalar_t* row = plane_grad + static_cast<index_t>(oh) * columns.out_size;
      for (int ow = ow0; ow < ow1; ++ow) {
        sum += static_cast<accscalar_t>(row[ow]) * row_weight * columns.weight(ow, x);
      }
    }
    grad_input[index] = static_cast<scalar_t>(sum);
  }
}

at::Tensor upsample_bicubic2d_backward_cuda(const at::Tensor& grad_output, at::IntArrayRef input_size,
                                            bool align_corners, std::optional<double> scale_h,
                                            std::optional<double> scale_w) {
  check_upsample_bicubic_args(grad_output, input_size);
  TORCH_CHECK(grad_output.is_cuda(), "upsample_bicubic2d_backward: grad_output must be a CUDA tensor, got ",
              grad_output.device());
  const c10::cuda::CUDAGuard device_guard(grad_output.device());
  const int64_t in_h = input_size[2], in_w = input_size[3];
  const int64_t out_h = grad_output.size(2), out_w = grad_output.size(3);
  TORCH_CHECK(in_h < INT_MAX / 2 && in_w < INT_MAX / 2 && out_h < INT_MAX / 2 && out_w < INT_MAX / 2,
              "upsample_bicubic2d_backward: spatial sizes must be below 2^30, got input_size ", input_size,
              " and grad_output ", grad_output.sizes());
  const at::Tensor grad_c = grad_output.contiguous();
  // Written in full by the kernel: no deterministic-mode fill needed.
  at::Tensor grad_input =
      at::Tensor(at::detail::empty_cuda(input_size, grad_c.scalar_type(), grad_c.device(), std::nullopt));
  const int64_t total = grad_input.numel();
  if (total == 0) return grad_input;
  if (grad_c.numel() == 0) return grad_input.zero_();
  const unsigned int blocks = gather::grid_blocks(total);
  const bool narrow = gather::fits_uint32({total, grad_c.numel()});
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad_c.scalar_type(), "upsample_bicubic2d_backward_cuda",
                                  [&] {
    using accscalar_t = at::acc_type<scalar_t, /*is_cuda=*/true>;
    const CubicAxis<accscalar_t> rows{
        at::native::area_pixel_compute_scale<accscalar_t>(static_cast<int>(in_h), static_cast<int>(out_h),
                                                          align_corners, scale_h),
        static_cast<int>(in_h), static_cast<int>(out_h), align_corners};
    const CubicAxis<accscalar_t> columns{
        at::native::area_pixel_compute_scale<accscalar_t>(static_cast<int>(in_w), static_cast<int>(out_w),
                                                          align_corners, scale_w),
        static_cast<int>(in_w), static_cast<int>(out_w), align_corners};
    gather::with_index_type(narrow, [&](auto index_zero) {
      using index_t = decltype(index_zero);
      upsample_bicubic2d_backward_kernel<scalar_t, accscalar_t, index_t><<<blocks, kThreads, 0, stream>>>(
          grad_c.const_data_ptr<scalar_t>(), grad_input.data_ptr<scalar_t>(), static_cast<index_t>(total),
          Divider<index_t>(static_cast<index_t>(in_w)), Divider<index_t>(static_cast<index_t>(in_h)), rows, columns);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return grad_input;
}

}  // namespace

TORCH_LIBRARY_IMPL(deepep_lightning, CUDA, m) { m.impl("upsample_bicubic2d_backward", &upsample_bicubic2d_backward_cuda); }

}  // namespace deepep_lightning
