// CUDA kernel of deepep::lambda_returns (formula in ../lambda_returns.cpp, column recursion in ../lambda_returns.h).
//
// One thread per column of the [T, B] rollout runs its T timesteps in sequence; neighbouring threads
// read neighbouring columns of a row, so every load of a timestep is coalesced. No column depends on
// another: no reduction, no atomic, bitwise reproducible. One launch on the current stream, checked,
// no synchronisation: CUDA-graph capturable.
#include "../lambda_returns.h"

#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

namespace deepep {
namespace {

constexpr int kThreads = 128;

template <typename scalar_t>
__global__ void lambda_returns_kernel(const scalar_t* __restrict__ rewards, const bool* __restrict__ dones,
                                      const scalar_t* __restrict__ values,
                                      const scalar_t* __restrict__ bootstrap_value, scalar_t gamma,
                                      scalar_t one_minus_lam, scalar_t lam, scalar_t* __restrict__ returns,
                                      int64_t horizon, int64_t batch) {
  const int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b < batch) {
    lambda_returns_column<scalar_t>(b, horizon, batch, rewards, dones, values, bootstrap_value, gamma, one_minus_lam,
                                    lam, returns);
  }
}

at::Tensor lambda_returns_cuda(const at::Tensor& rewards, const at::Tensor& dones, const at::Tensor& values,
                               const at::Tensor& bootstrap_value, double gamma, double lam) {
  check_lambda_returns_inputs(rewards, dones, values, bootstrap_value);
  const c10::cuda::CUDAGuard device_guard(rewards.device());
  const at::Tensor r_c = rewards.contiguous(), d_c = dones.contiguous(), v_c = values.contiguous();
  const at::Tensor b_c = bootstrap_value.contiguous();
  const int64_t horizon = r_c.size(0);
  const int64_t batch = r_c.size(1);
  at::Tensor returns = at::empty_like(r_c);
  if (returns.numel() == 0) return returns;
  const auto blocks = static_cast<unsigned int>((batch + kThreads - 1) / kThreads);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES(r_c.scalar_type(), "lambda_returns_cuda", [&] {
    lambda_returns_kernel<scalar_t><<<blocks, kThreads, 0, stream>>>(
        r_c.data_ptr<scalar_t>(), d_c.data_ptr<bool>(), v_c.data_ptr<scalar_t>(), b_c.data_ptr<scalar_t>(),
        static_cast<scalar_t>(gamma), static_cast<scalar_t>(1.0 - lam), static_cast<scalar_t>(lam),
        returns.data_ptr<scalar_t>(), horizon, batch);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return returns;
}

}  // namespace

TORCH_LIBRARY_IMPL(deepep, CUDA, m) { m.impl("lambda_returns", &lambda_returns_cuda); }

}  // namespace deepep
