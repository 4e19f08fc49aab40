// CUDA kernel of deepep::cartpole_rollout (what and why: ../cartpole_rollout.h; the stages are shared with the CPU
// kernel there).
//
// One launch runs the whole rollout: a block of kThreads threads owns `rows_per_block` environments for all T
// timesteps, with its rows' inputs and CartPole states in shared memory and a barrier between stages. No
// atomics, fixed summation orders: bitwise reproducible. On the current stream, no synchronisation: CUDA-graph
// capturable.
#include "../cartpole_rollout.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

namespace deepep::rollout {
namespace {

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads) cartpole_rollout_kernel(const Args<scalar_t> args, int64_t rows_per_block) {
  extern __shared__ unsigned char raw[];
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * rows_per_block;
  const int64_t count = rows_per_block < args.batch - row0 ? rows_per_block : args.batch - row0;
  const Block<scalar_t> blk(args, reinterpret_cast<scalar_t*>(raw), row0, count);
  const int tid = static_cast<int>(threadIdx.x), threads = static_cast<int>(blockDim.x);
  blk.load(tid, threads);
  __syncthreads();
  for (int64_t t = 0; t < args.steps; ++t) {
    blk.hidden_layers(tid, threads);
    __syncthreads();
    blk.head_partials(tid, threads);
    __syncthreads();
    blk.head_finish(tid, threads);
    __syncthreads();
    blk.act_and_env(t, tid, threads);
    __syncthreads();
    blk.gru(t, tid, threads);
    __syncthreads();
    blk.commit(tid, threads);
    __syncthreads();
  }
  blk.store(tid, threads);
}

template <typename scalar_t>
void launch(const Args<scalar_t>& args, int64_t rows_per_block) {
  const int64_t bytes =
      shared_scalars(kMaxRows, args.hidden, args.policy_hidden, args.value_hidden) * static_cast<int64_t>(sizeof(scalar_t));
  const int64_t limit = at::cuda::getCurrentDeviceProperties()->sharedMemPerBlockOptin;
  TORCH_CHECK(bytes <= limit, "deepep::cartpole_rollout: ", bytes, " bytes of shared memory per block for H=",
              args.hidden, " exceed the device's ", limit);
  auto kernel = cartpole_rollout_kernel<scalar_t>;
  if (bytes > 48 * 1024) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
  }
  const auto blocks = static_cast<unsigned int>((args.batch + rows_per_block - 1) / rows_per_block);
  kernel<<<blocks, kThreads, static_cast<size_t>(bytes), at::cuda::getCurrentCUDAStream()>>>(args, rows_per_block);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

Outputs cartpole_rollout_cuda(const at::Tensor& state, const at::Tensor& episode_return,
                              const at::Tensor& episode_length, const at::Tensor& hidden, const at::Tensor& uniforms,
                              const at::Tensor& noise, at::TensorList weights, double logit_bound,
                              int64_t max_episode_steps, int64_t rows_per_block) {
  const c10::cuda::CUDAGuard device_guard(hidden.device());
  return cartpole_rollout_impl(
      state, episode_return, episode_length, hidden, uniforms, noise, weights, logit_bound, max_episode_steps,
      rows_per_block, [&](const Args<float>& args) { launch(args, rows_per_block); },
      [&](const Args<double>& args) { launch(args, rows_per_block); });
}

}  // namespace

TORCH_LIBRARY_IMPL(deepep, CUDA, m) { m.impl("cartpole_rollout", &cartpole_rollout_cuda); }

}  // namespace deepep::rollout
