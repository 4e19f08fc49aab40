// Deterministic CUDA backward of adaptive average pooling, 2-D and 3-D (aten::_adaptive_avg_pool2d_backward,
// aten::_adaptive_avg_pool3d_backward).
//
// PyTorch's kernels scatter every grad_output cell into its window with float atomicAdd when windows
// overlap (refused under torch.use_deterministic_algorithms(True)). Here each grad_input element
// gathers instead. Along an axis of input size I and output size O, output cell o averages the inputs
// [floor(o * I / O), ceil((o + 1) * I / O)) (PyTorch's start_index / end_index), and input i lies in
// exactly the windows o in [floor(i * O / I), ceil((i + 1) * O / I)): the same two formulas with I and
// O swapped. So thread (plane, d, h, w) sums grad_output(od, oh, ow) / window_size(od, oh, ow) over
// that box in increasing od, then oh, then ow, and writes grad_input once.
// Why deterministic: every sum has a fixed set of terms in a fixed order, whatever the launch.
// Sums are in accscalar_t (float for float/half/bfloat16, double for double). 2-D runs as 3-D with
// D = OD = 1. Every division by a size goes through IntDivider (uint32 multiply-shift when every value
// fits, gather_launch.cuh), window bounds are hoisted out of the inner loops, W is innermost. grad_input is computed contiguous and returned in self's suggested memory format
// (channels-last in, channels-last out, as PyTorch does). All work is on the current stream, no sync.
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

// Defined in ../adaptive_avg_pool_backward.cpp.
void check_adaptive_avg_pool_backward_args(const at::Tensor& grad_output, const at::Tensor& self, int64_t spatial);

namespace {

using gather::Divider;
using gather::kThreads;

// One axis of input size `in` and output size `out`, with dividers by both sizes.
template <typename index_t>
struct AdaptiveAxis {
  index_t in, out;
  Divider<index_t> by_in, by_out;

  // Output window o covers inputs [floor(o * in / out), ceil((o + 1) * in / out)).
  __device__ __forceinline__ index_t window_size(index_t o) const {
    return by_out.div((o + 1) * in + out - 1) - by_out.div(o * in);
  }
  // Input i lies in the windows [floor(i * out / in), ceil((i + 1) * out / in)).
  __device__ __forceinline__ index_t first_window(index_t i) const { return by_in.div(i * out); }
  __device__ __forceinline__ index_t end_window(index_t i) const { return by_in.div((i + 1) * out + in - 1); }
};

template <typename scalar_t, typename accscalar_t, typename index_t>
__global__ void __launch_bounds__(kThreads)
    adaptive_avg_pool_backward_kernel(const scalar_t* __restrict__ grad_output, scalar_t* __restrict__ grad_input,
                                      index_t total, AdaptiveAxis<index_t> ad, AdaptiveAxis<index_t> ah,
                                      AdaptiveAxis<index_t> aw) {
  const index_t step = static_cast<index_t>(gridDim.x) * kThreads;
  for (index_t index = static_cast<index_t>(blockIdx.x) * kThreads + threadIdx.x; index < total; index += step) {
    const auto by_w = aw.by_in.divmod(index);
    const auto by_h = ah.by_in.divmod(by_w.div);
    const auto by_d = ad.by_in.divmod(by_h.div);
    const index_t w = by_w.mod, h = by_h.mod, d = by_d.mod, plane = by_d.div;
    const index_t od0 = ad.first_window(d), od1 = ad.end_window(d);
    const index_t oh0 = ah.first_window(h), oh1 = ah.end_window(h);
    const index_t ow0 = aw.first_window(w), ow1 = aw.end_window(w);
    const scalar_t* plane_grad = grad_output + plane * ad.out * ah.out * aw.out;
    accscalar_t sum = 0;
    for (index_t od = od0; od < od1; ++od) {
      const index_t size_d = ad.window_size(od);
      for (index_t oh = oh0; oh < oh1; ++oh) {
        const index_t size_dh = size_d * ah.window_size(oh);
        const scalar_t* row = plane_grad + (od * ah.out + oh) * aw.out;
        for (index_t ow = ow0; ow < ow1; ++ow) {
          sum += static_cast<accscalar_t>(row[ow]) / static_cast<accscalar_t>(size_dh * aw.window_size(ow));
        }
      }
    }
    grad_input[index] = static_cast<scalar_t>(sum);
  }
}

at::Tensor adaptive_avg_pool_backward_cuda(const at::Tensor& grad_output, const at::Tensor& self, int64_t spatial) {
  check_adaptive_avg_pool_backward_args(grad_output, self, spatial);
  TORCH_CHECK(self.is_cuda() && grad_output.device() == self.device(), "adaptive_avg_pool", spatial,
              "d_backward: grad_output and self must be on one CUDA device, got ", grad_output.device(), " and ",
              self.device());
  const c10::cuda::CUDAGuard device_guard(self.device());
  const int64_t dims = self.dim();
  auto size = [&](const at::Tensor& t, int64_t axis_from_end) { return t.size(dims - axis_from_end); };
  const int64_t in_d = spatial == 3 ? size(self, 3) : 1, out_d = spatial == 3 ? size(grad_output, 3) : 1;
  const int64_t in_h = size(self, 2), out_h = size(grad_output, 2), in_w = size(self, 1), out_w = size(grad_output, 1);
  const at::Tensor grad_c = grad_output.contiguous();
  // Written in full by the kernel: no deterministic-mode fill needed.
  at::Tensor grad_input =
      at::Tensor(at::detail::empty_cuda(self.sizes(), self.scalar_type(), self.device(), std::nullopt));
  const int64_t total = grad_input.numel();
  if (total == 0) return grad_input;
  if (grad_c.numel() == 0) return grad_input.zero_();
  const unsigned int blocks = gather::grid_blocks(total);
  // The window formulas form (size + 1) * other_size + size along each axis.
  const bool narrow = gather::fits_uint32({total, grad_c.numel(), (in_d + 1) * (out_d + 1), (in_h + 1) * (out_h + 1),
                                           (in_w + 1) * (out_w + 1)});
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, self.scalar_type(), "adaptive_avg_pool_backward_cuda", [&] {
    using accscalar_t = at::acc_type<scalar_t, /*is_cuda=*/true>;
    gather::with_index_type(narrow, [&](auto index_zero) {
      using index_t = decltype(index_zero);
      auto axis = [](int64_t in, int64_t out) {
        return AdaptiveAxis<index_t>{static_cast<index_t>(in), static_cast<index_t>(out),
                                     Divider<index_t>(static_cast<index_t>(in)),
                                     Divider<index_t>(static_cast<index_t>(out))};
      };
      adaptive_avg_pool_backward_kernel<scalar_t, accscalar_t, index_t><<<blocks, kThreads, 0, stream>>>(
          grad_c.const_data_ptr<scalar_t>(), grad_input.data_ptr<scalar_t>(), static_cast<index_t>(total),
          axis(in_d, out_d), axis(in_h, out_h), axis(in_w, out_w));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  const auto format = self.suggest_memory_format();
  return format == at::MemoryFormat::Contiguous ? grad_input : grad_input.contiguous(format);
}

at::Tensor adaptive_avg_pool2d_backward_cuda(const at::Tensor& grad_output, const at::Tensor& self) {
  return adaptive_avg_pool_backward_cuda(grad_output, self, 2);
}

at::Tensor adaptive_avg_pool3d_backward_cuda(const at::Tensor& grad_output, const at::Tensor& self) {
  return adaptive_avg_pool_backward_cuda(grad_output, self, 3);
}

}  // namespace

TORCH_LIBRARY_IMPL(deepep_lightning, CUDA, m) {
  m.impl("adaptive_avg_pool2d_backward", &adaptive_avg_pool2d_backward_cuda);
  m.impl("adaptive_avg_pool3d_backward", &adaptive_avg_pool3d_backward_cuda);
}

}  // namespace deepep_lightning
