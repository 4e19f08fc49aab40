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
// accscalar_t. grad_input is computed contiguous and returned in self's suggested memory format.
// All work is on the current stream, no sync.
#include <ATen/ATen.h>
#include <ATen/AccumulateType.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/EmptyTensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>

namespace deepep {

// Defined in ../avg_pool3d_backward.cpp.
void check_avg_pool3d_backward_args(const at::Tensor& grad_output, const at::Tensor& self, at::IntArrayRef kernel_size,
                                    at::IntArrayRef stride, at::IntArrayRef padding);

namespace {

constexpr int kThreads = 256;

struct Axis {
  int64_t in, out, kernel, stride, pad;

  // First and one-past-last output whose window holds input i.
  __device__ __forceinline__ int64_t first(int64_t i) const {
    const int64_t low = i + pad - kernel + 1;
    return low <= 0 ? 0 : (low + stride - 1) / stride;
  }
  __device__ __forceinline__ int64_t last(int64_t i) const { return min((i + pad) / stride + 1, out); }
  __device__ __forceinline__ int64_t start(int64_t o) const { return o * stride - pad; }
  __device__ __forceinline__ int64_t padded_end(int64_t o) const { return min(start(o) + kernel, in + pad); }
};

template <typename scalar_t, typename accscalar_t>
__global__ void __launch_bounds__(kThreads)
    avg_pool3d_backward_kernel(const scalar_t* __restrict__ grad_output, scalar_t* __restrict__ grad_input,
                               int64_t total, Axis ad, Axis ah, Axis aw, bool count_include_pad,
                               int64_t divisor_override) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t index = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; index < total; index += step) {
    const int64_t w = index % aw.in;
    const int64_t h = (index / aw.in) % ah.in;
    const int64_t d = (index / (aw.in * ah.in)) % ad.in;
    const int64_t plane = index / (aw.in * ah.in * ad.in);
    const scalar_t* plane_grad = grad_output + plane * ad.out * ah.out * aw.out;
    accscalar_t sum = 0;
    for (int64_t od = ad.first(d); od < ad.last(d); ++od) {
      const int64_t d0 = ad.start(od), d1 = ad.padded_end(od);
      for (int64_t oh = ah.first(h); oh < ah.last(h); ++oh) {
        const int64_t h0 = ah.start(oh), h1 = ah.padded_end(oh);
        for (int64_t ow = aw.first(w); ow < aw.last(w); ++ow) {
          const int64_t w0 = aw.start(ow), w1 = aw.padded_end(ow);
          int64_t divisor;
          if (divisor_override != 0) {
            divisor = divisor_override;
          } else if (count_include_pad) {
            divisor = (d1 - d0) * (h1 - h0) * (w1 - w0);
          } else {
            divisor = (min(d1, ad.in) - max(d0, int64_t{0})) * (min(h1, ah.in) - max(h0, int64_t{0})) *
                      (min(w1, aw.in) - max(w0, int64_t{0}));
          }
          sum += static_cast<accscalar_t>(plane_grad[(od * ah.out + oh) * aw.out + ow]) /
                 static_cast<accscalar_t>(divisor);
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
  auto axis = [&](int64_t i) {
    return Axis{self.size(dims - 3 + i), grad_output.size(dims - 3 + i), kernel_size[i], stride[i], padding[i]};
  };
  const at::Tensor grad_c = grad_output.contiguous();
  // Written in full by the kernel: no deterministic-mode fill needed.
  at::Tensor grad_input =
      at::Tensor(at::detail::empty_cuda(self.sizes(), self.scalar_type(), self.device(), std::nullopt));
  const int64_t total = grad_input.numel();
  if (total == 0) return grad_input;
  if (grad_c.numel() == 0) return grad_input.zero_();
  const int64_t blocks = std::min<int64_t>((total + kThreads - 1) / kThreads, int64_t{1} << 20);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, self.scalar_type(), "avg_pool3d_backward_cuda", [&] {
    using accscalar_t = at::acc_type<scalar_t, /*is_cuda=*/true>;
    avg_pool3d_backward_kernel<scalar_t, accscalar_t><<<static_cast<unsigned int>(blocks), kThreads, 0, stream>>>(
        grad_c.const_data_ptr<scalar_t>(), grad_input.data_ptr<scalar_t>(), total, axis(0), axis(1), axis(2),
        count_include_pad, divisor_override.value_or(0));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  const auto format = self.suggest_memory_format();
  return format == at::MemoryFormat::Contiguous ? grad_input : grad_input.contiguous(format);
}

}  // namespace

TORCH_LIBRARY_IMPL(deepep, CUDA, m) { m.impl("avg_pool3d_backward", &avg_pool3d_backward_cuda); }

}  // namespace deepep
