// CUDA kernel of deepep::cartpole_rollout (what and why: ../cartpole_rollout.h; the stages are shared with the CPU
// kernel there).
//
// One launch runs the whole rollout: a block of kThreads threads owns `rows_per_block` environments for all T
// timesteps, with its rows' inputs and CartPole states in shared memory and a barrier between stages. No
// atomics, fixed summation orders: bitwise reproducible. On the current stream, no synchronisation: CUDA-graph
// capturable.
//
// Weights. With weight_tile_rows = 0 every thread reads its units' weights from global memory (L2) as it sums,
// and a timestep waits on the latency of those loads. With weight_tile_rows = n > 0 the block streams the rows of
// the two input layers and of W_hh through shared memory, n weight rows per tile, two tiles in flight: the next
// tile's asynchronous copy (cp.async) runs while the threads sum over the current one from shared memory. A
// thread still sums its unit's inputs in order with the same operations, so both forms give the same bits.
#include "../cartpole_rollout.h"

#include <cuda_pipeline.h>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

namespace deepep::rollout {
namespace {

// Bytes of a block's stage buffers (shared_scalars), rounded up so that the weight tiles after them are 16-aligned.
template <typename scalar_t>
int64_t stage_bytes(const Args<scalar_t>& args) {
  const int64_t bytes =
      shared_scalars(kMaxRows, args.hidden, args.policy_hidden, args.value_hidden) * static_cast<int64_t>(sizeof(scalar_t));
  return (bytes + 15) / 16 * 16;
}

// Scalars of one weight tile: `tile_rows` rows of the widest streamed weight.
template <typename scalar_t>
int64_t tile_scalars(const Args<scalar_t>& args, int64_t tile_rows) {
  const int64_t widest = std::max({args.policy_hidden, args.value_hidden, 3 * args.hidden});
  return tile_rows * widest;
}

// Rows [k0, k0 + n) of the row-major [in, out] weight wt (n * out contiguous scalars) into dst: this thread's
// share as asynchronous copies, 16 bytes each where both ends are aligned, committed as one batch.
template <typename scalar_t>
__device__ void copy_tile_async(scalar_t* dst, const scalar_t* wt, int64_t out, int64_t k0, int64_t n, int tid,
                                int threads) {
  const scalar_t* src = wt + k0 * out;
  const int64_t total = n * out;
  constexpr int64_t kVector = 16 / static_cast<int64_t>(sizeof(scalar_t));
  const bool aligned = (reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst)) % 16 == 0;
  if (aligned && total % kVector == 0) {
    for (int64_t i = tid * kVector; i < total; i += threads * kVector) __pipeline_memcpy_async(dst + i, src + i, 16);
  } else {
    for (int64_t i = tid; i < total; i += threads) __pipeline_memcpy_async(dst + i, src + i, sizeof(scalar_t));
  }
  __pipeline_commit();
}

// The rows of wt [in, out] through the two tiles at `tiles`, in order: consume(tile, k_begin, k_end) sees weight
// rows [k_begin, k_end) at tile[(k - k_begin) * out + j] while the next tile is copied. Every thread of the block
// calls it (it has barriers).
template <typename scalar_t, typename Consume>
__device__ void stream_weight_rows(const scalar_t* wt, int64_t in, int64_t out, int64_t tile_rows, scalar_t* tiles,
                                   int tid, int threads, Consume&& consume) {
  scalar_t* buffers[2] = {tiles, tiles + tile_rows * out};
  const int64_t count = (in + tile_rows - 1) / tile_rows;
  copy_tile_async(buffers[0], wt, out, 0, tile_rows < in ? tile_rows : in, tid, threads);
  for (int64_t i = 0; i < count; ++i) {
    const int64_t k0 = i * tile_rows, k1 = k0 + tile_rows < in ? k0 + tile_rows : in;
    if (i + 1 < count) {  // the buffer of tile i + 1 was last read by tile i - 1, before the barrier below
      copy_tile_async(buffers[(i + 1) & 1], wt, out, k1, k1 + tile_rows < in ? tile_rows : in - k1, tid, threads);
      __pipeline_wait_prior(1);
    } else {
      __pipeline_wait_prior(0);
    }
    __syncthreads();
    consume(static_cast<const scalar_t*>(buffers[i & 1]), k0, k1);
    __syncthreads();
  }
}

// Block::hidden_layers with W_p1 and W_v1 streamed through shared memory (thread j: unit j0 + j of every row).
template <typename scalar_t>
__device__ void hidden_layers_tiled(const Block<scalar_t>& blk, scalar_t* tiles, int64_t tile_rows, int tid,
                                    int threads) {
  const Args<scalar_t>& a = blk.a;
  scalar_t acc[kMaxRows];
  for (int64_t j0 = 0; j0 < a.policy_hidden; j0 += threads) {
    const int64_t j = j0 + tid;
    blk.zero(acc);
    stream_weight_rows(a.policy_w1t, a.policy_in, a.policy_hidden, tile_rows, tiles, tid, threads,
                       [&](const scalar_t* tile, int64_t k0, int64_t k1) {
                         if (j < a.policy_hidden) blk.unit_sums(tile, k0, k0, k1, a.policy_hidden, j, acc);
                       });
    if (j < a.policy_hidden) blk.finish_policy_unit(j, acc);
  }
  for (int64_t j0 = 0; j0 < a.value_hidden; j0 += threads) {
    const int64_t j = j0 + tid;
    blk.zero(acc);
    stream_weight_rows(a.value_w1t, kObs + a.hidden, a.value_hidden, tile_rows, tiles, tid, threads,
                       [&](const scalar_t* tile, int64_t k0, int64_t k1) {
                         if (j < a.value_hidden) blk.unit_sums(tile, k0, k0, k1, a.value_hidden, j, acc);
                       });
    if (j < a.value_hidden) blk.finish_value_unit(j, acc);
  }
}

// Block::gru with W_hh streamed through shared memory (W_ih's 7 rows are read from global memory).
template <typename scalar_t>
__device__ void gru_tiled(const Block<scalar_t>& blk, int64_t t, scalar_t* tiles, int64_t tile_rows, int tid,
                          int threads) {
  const Args<scalar_t>& a = blk.a;
  const int64_t size = a.hidden, width = kObs + size;
  for (int64_t j0 = 0; j0 < size; j0 += threads) {
    const int64_t j = j0 + tid;
    scalar_t gi[3][kMaxRows], gh[3][kMaxRows];
    blk.zero_gates(gi, gh);
    if (j < size) blk.input_gate_sums(j, gi);
    stream_weight_rows(a.gru_whht, size, 3 * size, tile_rows, tiles, tid, threads,
                       [&](const scalar_t* tile, int64_t k0, int64_t k1) {
                         if (j < size) blk.gate_sums(tile, k0, blk.inputs + kObs, width, k0, k1, j, gh);
                       });
    if (j < size) blk.finish_gru_unit(t, j, gi, gh);
  }
}

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    cartpole_rollout_kernel(const Args<scalar_t> args, int64_t rows_per_block, int64_t tile_rows, int64_t tiles_at) {
  extern __shared__ __align__(16) unsigned char raw[];
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * rows_per_block;
  const int64_t count = rows_per_block < args.batch - row0 ? rows_per_block : args.batch - row0;
  const Block<scalar_t> blk(args, reinterpret_cast<scalar_t*>(raw), row0, count);
  scalar_t* tiles = reinterpret_cast<scalar_t*>(raw + tiles_at);
  const int tid = static_cast<int>(threadIdx.x), threads = static_cast<int>(blockDim.x);
  blk.load(tid, threads);
  __syncthreads();
  for (int64_t t = 0; t < args.steps; ++t) {
    if (tile_rows > 0) {
      hidden_layers_tiled(blk, tiles, tile_rows, tid, threads);
    } else {
      blk.hidden_layers(tid, threads);
    }
    __syncthreads();
    blk.head_partials(tid, threads);
    __syncthreads();
    blk.head_finish(tid, threads);
    __syncthreads();
    blk.act_and_env(t, tid, threads);
    __syncthreads();
    if (tile_rows > 0) {
      gru_tiled(blk, t, tiles, tile_rows, tid, threads);
    } else {
      blk.gru(t, tid, threads);
    }
    __syncthreads();
    blk.commit(tid, threads);
    __syncthreads();
  }
  blk.store(tid, threads);
}

template <typename scalar_t>
void launch(const Args<scalar_t>& args, int64_t rows_per_block, int64_t tile_rows) {
  const int64_t tiles_at = stage_bytes(args);
  const int64_t bytes = tiles_at + 2 * tile_scalars(args, tile_rows) * static_cast<int64_t>(sizeof(scalar_t));
  const int64_t limit = at::cuda::getCurrentDeviceProperties()->sharedMemPerBlockOptin;
  TORCH_CHECK(bytes <= limit, "deepep::cartpole_rollout: ", bytes, " bytes of shared memory per block for H=",
              args.hidden, " and weight_tile_rows=", tile_rows, " exceed the device's ", limit,
              "; pass fewer weight_tile_rows (0 reads the weights from global memory)");
  auto kernel = cartpole_rollout_kernel<scalar_t>;
  if (bytes > 48 * 1024) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
  }
  const auto blocks = static_cast<unsigned int>((args.batch + rows_per_block - 1) / rows_per_block);
  kernel<<<blocks, kThreads, static_cast<size_t>(bytes), at::cuda::getCurrentCUDAStream()>>>(args, rows_per_block,
                                                                                              tile_rows, tiles_at);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

Outputs cartpole_rollout_cuda(const at::Tensor& state, const at::Tensor& episode_return,
                              const at::Tensor& episode_length, const at::Tensor& hidden, const at::Tensor& uniforms,
                              const at::Tensor& noise, at::TensorList weights, double logit_bound,
                              int64_t max_episode_steps, int64_t rows_per_block, int64_t weight_tile_rows) {
  const c10::cuda::CUDAGuard device_guard(hidden.device());
  return cartpole_rollout_impl(
      state, episode_return, episode_length, hidden, uniforms, noise, weights, logit_bound, max_episode_steps,
      rows_per_block, weight_tile_rows, [&](const Args<float>& args) { launch(args, rows_per_block, weight_tile_rows); },
      [&](const Args<double>& args) { launch(args, rows_per_block, weight_tile_rows); });
}

}  // namespace

TORCH_LIBRARY_IMPL(deepep, CUDA, m) { m.impl("cartpole_rollout", &cartpole_rollout_cuda); }

}  // namespace deepep::rollout
