// CUDA kernels of the fused all-action value head (formula and checks in ../all_action_q.h).
//
// Forward: one warp per row n; E and w staged in shared memory, z[n, :] in registers; the sum
// over h is a fixed butterfly, so q is bitwise reproducible whatever the grid size.
// Backward: one thread per column h and one block per chunk of rows (the chunking is a function
// of the shape only). tanh is recomputed, [N, A, H] is never stored. dz is row-local. dE, dw, db
// are sums over rows, done two ways:
//   deterministic (default): every block writes its partial sums to its own row of a
//     [chunks, (A+1)*H+1] buffer and a second kernel adds the rows in a fixed order;
//   atomic (opt-in): every block atomicAdds its partial sums into dE, dw, db.
// All launches use the current stream, are checked, never synchronise: CUDA-graph capturable.
#include "../all_action_q.h"

#include <ATen/Context.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <tuple>

namespace deepep {
namespace {

constexpr int kWarpSize = 32;
constexpr int kForwardThreads = 256;        // 8 warps = 8 rows in flight per block
constexpr size_t kDefaultSharedBytes = 48 * 1024;  // usable without cudaFuncSetAttribute
constexpr int kMaxBackwardThreads = 256;
constexpr int64_t kBackwardTargetThreads = 262144;  // ~one resident wave on 132 SMs x 2048
constexpr int64_t kBackwardMinRows = 16;
constexpr int kReduceColumns = 32;        // threadIdx.x: consecutive columns, coalesced
constexpr int kReduceRowGroups = 32;      // threadIdx.y: interleaved subsets of the chunks

__device__ __forceinline__ float device_tanh(float x) { return tanhf(x); }
__device__ __forceinline__ double device_tanh(double x) { return tanh(x); }

template <typename scalar_t>
__device__ __forceinline__ scalar_t warp_sum(scalar_t value) {
  // Butterfly: every lane ends with the same, fixed-order sum.
  for (int offset = kWarpSize / 2; offset > 0; offset >>= 1) {
    value += __shfl_xor_sync(0xffffffffu, value, offset);
  }
  return value;
}

// kPerLane > 0: hidden <= 32 * kPerLane, z[n, :] and w cached in registers. 0: generic H.
template <typename scalar_t, int kPerLane>
__global__ void all_action_q_forward_kernel(const scalar_t* __restrict__ z,
                                            const scalar_t* __restrict__ embedding,
                                            const scalar_t* __restrict__ w,
                                            const scalar_t* __restrict__ b,
                                            scalar_t* __restrict__ q, int64_t num_rows,
                                            int num_actions, int hidden, bool stage_in_shared) {
  extern __shared__ __align__(16) unsigned char shared_raw[];
  const scalar_t* e_src = embedding;
  const scalar_t* w_src = w;
  if (stage_in_shared) {
    scalar_t* shared = reinterpret_cast<scalar_t*>(shared_raw);  // [A, H] then [H]
    const int e_size = num_actions * hidden;
    for (int i = threadIdx.x; i < e_size + hidden; i += blockDim.x) {
      shared[i] = i < e_size ? embedding[i] : w[i - e_size];
    }
    __syncthreads();
    e_src = shared;
    w_src = shared + e_size;
  }
  const scalar_t bias = b[0];
  const int lane = threadIdx.x % kWarpSize;
  const int64_t warps_per_block = blockDim.x / kWarpSize;
  const int64_t row_stride = static_cast<int64_t>(gridDim.x) * warps_per_block;
  for (int64_t n = blockIdx.x * warps_per_block + threadIdx.x / kWarpSize; n < num_rows;
       n += row_stride) {
    const scalar_t* z_row = z + n * hidden;
    scalar_t* q_row = q + n * num_actions;
    scalar_t z_cache[kPerLane > 0 ? kPerLane : 1];
    scalar_t w_cache[kPerLane > 0 ? kPerLane : 1];
    if constexpr (kPerLane > 0) {
#pragma unroll
      for (int k = 0; k < kPerLane; ++k) {
        const int h = lane + k * kWarpSize;
        z_cache[k] = h < hidden ? z_row[h] : scalar_t(0);
        w_cache[k] = h < hidden ? w_src[h] : scalar_t(0);
      }
    }
    scalar_t lane_q = 0;  // lane j keeps q[n, a0 + j] until the group of 32 actions is written
    for (int a = 0; a < num_actions; ++a) {
      const scalar_t* e_row = e_src + a * hidden;
      scalar_t acc = 0;
      if constexpr (kPerLane > 0) {
#pragma unroll
        for (int k = 0; k < kPerLane; ++k) {
          const int h = lane + k * kWarpSize;
          if (h < hidden) acc += w_cache[k] * device_tanh(z_cache[k] + e_row[h]);
        }
      } else {
        for (int h = lane; h < hidden; h += kWarpSize) {
          acc += w_src[h] * device_tanh(z_row[h] + e_row[h]);
        }
      }
      acc = warp_sum(acc);
      const int slot = a % kWarpSize;
      if (slot == lane) lane_q = acc + bias;
      if (slot == kWarpSize - 1 || a == num_actions - 1) {
        const int a0 = a - slot;
        if (lane <= slot) q_row[a0 + lane] = lane_q;
      }
    }
  }
}

// Grid (chunks, ceil(H / blockDim.x)); thread = column h, block = chunk of rows.
template <typename scalar_t, bool kAtomic>
__global__ void all_action_q_backward_kernel(
    const scalar_t* __restrict__ grad_q, const scalar_t* __restrict__ z,
    const scalar_t* __restrict__ embedding, const scalar_t* __restrict__ w,
    scalar_t* __restrict__ dz, scalar_t* __restrict__ partials,
    scalar_t* __restrict__ d_embedding, scalar_t* __restrict__ dw, scalar_t* __restrict__ db,
    int64_t num_rows, int num_actions, int hidden, int64_t chunk_rows, int64_t num_columns) {
  // Thread-private slots [a * blockDim.x + threadIdx.x]: no barrier and no sharing needed.
  extern __shared__ __align__(16) unsigned char shared_raw[];
  scalar_t* e_column = reinterpret_cast<scalar_t*>(shared_raw);
  scalar_t* de_acc = e_column + num_actions * blockDim.x;
  const int h = blockIdx.y * blockDim.x + threadIdx.x;
  if (h >= hidden) return;
  const bool owns_db = h == 0;
  const int64_t chunk = blockIdx.x;
  const int64_t row_begin = chunk * chunk_rows;
  const int64_t row_end = row_begin + chunk_rows < num_rows ? row_begin + chunk_rows : num_rows;
  for (int a = 0; a < num_actions; ++a) {
    e_column[a * blockDim.x + threadIdx.x] = embedding[a * hidden + h];
    de_acc[a * blockDim.x + threadIdx.x] = 0;
  }
  const scalar_t w_h = w[h];
  scalar_t dw_acc = 0;
  scalar_t db_acc = 0;
  for (int64_t n = row_begin; n < row_end; ++n) {
    const scalar_t z_nh = z[n * hidden + h];
    const scalar_t* g_row = grad_q + n * num_actions;  // same address across the warp: broadcast
    scalar_t dz_acc = 0;
    for (int a = 0; a < num_actions; ++a) {
      const scalar_t g = g_row[a];
      const scalar_t t = device_tanh(z_nh + e_column[a * blockDim.x + threadIdx.x]);
      const scalar_t s = g * w_h * (scalar_t(1) - t * t);
      dz_acc += s;
      de_acc[a * blockDim.x + threadIdx.x] += s;
      dw_acc += g * t;
    }
    if (owns_db) {
      for (int a = 0; a < num_actions; ++a) db_acc += g_row[a];
    }
    dz[n * hidden + h] = dz_acc;
  }
  if constexpr (kAtomic) {
    // Nondeterministic on purpose: float atomicAdd sums the blocks' partials in the order the
    // scheduler runs them, so dE, dw and db can change in the last bits from call to call.
    for (int a = 0; a < num_actions; ++a) {
      atomicAdd(d_embedding + a * hidden + h, de_acc[a * blockDim.x + threadIdx.x]);
    }
    atomicAdd(dw + h, dw_acc);
    if (owns_db) atomicAdd(db, db_acc);
  } else {
    scalar_t* part = partials + chunk * num_columns;  // [(A+1)*H+1]: dE, dw, db
    for (int a = 0; a < num_actions; ++a) {
      part[a * hidden + h] = de_acc[a * blockDim.x + threadIdx.x];
    }
    part[num_actions * hidden + h] = dw_acc;
    if (owns_db) part[(num_actions + 1) * hidden] = db_acc;
  }
}

// Adds the rows of partials [chunks, columns] in a fixed order: thread (x, y) sums chunks
// y, y + 32, ... of one column, then thread (x, 0) adds the 32 sums in y order.
template <typename scalar_t>
__global__ void reduce_partials_kernel(const scalar_t* __restrict__ partials, int64_t num_chunks,
                                       int64_t num_columns, int num_actions, int hidden,
                                       scalar_t* __restrict__ d_embedding,
                                       scalar_t* __restrict__ dw, scalar_t* __restrict__ db) {
  __shared__ scalar_t group_sums[kReduceRowGroups][kReduceColumns];
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kReduceColumns + threadIdx.x;
  scalar_t acc = 0;
  if (col < num_columns) {
#pragma unroll 4
    for (int64_t chunk = threadIdx.y; chunk < num_chunks; chunk += kReduceRowGroups) {
      acc += partials[chunk * num_columns + col];
    }
  }
  group_sums[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y != 0 || col >= num_columns) return;
  scalar_t total = 0;
  for (int group = 0; group < kReduceRowGroups; ++group) total += group_sums[group][threadIdx.x];
  const int64_t e_size = static_cast<int64_t>(num_actions) * hidden;
  if (col < e_size) {
    d_embedding[col] = total;
  } else if (col < e_size + hidden) {
    dw[col - e_size] = total;
  } else {
    db[0] = total;
  }
}

}  // namespace

at::Tensor all_action_q_cuda(const at::Tensor& z, const at::Tensor& action_embedding,
                             const at::Tensor& w, const at::Tensor& b, bool deterministic) {
  (void)deterministic;  // the forward is deterministic either way
  check_forward_inputs(z, action_embedding, w, b);
  TORCH_INTERNAL_ASSERT(z.is_cuda());
  const c10::cuda::CUDAGuard device_guard(z.device());
  const at::Tensor z_c = z.contiguous();
  const at::Tensor e_c = action_embedding.contiguous();
  const at::Tensor w_c = w.contiguous();
  const at::Tensor b_c = b.contiguous();
  const int64_t num_rows = z_c.size(0);
  const int hidden = static_cast<int>(z_c.size(1));
  const int num_actions = static_cast<int>(e_c.size(0));
  at::Tensor q = at::empty({num_rows, num_actions}, z_c.options());  // [N, A]
  if (num_rows == 0) return q;
  const int64_t sm_count = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int64_t warps_per_block = kForwardThreads / kWarpSize;

  AT_DISPATCH_FLOATING_TYPES(z_c.scalar_type(), "all_action_q_cuda", [&] {
    const size_t stage_bytes = static_cast<size_t>(num_actions + 1) * hidden * sizeof(scalar_t);
    const bool stage = stage_bytes <= kDefaultSharedBytes;
    const size_t shared_bytes = stage ? stage_bytes : 0;
    const auto launch = [&](auto kernel) {
      // Grid-stride over rows with exactly one resident wave: E and w are staged once per block.
      int blocks_per_sm = 0;
      C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_sm, kernel,
                                                                   kForwardThreads, shared_bytes));
      const int64_t blocks = std::min(ceil_div(num_rows, warps_per_block),
                                      sm_count * std::max(blocks_per_sm, 1));
      kernel<<<blocks, kForwardThreads, shared_bytes, stream>>>(
          z_c.data_ptr<scalar_t>(), e_c.data_ptr<scalar_t>(), w_c.data_ptr<scalar_t>(),
          b_c.data_ptr<scalar_t>(), q.data_ptr<scalar_t>(), num_rows, num_actions, hidden, stage);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    if (hidden <= 4 * kWarpSize) {
      launch(all_action_q_forward_kernel<scalar_t, 4>);
    } else if (hidden <= 8 * kWarpSize) {
      launch(all_action_q_forward_kernel<scalar_t, 8>);
    } else {
      launch(all_action_q_forward_kernel<scalar_t, 0>);
    }
  });
  return q;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> all_action_q_backward_cuda(
    const at::Tensor& grad_q, const at::Tensor& z, const at::Tensor& action_embedding,
    const at::Tensor& w, bool deterministic) {
  check_backward_inputs(grad_q, z, action_embedding, w);
  TORCH_INTERNAL_ASSERT(z.is_cuda());
  if (!deterministic) {
    // The atomic variant sums float partials with atomicAdd in scheduling order (see kernel).
    at::globalContext().alertNotDeterministic(
        "deepep::all_action_q_backward_cuda with deterministic=False (float atomicAdd)");
  }
  const c10::cuda::CUDAGuard device_guard(z.device());
  const at::Tensor g_c = grad_q.contiguous();
  const at::Tensor z_c = z.contiguous();
  const at::Tensor e_c = action_embedding.contiguous();
  const at::Tensor w_c = w.contiguous();
  const int64_t num_rows = z_c.size(0);
  const int hidden = static_cast<int>(z_c.size(1));
  const int num_actions = static_cast<int>(e_c.size(0));

  at::Tensor dz = at::empty_like(z_c);  // [N, H]
  // The atomic variant accumulates into zeros; the deterministic one overwrites.
  const bool zero_init = !deterministic || num_rows == 0;
  at::Tensor d_embedding = zero_init ? at::zeros_like(e_c) : at::empty_like(e_c);  // [A, H]
  at::Tensor dw = zero_init ? at::zeros_like(w_c) : at::empty_like(w_c);           // [H]
  at::Tensor db = zero_init ? at::zeros({}, z_c.options()) : at::empty({}, z_c.options());
  if (num_rows == 0) return std::make_tuple(dz, d_embedding, dw, db);

  const int64_t target_chunks = std::max<int64_t>(1, kBackwardTargetThreads / hidden);
  const int64_t chunk_rows = rows_per_chunk(num_rows, target_chunks, kBackwardMinRows);
  const int64_t num_chunks = ceil_div(num_rows, chunk_rows);
  const int64_t num_columns = static_cast<int64_t>(num_actions + 1) * hidden + 1;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();

  AT_DISPATCH_FLOATING_TYPES(z_c.scalar_type(), "all_action_q_backward_cuda", [&] {
    // Block size: the warps that cover H (<= 256), halved while the thread-private shared
    // slots (2 * A per thread) do not fit in the default 48 KiB.
    int threads = static_cast<int>(std::min<int64_t>(
        ceil_div(hidden, kWarpSize) * kWarpSize, kMaxBackwardThreads));
    while (threads > kWarpSize &&
           2 * static_cast<size_t>(num_actions) * threads * sizeof(scalar_t) > kDefaultSharedBytes) {
      threads /= 2;
    }
    const size_t shared_bytes = 2 * static_cast<size_t>(num_actions) * threads * sizeof(scalar_t);
    TORCH_CHECK(shared_bytes <= kDefaultSharedBytes,
                "deepep::all_action_q_backward_cuda: action_embedding has A=", num_actions,
                " actions, more than this kernel supports for ", z_c.scalar_type(),
                " (at most ", kDefaultSharedBytes / (2 * kWarpSize * sizeof(scalar_t)),
                "). HINT: use deepep_lightning.deepep.kernels.all_action_q_reference for so many actions.");
    const dim3 grid(static_cast<unsigned int>(num_chunks),
                    static_cast<unsigned int>(ceil_div(hidden, threads)));
    at::Tensor partials;
    scalar_t* partials_ptr = nullptr;
    if (deterministic) {
      partials = at::empty({num_chunks, num_columns}, z_c.options());  // [C, (A+1)H+1]
      partials_ptr = partials.data_ptr<scalar_t>();
    }
    const auto launch = [&](auto kernel) {
      kernel<<<grid, threads, shared_bytes, stream>>>(
          g_c.data_ptr<scalar_t>(), z_c.data_ptr<scalar_t>(), e_c.data_ptr<scalar_t>(),
          w_c.data_ptr<scalar_t>(), dz.data_ptr<scalar_t>(), partials_ptr,
          d_embedding.data_ptr<scalar_t>(), dw.data_ptr<scalar_t>(), db.data_ptr<scalar_t>(),
          num_rows, num_actions, hidden, chunk_rows, num_columns);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    if (deterministic) {
      launch(all_action_q_backward_kernel<scalar_t, false>);
      const dim3 reduce_block(kReduceColumns, kReduceRowGroups);
      const dim3 reduce_grid(static_cast<unsigned int>(ceil_div(num_columns, kReduceColumns)));
      reduce_partials_kernel<scalar_t><<<reduce_grid, reduce_block, 0, stream>>>(
          partials_ptr, num_chunks, num_columns, num_actions, hidden,
          d_embedding.data_ptr<scalar_t>(), dw.data_ptr<scalar_t>(), db.data_ptr<scalar_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    } else {
      launch(all_action_q_backward_kernel<scalar_t, true>);
    }
  });
  return std::make_tuple(dz, d_embedding, dw, db);
}

TORCH_LIBRARY_IMPL(deepep, CUDA, m) {
  m.impl("all_action_q", &all_action_q_cuda);
  m.impl("all_action_q_backward", &all_action_q_backward_cuda);
}

}  // namespace deepep
