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
// D = OD = 1. grad_input is computed contiguous and returned in self's suggested memory format
// (channels-last in, channels-last out, as PyTorch does). All work is on the current stream, no sync.
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
#include <vector>

namespace deepep {

// Defined in ../adaptive_avg_pool_backward.cpp.
void check_adaptive_avg_pool_backward_args(const at::Tensor& grad_output, const at::Tensor& self, int64_t spatial);

namespace {

constexpr int kThreads = 256;

struct Extents {
  int64_t in_d, in_h, in_w, out_d, out_h, out_w;
};

__device__ __forceinline__ int64_t window_start(int64_t o, int64_t out_size, int64_t in_size) {
  return (o * in_size) / out_size;
}

__device__ __forceinline__ int64_t window_end(int64_t o, int64_t out_size, int64_t in_size) {
  return ((o + 1) * in_size + out_size - 1) / out_size;
}

template <typename scalar_t, typename accscalar_t>
__global__ void __launch_bounds__(kThreads)
    adaptive_avg_pool_backward_kernel(const scalar_t* __restrict__ grad_output, scalar_t* __restrict__ grad_input,
                                      int64_t total, Extents e) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t index = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; index < total; index += step) {
    const int64_t w = index % e.in_w;
    const int64_t h = (index / e.in_w) % e.in_h;
    const int64_t d = (index / (e.in_w * e.in_h)) % e.in_d;
    const int64_t plane = index / (e.in_w * e.in_h * e.in_d);
    // The windows holding (d, h, w): the window formulas with input and output sizes swapped.
    const int64_t od0 = window_start(d, e.in_d, e.out_d), od1 = window_end(d, e.in_d, e.out_d);
    const int64_t oh0 = window_start(h, e.in_h, e.out_h), oh1 = window_end(h, e.in_h, e.out_h);
    const int64_t ow0 = window_start(w, e.in_w, e.out_w), ow1 = window_end(w, e.in_w, e.out_w);
    const scalar_t* plane_grad = grad_output + plane * e.out_d * e.out_h * e.out_w;
    accscalar_t sum = 0;
    for (int64_t od = od0; od < od1; ++od) {
      const int64_t size_d = window_end(od, e.out_d, e.in_d) - window_start(od, e.out_d, e.in_d);
      for (int64_t oh = oh0; oh < oh1; ++oh) {
        const int64_t size_dh = size_d * (window_end(oh, e.out_h, e.in_h) - window_start(oh, e.out_h, e.in_h));
        const scalar_t* row = plane_grad + (od * e.out_h + oh) * e.out_w;
        for (int64_t ow = ow0; ow < ow1; ++ow) {
          const int64_t size = size_dh * (window_end(ow, e.out_w, e.in_w) - window_start(ow, e.out_w, e.in_w));
          sum += static_cast<accscalar_t>(row[ow]) / static_cast<accscalar_t>(size);
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
  const Extents extents{spatial == 3 ? size(self, 3) : 1,        size(self, 2),        size(self, 1),
                        spatial == 3 ? size(grad_output, 3) : 1, size(grad_output, 2), size(grad_output, 1)};
  const at::Tensor grad_c = grad_output.contiguous();
  // Written in full by the kernel: no deterministic-mode fill needed.
  at::Tensor grad_input =
      at::Tensor(at::detail::empty_cuda(self.sizes(), self.scalar_type(), self.device(), std::nullopt));
  const int64_t total = grad_input.numel();
  if (total == 0) return grad_input;
  if (grad_c.numel() == 0) return grad_input.zero_();
  const int64_t blocks = std::min<int64_t>((total + kThreads - 1) / kThreads, int64_t{1} << 20);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, self.scalar_type(), "adaptive_avg_pool_backward_cuda", [&] {
    using accscalar_t = at::acc_type<scalar_t, /*is_cuda=*/true>;
    adaptive_avg_pool_backward_kernel<scalar_t, accscalar_t><<<static_cast<unsigned int>(blocks), kThreads, 0, stream>>>(
        grad_c.const_data_ptr<scalar_t>(), grad_input.data_ptr<scalar_t>(), total, extents);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
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

TORCH_LIBRARY_IMPL(deepep, CUDA, m) {
  m.impl("adaptive_avg_pool2d_backward", &adaptive_avg_pool2d_backward_cuda);
  m.impl("adaptive_avg_pool3d_backward", &adaptive_avg_pool3d_backward_cuda);
}

}  // namespace deepep
