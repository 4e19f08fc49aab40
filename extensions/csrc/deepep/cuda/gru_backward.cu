// CUDA kernel of deepep::gru_cell_backward (formula in ../gru_backward.cpp, element math in ../gru_backward.h).
//
// One thread per (row b, unit j) of the [B, H] state, grid-stride: it reads the six gate
// pre-activations of its unit, h, the two incoming gradients and the row's mask, and writes its
// three columns of grad_input_gates and grad_hidden_gates and one element of grad_hidden. No
// element depends on another, so there is no reduction and no atomic: bitwise reproducible.
// One launch on the current stream, checked, no synchronisation: CUDA-graph capturable.
#include "../gru_backward.h"

#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "cuda/gather_launch.cuh"  // the plugin's launch helpers, in the same build

#include <tuple>

namespace deepep {
namespace {

using deepep_lightning::gather::grid_blocks;
using deepep_lightning::gather::kThreads;

template <typename scalar_t>
__global__ void gru_cell_backward_kernel(const scalar_t* __restrict__ grad_output, const scalar_t* __restrict__ carry,
                                         const scalar_t* __restrict__ mask, const scalar_t* __restrict__ input_gates,
                                         const scalar_t* __restrict__ hidden_gates,
                                         const scalar_t* __restrict__ hidden, scalar_t* __restrict__ grad_input_gates,
                                         scalar_t* __restrict__ grad_hidden_gates, scalar_t* __restrict__ grad_hidden,
                                         int64_t batch, int64_t size) {
  const int64_t total = batch * size;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    const int64_t b = i / size;
    gru_element_backward<scalar_t>(b, i - b * size, size, grad_output, carry, mask, input_gates, hidden_gates, hidden,
                                   grad_input_gates, grad_hidden_gates, grad_hidden);
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> gru_cell_backward_cuda(const at::Tensor& grad_output,
                                                                      const at::Tensor& carry, const at::Tensor& mask,
                                                                      const at::Tensor& input_gates,
                                                                      const at::Tensor& hidden_gates,
                                                                      const at::Tensor& hidden) {
  check_gru_cell_backward_inputs(grad_output, carry, mask, input_gates, hidden_gates, hidden);
  const c10::cuda::CUDAGuard device_guard(hidden.device());
  const at::Tensor go_c = grad_output.contiguous(), carry_c = carry.contiguous(), mask_c = mask.contiguous();
  const at::Tensor gi_c = input_gates.contiguous(), gh_c = hidden_gates.contiguous(), h_c = hidden.contiguous();
  const int64_t batch = h_c.size(0);
  const int64_t size = h_c.size(1);
  at::Tensor grad_gi = at::empty_like(gi_c);  // [B, 3H]
  at::Tensor grad_gh = at::empty_like(gh_c);  // [B, 3H]
  at::Tensor grad_h = at::empty_like(h_c);    // [B, H]
  const int64_t total = batch * size;
  if (total == 0) return std::make_tuple(grad_gi, grad_gh, grad_h);
  const unsigned int blocks = grid_blocks(total);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES(h_c.scalar_type(), "gru_cell_backward_cuda", [&] {
    gru_cell_backward_kernel<scalar_t><<<blocks, kThreads, 0, stream>>>(
        go_c.data_ptr<scalar_t>(), carry_c.data_ptr<scalar_t>(), mask_c.data_ptr<scalar_t>(),
        gi_c.data_ptr<scalar_t>(), gh_c.data_ptr<scalar_t>(), h_c.data_ptr<scalar_t>(), grad_gi.data_ptr<scalar_t>(),
        grad_gh.data_ptr<scalar_t>(), grad_h.data_ptr<scalar_t>(), batch, size);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return std::make_tuple(grad_gi, grad_gh, grad_h);
}

}  // namespace

TORCH_LIBRARY_IMPL(deepep, CUDA, m) { m.impl("gru_cell_backward", &gru_cell_backward_cuda); }

}  // namespace deepep
