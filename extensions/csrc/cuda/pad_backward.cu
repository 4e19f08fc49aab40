// Deterministic CUDA backward of reflection and replication padding, 1-D, 2-D and 3-D.
//
// PyTorch's kernels add every grad_output element into its source with float atomicAdd (the border
// elements have several sources; refused under torch.use_deterministic_algorithms(True)). Here each
// grad_input element gathers. Along an axis (input size I, padding left L / right R, output O = L + I + R),
// output o reads input src(o):
//   reflection: L - o for o < L, o - L inside, 2 (I - 1) + L - o past the end (pads < I);
//   replication: clamp(o - L, 0, I - 1).
// So input i is read by, in increasing o:
//   reflection: L - i (if 1 <= i <= L), i + L, 2 (I - 1) + L - i (if it is >= L + I): at most 3 outputs,
//     computed arithmetically and kept in registers (fixed slots, fully unrolled);
//   replication: the range [i == 0 ? 0 : i + L, i == I - 1 ? O : i + L + 1).
// Thread (plane, d, h, w) sums grad_output over the product of its three axis sets in increasing
// (od, oh, ow) and writes grad_input once; an interior element is one load and one store. Why
// deterministic: a fixed set of terms per element, summed in a fixed order. Missing axes (1-D, 2-D) are
// size-1 axes without padding. Sums are in accscalar_t. Indexing is uint32 when every offset fits
// (gather_launch.cuh); W is innermost, so a warp reads and writes consecutive addresses.
// grad_input is computed contiguous and returned in self's suggested memory format.
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

// Defined in ../pad_backward.cpp.
void check_pad_backward_args(const at::Tensor& grad_output, const at::Tensor& self, at::IntArrayRef padding,
                             bool reflect);

namespace {

using gather::Divider;
using gather::kThreads;

template <typename index_t>
struct PadAxis {
  index_t in, left, out;
};

// Splits a flat grad_input index into (plane, d, h, w).
template <typename index_t>
struct Position {
  index_t plane, d, h, w;
};

template <typename index_t>
struct Splitter {
  Divider<index_t> w, h, d;

  __device__ __forceinline__ Position<index_t> operator()(index_t index) const {
    const auto by_w = w.divmod(index);
    const auto by_h = h.divmod(by_w.div);
    const auto by_d = d.divmod(by_h.div);
    return {by_d.div, by_d.mod, by_h.mod, by_w.mod};
  }
};

// The (up to 3) outputs reading input i along a reflected axis, increasing; slot 1 always holds.
template <typename index_t>
struct Reflected {
  index_t at[3];
  bool holds[3];
};

template <typename index_t>
__device__ __forceinline__ Reflected<index_t> reflected(const PadAxis<index_t>& a, index_t i) {
  Reflected<index_t> r;
  r.at[0] = a.left - i;
  r.holds[0] = i >= 1 && i <= a.left;
  r.at[1] = i + a.left;
  r.holds[1] = true;
  r.at[2] = 2 * (a.in - 1) + a.left - i;
  r.holds[2] = r.at[2] >= a.left + a.in && r.at[2] < a.out;
  return r;
}

template <typename scalar_t, typename accscalar_t, typename index_t>
__global__ void __launch_bounds__(kThreads)
    reflection_pad_backward_kernel(const scalar_t* __restrict__ grad_output, scalar_t* __restrict__ grad_input,
                                   index_t total, PadAxis<index_t> ad, PadAxis<index_t> ah, PadAxis<index_t> aw,
                                   Splitter<index_t> split) {
  const index_t step = static_cast<index_t>(gridDim.x) * kThreads;
  for (index_t index = static_cast<index_t>(blockIdx.x) * kThreads + threadIdx.x; index < total; index += step) {
    const auto [plane, d, h, w] = split(index);
    const scalar_t* plane_grad = grad_output + plane * ad.out * ah.out * aw.out;
    const Reflected<index_t> sd = reflected(ad, d), sh = reflected(ah, h), sw = reflected(aw, w);
    accscalar_t sum = 0;
#pragma unroll
    for (int kd = 0; kd < 3; ++kd) {
      if (!sd.holds[kd]) continue;
#pragma unroll
      for (int kh = 0; kh < 3; ++kh) {
        if (!sh.holds[kh]) continue;
        const scalar_t* row = plane_grad + (sd.at[kd] * ah.out + sh.at[kh]) * aw.out;
#pragma unroll
        for (int kw = 0; kw < 3; ++kw) {
          if (sw.holds[kw]) sum += static_cast<accscalar_t>(row[sw.at[kw]]);
        }
      }
    }
    grad_input[index] = static_cast<scalar_t>(sum);
  }
}

// The outputs reading input i along a replicated axis: [begin, end).
template <typename index_t>
__device__ __forceinline__ index_t replicated_begin(const PadAxis<index_t>& a, index_t i) {
  return i == 0 ? 0 : i + a.left;
}

template <typename index_t>
__device__ __forceinline__ index_t replicated_end(const PadAxis<index_t>& a, index_t i) {
  return i == a.in - 1 ? a.out : i + a.left + 1;
}

template <typename scalar_t, typename accscalar_t, typename index_t>
__global__ void __launch_bounds__(kThreads)
    replication_pad_backward_kernel(const scalar_t* __restrict__ grad_output, scalar_t* __restrict__ grad_input,
                                    index_t total, PadAxis<index_t> ad, PadAxis<index_t> ah, PadAxis<index_t> aw,
                                    Splitter<index_t> split) {
  const index_t step = static_cast<index_t>(gridDim.x) * kThreads;
  for (index_t index = static_cast<index_t>(blockIdx.x) * kThreads + threadIdx.x; index < total; index += step) {
    const auto [plane, d, h, w] = split(index);
    const scalar_t* plane_grad = grad_output + plane * ad.out * ah.out * aw.out;
    const index_t w0 = replicated_begin(aw, w), w1 = replicated_end(aw, w);
    const index_t h0 = replicated_begin(ah, h), h1 = replicated_end(ah, h);
    const index_t d1 = replicated_end(ad, d);
    accscalar_t sum = 0;
    for (index_t od = replicated_begin(ad, d); od < d1; ++od) {
      for (index_t oh = h0; oh < h1; ++oh) {
        const scalar_t* row = plane_grad + (od * ah.out + oh) * aw.out;
        for (index_t ow = w0; ow < w1; ++ow) sum += static_cast<accscalar_t>(row[ow]);
      }
    }
    grad_input[index] = static_cast<scalar_t>(sum);
  }
}

at::Tensor pad_backward_cuda(const at::Tensor& grad_output, const at::Tensor& self, at::IntArrayRef padding,
                             bool reflect) {
  check_pad_backward_args(grad_output, self, padding, reflect);
  TORCH_CHECK(self.is_cuda() && grad_output.device() == self.device(),
              "pad_backward: grad_output and self must be on one CUDA device, got ", grad_output.device(), " and ",
              self.device());
  const c10::cuda::CUDAGuard device_guard(self.device());
  const int64_t dims = self.dim(), spatial = static_cast<int64_t>(padding.size()) / 2;
  // axis 0 = last dim (padding[0], padding[1]), as aten orders padding.
  auto axis = [&](int64_t from_last) {
    if (from_last >= spatial) return PadAxis<int64_t>{1, 0, 1};
    return PadAxis<int64_t>{self.size(dims - 1 - from_last), padding[2 * from_last],
                            grad_output.size(dims - 1 - from_last)};
  };
  const at::Tensor grad_c = grad_output.contiguous();
  // Written in full by the kernel: no deterministic-mode fill needed.
  at::Tensor grad_input =
      at::Tensor(at::detail::empty_cuda(self.sizes(), self.scalar_type(), self.device(), std::nullopt));
  const int64_t total = grad_input.numel();
  if (total == 0) return grad_input;
  const unsigned int blocks = gather::grid_blocks(total);
  const bool narrow = gather::fits_uint32({grad_c.numel(), total});
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, self.scalar_type(), "pad_backward_cuda", [&] {
    using accscalar_t = at::acc_type<scalar_t, /*is_cuda=*/true>;
    gather::with_index_type(narrow, [&](auto index_zero) {
      using index_t = decltype(index_zero);
      auto narrowed = [&](const PadAxis<int64_t>& a) {
        return PadAxis<index_t>{static_cast<index_t>(a.in), static_cast<index_t>(a.left), static_cast<index_t>(a.out)};
      };
      const PadAxis<index_t> ad = narrowed(axis(2)), ah = narrowed(axis(1)), aw = narrowed(axis(0));
      const Splitter<index_t> split{Divider<index_t>(aw.in), Divider<index_t>(ah.in), Divider<index_t>(ad.in)};
      const auto kernel = reflect ? reflection_pad_backward_kernel<scalar_t, accscalar_t, index_t>
                                  : replication_pad_backward_kernel<scalar_t, accscalar_t, index_t>;
      kernel<<<blocks, kThreads, 0, stream>>>(grad_c.const_data_ptr<scalar_t>(), grad_input.data_ptr<scalar_t>(),
                                              static_cast<index_t>(total), ad, ah, aw, split);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  const auto format = self.suggest_memory_format();
  return format == at::MemoryFormat::Contiguous ? grad_input : grad_input.contiguous(format);
}

at::Tensor reflection_pad_backward_cuda(const at::Tensor& grad_output, const at::Tensor& self, at::IntArrayRef padding) {
  return pad_backward_cuda(grad_output, self, padding, true);
}

at::Tensor replication_pad_backward_cuda(const at::Tensor& grad_output, const at::Tensor& self,
                                         at::IntArrayRef padding) {
  return pad_backward_cuda(grad_output, self, padding, false);
}

}  // namespace

TORCH_LIBRARY_IMPL(deepep_lightning, CUDA, m) {
  m.impl("reflection_pad_backward", &reflection_pad_backward_cuda);
  m.impl("replication_pad_backward", &replication_pad_backward_cuda);
}

}  // namespace deepep_lightning
