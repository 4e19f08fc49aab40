// Deterministic CUDA backward of aten::avg_pool3d.
//
// PyTorch's kernel scatters every grad_output cell into its window with float atomicAdd when windows
// overlap (stride < kernel_size; refused under torch.use_deterministic_algorithms(True)). Here each
// grad_input element gathers: along an axis (kernel k, stride s, padding p), output o's window starts at
// o * s - p and input i lies in it for o in [ceil((i + p - k + 1) / s), floor((i + p) / s)] clipped
// to [0, O). Thread (plane, d, h, w) sums grad_output(od, oh, ow) / divisor(od, oh, ow) over that box in
// increasing od, oh, ow, the divisor as PyTorch's forward computes it (divisor_override, else the
// window clipped to the padded input when count_include_pad, else clipped to the input).
// Why deterministic: a fixed set of terms per element, summed in a fixed order. Sums are in
// accscalar_t; the divisor is the product of per-axis extents, each computed once per window index.
// Divisions by sizes and strides go through IntDivider (uint32 multiply-shift when every value fits,
// gather_launch.cuh); W is innermost. grad_input is computed contiguous and returned in self's suggested
// memory format.
// All work is on the current stream, no sync.
#include <ATen/ATen.h>
#include <ATen/AccumulateType.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/EmptyTensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <optional>

#include "gather_launch.cuh"

namespace deepep_lightning {

// Defined in ../avg_pool3d_backward.cpp.
void check_avg_pool3d_backward_args(const at::Tensor& grad_output, const at::Tensor& self, at::IntArrayRef kernel_size,
                                    at::IntArrayRef stride, at::IntArrayRef padding);

namespace {

using gather::Divider;
using gather::kThreads;

// One axis: input size, output size, kernel, stride, padding; all non-negative (covers() checks p <= k / 2).
template <typename index_t>
struct Axis {
  index_t in, out, kernel, stride, pad;
  Divider<index_t> by_in, by_stride;

  // First and one-past-last output whose window [o * s - p, o * s - p + k) holds input i.
  __device__ __forceinline__ index_t first(index_t i) const {
    const index_t high = i + pad + 1;  // window o holds i iff o * s + k >= high and o * s <= i + p
    return high <= kernel ? 0 : by_stride.div(high - kernel + stride - 1);
  }
  __device__ __forceinline__ index_t last(index_t i) const {
    const index_t end = by_stride.div(i + pad) + 1;
    return end < out ? end : out;
  }
  // The window's extent clipped to the padded input (count_include_pad) or to the input.
  __device__ __forceinline__ index_t extent(index_t o, bool count_include_pad) const {
    const index_t padded_start = o * stride;  // window start + pad, >= 0
    const index_t padded_end = min(padded_start + kernel, in + 2 * pad);
    if (count_include_pad) return padded_end - padded_start;
    return min(padded_end, in + pad) - max(padded_start, pad);
  }
};

template <typename scalar_t, typename accscalar_t, typename index_t>
__global__ void __launch_bounds__(kThreads)
    avg_pool3d_backward_kernel(const scalar_t* __restrict__ grad_output, scalar_t* __restrict__ grad_input,
                               index_t total, Axis<index_t> ad, Axis<index_t> ah, Axis<index_t> aw,
                               bool count_include_pad, index_t divisor_override) {
  const index_t step = static_cast<index_t>(gridDim.x) * kThreads;
  for (index_t index = static_cast<index_t>(blockIdx.x) * kThreads + threadIdx.x; index < total; index += step) {
    const auto by_w = aw.by_in.divmod(index);
    const auto by_h = ah.by_in.divmod(by_w.div);
    const auto by_d = ad.by_in.divmod(by_h.div);
    const index_t w = by_w.mod, h = by_h.mod, d = by_d.mod, plane = by_d.div;
    const scalar_t* plane_grad = grad_output + plane * ad.out * ah.out * aw.out;
    const index_t od1 = ad.last(d), oh0 = ah.first(h), oh1 = ah.last(h), ow0 = aw.first(w), ow1 = aw.last(w);
    accscalar_t sum = 0;
    for (index_t od = ad.first(d); od < od1; ++od) {
      const index_t extent_d = divisor_override != 0 ? 1 : ad.extent(od, count_include_pad);
      for (index_t oh = oh0; oh < oh1; ++oh) {
        const index_t extent_dh = divisor_override != 0 ? 1 : extent_d * ah.extent(oh, count_include_pad);
        const scalar_t* row = plane_grad + (od * ah.out + oh) * aw.out;
        for (index_t ow = ow0; ow < ow1; ++ow) {
          const index_t divisor =
              divisor_override != 0 ? divisor_override : extent_dh * aw.extent(ow, count_include_pad);
          sum += static_cast<accscalar_t>(row[ow]) / static_cast<accscalar_t>(divisor);
        }
      }
    }
    grad_input[index] = static_cast<scalar_t>(sum);
  }
}

at::Tensor avg_pool3d_backward_cuda(const at::Tensor& grad_output, const at::Tensor& self, at::IntArrayRef kernel_size,
                                    at::IntArrayRef stride, at::IntArrayRef padding, bool ceil_mode,
                                    bool count_include_pad, std::optional<int64_t> divisor_override) {
  check_avg_pool3d_backward_args(grad_output, self, kernel_size, stride, padding);
  TORCH_CHECK(self.is_cuda() && grad_output.device() == self.device(),
              "avg_pool3d_backward: grad_output and self must be on one CUDA device, got ", grad_output.device(),
              " and ", self.device());
  TORCH_CHECK(!divisor_override.has_value() || *divisor_override != 0,
              "avg_pool3d_backward: divisor_override must be non-zero");
  (void)ceil_mode;  // it decides only the output size, which grad_output carries
  const c10::cuda::CUDAGuard device_guard(self.device());
  const int64_t dims = self.dim();
  const at::Tensor grad_c = grad_output.contiguous();
  // Written in full by the kernel: no deterministic-mode fill needed.
  at::Tensor grad_input =
      at::Tensor(at::detail::empty_cuda(self.sizes(), self.scalar_type(), self.device(), std::nullopt));
  const int64_t total = grad_input.numel();
  if (total == 0) return grad_input;
  if (grad_c.numel() == 0) return grad_input.zero_();
  const unsigned int blocks = gather::grid_blocks(total);
  // Values formed: offsets below the numels, o * stride + kernel, in + 2 * pad + kernel + stride.
  bool narrow = gather::fits_uint32({total, grad_c.numel(), std::abs(divisor_override.value_or(0))});
  for (int64_t i = 0; i < 3; ++i) {
    narrow = narrow && gather::fits_uint32({(grad_output.size(dims - 3 + i) + 1) * stride[i] + kernel_size[i],
                                            self.size(dims - 3 + i) + 2 * padding[i] + kernel_size[i] + stride[i]});
  }
  // A negative divisor_override (PyTorch accepts it) runs on the signed path.
  narrow = narrow && divisor_override.value_or(1) > 0;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, self.scalar_type(), "avg_pool3d_backward_cuda", [&] {
    using accscalar_t = at::acc_type<scalar_t, /*is_cuda=*/true>;
    gather::with_index_type(narrow, [&](auto index_zero) {
      using index_t = decltype(index_zero);
      auto axis = [&](int64_t i) {
        const auto in = static_cast<index_t>(self.size(dims - 3 + i)), s = static_cast<index_t>(stride[i]);
        return Axis<index_t>{in,
                             static_cast<index_t>(grad_output.size(dims - 3 + i)),
                             static_cast<index_t>(kernel_size[i]),
                             s,
                             static_cast<index_t>(padding[i]),
                             Divider<index_t>(in),
                             Divider<index_t>(s)};
      };
      avg_pool3d_backward_kernel<scalar_t, accscalar_t, index_t><<<blocks, kThreads, 0, stream>>>(
          grad_c.const_data_ptr<scalar_t>(), grad_input.data_ptr<scalar_t>(), static_cast<index_t>(total), axis(0),
          axis(1), axis(2), count_include_pad, static_cast<index_t>(divisor_override.value_or(0)));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  const auto format = self.suggest_memory_format();
  return format == at::MemoryFormat::Contiguous ? grad_input : grad_input.contiguous(format);
}

}  // namespace

TORCH_LIBRARY_IMPL(deepep_lightning, CUDA, m) { m.impl("avg_pool3d_backward", &avg_pool3d_backward_cuda); }

}  // namespace deepep_lightning
