// Deterministic CUDA backward of antialiased bilinear / bicubic resizing (F.interpolate(antialias=True),
// 4-D input); the forward is PyTorch's own kernel.
//
// PyTorch's _upsample_{bilinear,bicubic}2d_aa_backward add each grad_output element into its input window
// with float atomicAdd (refused under torch.use_deterministic_algorithms(True)). The map is separable:
// along an axis (input size I, output size O, scale from area_pixel_compute_scale), output o reads the
// window [xmin(o), xend(o)) of PyTorch's _compute_weights_span with the normalised filter weights of
// _compute_weights (the filters of upsample_antialias in UpSample.cuh, restated here: Pillow's triangle
// and a = -0.5 cubic). xmin and xend are
// non-decreasing in o, so the outputs reading input i are one contiguous range [first o with xend(o) > i,
// first o with xmin(o) > i), found by binary search. Thread (plane, y, x) sums
// A_h(oh, y) * A_w(ow, x) * grad_output(oh, ow) over that box in increasing oh, then ow, and writes
// grad_input once. Why deterministic: a fixed set of terms per element, summed in a fixed order. Sums and
// weights are in accscalar_t; divisions by sizes go through IntDivider (gather_launch.cuh).
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

// Defined in ../upsample_aa_backward.cpp.
void check_upsample_aa_args(const at::Tensor& grad_output, at::IntArrayRef input_size);

namespace {

using gather::Divider;
using gather::kThreads;

struct TriangleFilter {  // upsample_antialias::BilinearFilterFunctor
  static constexpr int size = 2;
  template <typename accscalar_t>
  __device__ accscalar_t operator()(accscalar_t x) const {
    if (x < 0) x = -x;
    return x < 1 ? 1 - x : accscalar_t(0);
  }
};

struct CubicFilter {  // upsample_antialias::BicubicFilterFunctor
  static constexpr int size = 4;
  template <typename accscalar_t>
  __device__ accscalar_t operator()(accscalar_t x) const {
    const accscalar_t a = -0.5;
    if (x < 0) x = -x;
    if (x < 1) return ((a + 2) * x - (a + 3)) * x * x + 1;
    if (x < 2) return (((x - 5) * x + 8) * x - 4) * a;
    return 0;
  }
};

template <typename accscalar_t, typename filter_t>
struct AntialiasAxis {
  accscalar_t scale, support, inverse_scale;
  int in_size, out_size;

  // PyTorch's _compute_weights_span (UpSample.cuh): truncation toward zero, clipped to the input.
  __device__ __forceinline__ void span(int o, int& xmin, int& xend, accscalar_t& center) const {
    center = scale * (o + static_cast<accscalar_t>(0.5));
    xmin = max(static_cast<int>(center - support + static_cast<accscalar_t>(0.5)), 0);
    xend = min(static_cast<int>(center + support + static_cast<accscalar_t>(0.5)), in_size);
  }

  // A(o, i) for i in o's window: the filter weight of i, normalised by the window's total (as _compute_weights).
  __device__ __forceinline__ accscalar_t weight(int o, int i) const {
    const filter_t filter{};
    int xmin, xend;
    accscalar_t center;
    span(o, xmin, xend, center);
    const accscalar_t xmin_m_center = xmin - center;
    accscalar_t total = 0, mine = 0;
    for (int j = 0; j < xend - xmin; ++j) {
      const accscalar_t w = filter((j + xmin_m_center + static_cast<accscalar_t>(0.5)) * inverse_scale);
      total += w;
      if (j == i - xmin) mine = w;
    }
    return total != 0 ? mine / total : mine;
  }

  // First o in [0, out_size] with xend(o) > i (after_end = true) or xmin(o) > i (false); out_size when none.
  __device__ __forceinline__ int first_output(int i, bool after_end) const {
    int low = 0, high = out_size;
    while (low < high) {
      const int mid = low + (high - low) / 2;
      int xmin, xend;
      accscalar_t center;
      span(mid, xmin, xend, center);
      if ((after_end ? xend : xmin) > i) {
        high = mid;
      } else {
        low = mid + 1;
      }
    }
    return low;
  }
};

template <typename scalar_t, typename accscalar_t, typename index_t, typename filter_t>
__global__ void __launch_bounds__(kThreads)
    upsample_aa2d_backward_kernel(const scalar_t* __restrict__ grad_output, scalar_t* __restrict__ grad_input,
                                  index_t total, Divider<index_t> by_width, Divider<index_t> by_height,
                                  AntialiasAxis<accscalar_t, filter_t> rows,
                                  AntialiasAxis<accscalar_t, filter_t> columns) {
  const index_t step = static_cast<index_t>(gridDim.x) * kThreads;
  const index_t out_plane = static_cast<index_t>(rows.out_size) * columns.out_size;
  for (index_t index = static_cast<index_t>(blockIdx.x) * kThreads + threadIdx.x; index < total; index += step) {
    const auto by_x = by_width.divmod(index);
    const auto by_y = by_height.divmod(by_x.div);
    const int x = static_cast<int>(by_x.mod), y = static_cast<int>(by_y.mod);
    const scalar_t* plane_grad = grad_output + by_y.div * out_plane;
    const int oh1 = rows.first_output(y, false);
    const int ow0 = columns.first_output(x, true), ow1 = columns.first_output(x, false);
    accscalar_t sum = 0;
    for (int oh = rows.first_output(y, true); oh < oh1; ++oh) {
      const accscalar_t row_weight = rows.weight(oh, y);
      const scalar_t* row = plane_grad + static_cast<index_t>(oh) * columns.out_size;
      for (int ow = ow0; ow < ow1; ++ow) {
        sum += static_cast<accscalar_t>(row[ow]) * row_weight * columns.weight(ow, x);
      }
    }
    grad_input[index] = static_cast<scalar_t>(sum);
  }
}

template <typename accscalar_t, typename filter_t>
AntialiasAxis<accscalar_t, filter_t> antialias_axis(int64_t in, int64_t out, bool align_corners,
                                                     std::optional<double> scale) {
  const accscalar_t axis_scale = at::native::area_pixel_compute_scale<accscalar_t>(
      static_cast<int>(in), static_cast<int>(out), align_corners, scale);
  const accscalar_t half_size = filter_t::size * static_cast<accscalar_t>(0.5);
  const accscalar_t support = axis_scale >= 1.0 ? half_size * axis_scale : half_size;
  const accscalar_t inverse_scale = axis_scale >= 1.0 ? 1.0 / axis_scale : 1.0;
  return {axis_scale, support, inverse_scale, static_cast<int>(in), static_cast<int>(out)};
}

at::Tensor upsample_aa2d_backward_cuda(const at::Tensor& grad_output, at::IntArrayRef input_size, bool align_corners,
                                       std::optional<double> scale_h, std::optional<double> scale_w, bool bicubic) {
  check_upsample_aa_args(grad_output, input_size);
  TORCH_CHECK(grad_output.is_cuda(), "upsample_aa2d_backward: grad_output must be a CUDA tensor, got ",
              grad_output.device());
  const c10::cuda::CUDAGuard device_guard(grad_output.device());
  const int64_t in_h = input_size[2], in_w = input_size[3];
  const int64_t out_h = grad_output.size(2), out_w = grad_output.size(3);
  TORCH_CHECK(in_h < INT_MAX / 2 && in_w < INT_MAX / 2 && out_h < INT_MAX / 2 && out_w < INT_MAX / 2,
              "upsample_aa2d_backward: spatial sizes must be below 2^30, got input_size ", input_size,
              " and grad_output ", grad_output.sizes());
  const at::Tensor grad_c = grad_output.contiguous();
  // Written in full by the kernel: no deterministic-mode fill needed.
  at::Tensor grad_input =
      at::Tensor(at::detail::empty_cuda(input_size, grad_c.scalar_type(), grad_c.device(), std::nullopt));
  const int64_t total = grad_input.numel();
  if (total == 0) return grad_input;
  const unsigned int blocks = gather::grid_blocks(total);
  const bool narrow = gather::fits_uint32({total, grad_c.numel()});
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad_c.scalar_type(), "upsample_aa2d_backward_cuda", [&] {
    using accscalar_t = at::acc_type<scalar_t, /*is_cuda=*/true>;
    const auto launch = [&](auto filter) {
      using filter_t = decltype(filter);
      const auto rows = antialias_axis<accscalar_t, filter_t>(in_h, out_h, align_corners, scale_h);
      const auto columns = antialias_axis<accscalar_t, filter_t>(in_w, out_w, align_corners, scale_w);
      gather::with_index_type(narrow, [&](auto index_zero) {
        using index_t = decltype(index_zero);
        upsample_aa2d_backward_kernel<scalar_t, accscalar_t, index_t, filter_t><<<blocks, kThreads, 0, stream>>>(
            grad_c.const_data_ptr<scalar_t>(), grad_input.data_ptr<scalar_t>(), static_cast<index_t>(total),
            Divider<index_t>(static_cast<index_t>(in_w)), Divider<index_t>(static_cast<index_t>(in_h)), rows,
            columns);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    };
    if (bicubic) {
      launch(CubicFilter{});
    } else {
      launch(TriangleFilter{});
    }
  });
  return grad_input;
}

}  // namespace

TORCH_LIBRARY_IMPL(deepep_lightning, CUDA, m) { m.impl("upsample_aa2d_backward", &upsample_aa2d_backward_cuda); }

}  // namespace deepep_lightning
