// Deterministic CUDA argmax_window_backward and max_unpool_forward (schemas, CPU kernels: ../max_pool_backward.cpp).
//
// argmax_window_backward, where at most kMaxScatterPasses passes of pairwise disjoint windows cover the
// windows (one pass for float16/bfloat16; ../max_pool_windows.h): a memset, then one launch per pass, one thread per window of the pass,
// each adding its grad_output to its argmax cell with a plain read-modify-write (no two windows of a pass
// share a cell; the launches on one stream order the passes). Otherwise it gathers: one thread per input
// cell (p, d, h, w) visits the output cells whose window can hold it -- for a max pooling the od in
// [p_start, p_end) of PyTorch's own max_pool2d backward, for an adaptive pooling the o in
// [floor(i n / m), ceil((i + 1) n / m)) -- in ascending (od, oh, ow) order, and adds grad_output where the
// saved index is this cell. No float atomics, no sort: which terms a cell sums and their order depend on
// the shapes alone, so the result is bitwise reproducible and a sample's gradient does not depend on the
// batch. Sums run in acc_type (float for half/bfloat16/float, double for double).
//
// max_unpool_forward: pass 1, one thread per input entry j of plane p, atomicMax(winner[p, indices[p, j]], j)
// on int32 (integer max is order-free: the winner is the same whatever the thread order); pass 2, one
// thread per output cell writes self[p, winner] or 0. The largest j wins, as in PyTorch's CPU loop.
//
// Outputs and scratch come from at::detail::empty_cuda (at::empty NaN-fills in deterministic mode;
// every element is written). All work is on the current stream, nothing synchronises and no size
// depends on data (CUDA-graph capturable).
#include <ATen/ATen.h>
#include <ATen/AccumulateType.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/EmptyTensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <vector>

#include "max_pool_windows.h"

namespace deepep_lightning {

// Defined in ../max_pool_backward.cpp.
int64_t argmax_planes(const at::Tensor& tensor, int64_t spatial_dims, const char* op);
std::vector<int64_t> argmax_window_check(const at::Tensor& grad_output, const at::Tensor& indices,
                                         at::IntArrayRef input_size, at::IntArrayRef kernel_size,
                                         at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation);
std::vector<int64_t> max_unpool_check(const at::Tensor& self, const at::Tensor& indices, at::IntArrayRef output_size);
PoolWindows pool_windows(const at::Tensor& grad_output, at::IntArrayRef input_size, at::IntArrayRef kernel_size,
                         at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation);

namespace {

constexpr int kThreads = 256;

template <typename scalar_t>
__global__ void argmax_window_backward_kernel(const int64_t total, const PoolWindows w,
                                              const scalar_t* __restrict__ grad_output,
                                              const int64_t* __restrict__ indices, scalar_t* __restrict__ grad_input) {
  using acc_t = at::acc_type<scalar_t, true>;
  for (int64_t item = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; item < total;
       item += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    grad_input[item] = pool_gather_one<scalar_t, acc_t>(w, item, grad_output, indices);
  }
}

template <typename scalar_t>
__global__ void argmax_window_scatter_kernel(const int64_t windows, const PoolWindows w, const ScatterPass pass,
                                             const scalar_t* __restrict__ grad_output,
                                             const int64_t* __restrict__ indices, scalar_t* __restrict__ grad_input) {
  using acc_t = at::acc_type<scalar_t, true>;
  for (int64_t item = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; item < windows;
       item += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    pool_scatter_one<scalar_t, acc_t>(w, pass, item, grad_output, indices, grad_input);
  }
}

__global__ void unpool_winner_kernel(const int64_t total, const int64_t in_cells, const int64_t out_cells,
                                     const int64_t* __restrict__ indices, int32_t* __restrict__ winner) {
  for (int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; j < total;
       j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t plane = j / in_cells;
    const int64_t target = indices[j];
    CUDA_KERNEL_ASSERT(target >= 0 && target < out_cells && "max_unpool: index out of range");
    atomicMax(winner + plane * out_cells + target, static_cast<int32_t>(j - plane * in_cells));
  }
}

template <typename scalar_t>
__global__ void unpool_gather_kernel(const int64_t total, const int64_t in_cells, const int64_t out_cells,
                                     const int32_t* __restrict__ winner, const scalar_t* __restrict__ self,
                                     scalar_t* __restrict__ out) {
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < total;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int32_t position = winner[k];
    out[k] = position >= 0 ? self[(k / out_cells) * in_cells + position] : scalar_t(0);
  }
}

unsigned int blocks_for(int64_t items) {
  const int64_t blocks = (items + kThreads - 1) / kThreads;
  return static_cast<unsigned int>(std::min<int64_t>(std::max<int64_t>(blocks, 1), 1 << 20));
}

at::Tensor empty_unfilled(at::IntArrayRef shape, at::ScalarType dtype, at::Device device) {
  return at::Tensor(at::detail::empty_cuda(shape, dtype, device, std::nullopt));
}

at::Tensor argmax_window_backward_cuda(const at::Tensor& grad_output, const at::Tensor& indices,
                                       at::IntArrayRef input_size, at::IntArrayRef kernel_size, at::IntArrayRef stride,
                                       at::IntArrayRef padding, at::IntArrayRef dilation) {
  const std::vector<int64_t> shape =
      argmax_window_check(grad_output, indices, input_size, kernel_size, stride, padding, dilation);
  TORCH_CHECK(grad_output.is_cuda() && indices.device() == grad_output.device(),
              "argmax_window_backward: grad_output and indices must be on one CUDA device, got ", grad_output.device(),
              " and ", indices.device());
  const PoolWindows w = pool_windows(grad_output, input_size, kernel_size, stride, padding, dilation);
  const c10::cuda::CUDAGuard device_guard(grad_output.device());
  at::Tensor grad_input = empty_unfilled(shape, grad_output.scalar_type(), grad_output.device());
  const int64_t total = grad_input.numel();
  if (total == 0) return grad_input;
  if (grad_output.numel() == 0) return grad_input.zero_();
  const at::Tensor grad_c = grad_output.contiguous();
  const at::Tensor indices_c = indices.contiguous();
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  int classes[3];
  const int passes = pool_scatter_passes(w, classes);
  const int64_t planes = total / (static_cast<int64_t>(w.in[0]) * w.in[1] * w.in[2]);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad_c.scalar_type(), "argmax_window_backward_cuda", [&] {
    if (pool_scatter_in_passes(passes, sizeof(scalar_t) < sizeof(float))) {
      C10_CUDA_CHECK(cudaMemsetAsync(grad_input.data_ptr(), 0, sizeof(scalar_t) * total, stream));
      for (int index = 0; index < passes; ++index) {
        const ScatterPass pass = scatter_pass(w, classes, index);
        const int64_t windows = planes * pass.count[0] * pass.count[1] * pass.count[2];
        if (windows == 0) continue;
        argmax_window_scatter_kernel<scalar_t><<<blocks_for(windows), kThreads, 0, stream>>>(
            windows, w, pass, grad_c.data_ptr<scalar_t>(), indices_c.data_ptr<int64_t>(),
            grad_input.data_ptr<scalar_t>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
      return;
    }
    argmax_window_backward_kernel<scalar_t><<<blocks_for(total), kThreads, 0, stream>>>(
        total, w, grad_c.data_ptr<scalar_t>(), indices_c.data_ptr<int64_t>(), grad_input.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return grad_input;
}

at::Tensor max_unpool_forward_cuda(const at::Tensor& self, const at::Tensor& indices, at::IntArrayRef output_size) {
  const std::vector<int64_t> shape = max_unpool_check(self, indices, output_size);
  TORCH_CHECK(self.is_cuda() && indices.device() == self.device(),
              "max_unpool_forward: self and indices must be on one CUDA device, got ", self.device(), " and ",
              indices.device());
  const int64_t dims = static_cast<int64_t>(output_size.size());
  const int64_t planes = argmax_planes(self, dims, "max_unpool_forward");
  const c10::cuda::CUDAGuard device_guard(self.device());
  at::Tensor out = empty_unfilled(shape, self.scalar_type(), self.device());
  const int64_t out_total = out.numel();
  if (out_total == 0) return out;
  if (self.numel() == 0) return out.zero_();
  const int64_t in_cells = self.numel() / planes;
  const int64_t out_cells = out_total / planes;
  TORCH_CHECK(in_cells < INT_MAX, "max_unpool_forward: an input plane must hold fewer than 2^31 - 1 cells, got ",
              in_cells);
  const at::Tensor self_c = self.contiguous();
  const at::Tensor indices_c = indices.contiguous();
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const at::Tensor winner = empty_unfilled({out_total}, at::kInt, self.device());
  C10_CUDA_CHECK(cudaMemsetAsync(winner.data_ptr(), 0xFF, sizeof(int32_t) * out_total, stream));  // -1: unwritten
  unpool_winner_kernel<<<blocks_for(self.numel()), kThreads, 0, stream>>>(
      self.numel(), in_cells, out_cells, indices_c.data_ptr<int64_t>(), winner.data_ptr<int32_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, self_c.scalar_type(), "max_unpool_forward_cuda", [&] {
    unpool_gather_kernel<scalar_t><<<blocks_for(out_total), kThreads, 0, stream>>>(
        out_total, in_cells, out_cells, winner.data_ptr<int32_t>(), self_c.data_ptr<scalar_t>(),
        out.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(deepep_lightning, CUDA, m) {
  m.impl("argmax_window_backward", &argmax_window_backward_cuda);
  m.impl("max_unpool_forward", &max_unpool_forward_cuda);
}

}  // namespace deepep_lightning
