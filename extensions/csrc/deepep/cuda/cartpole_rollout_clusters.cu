// deepep::cartpole_rollout_clusters: deepep::cartpole_rollout with the weights on chip for the whole rollout
// (float32, Hopper and later). What a timestep computes, and the reference: ../cartpole_rollout.h.
//
// The block kernel gives each block a few environments and all units, so every block streams all 1.3 MB of
// weights (H=256) from L2 at every timestep, and a timestep is bound by the latency of those loads. Here a
// cluster of kCluster blocks owns `rows` environments and splits every layer's units between its
// blocks: block `rank` owns the units j = rank + kCluster * i of the policy's and the value head's hidden
// layers and of the GRU cell, and keeps their weights in its shared memory (about 170 KB at H=256) for all
// T timesteps. A timestep is
//
//   hidden    p1 and z of the block's units, for the cluster's rows
//   partials  the head's lane partial sums over the block's units: lane l sums j = l, l + 32, ... (units
//             j = l mod 32 all live in block l mod kCluster, so a lane is one block's)
//   -- cluster barrier --
//   finish    every block sums the 32 lanes of each output in lane order, reading the other blocks' partials
//             through distributed shared memory; then act_and_env_row for every row (each block steps its own
//             copy of the rows' CartPole states, with the same inputs and code, so the copies stay equal;
//             block 0 writes the outputs)
//   gru       h_{t+1} of the block's units, written into every block's input buffer of the next timestep
//   -- cluster barrier --
//
// Rows per cluster: a cluster runs all T timesteps once it starts, so a cluster that is not resident with the
// others waits for a whole rollout to end, which doubles the launch. A block needs most of an SM's shared memory
// (one block per SM), and a cluster's 8 blocks must share a GPC, so how many clusters are resident at once depends
// on the chip's GPCs, not only on its SM count; the launch asks cudaOccupancyMaxActiveClusters and takes the fewest
// rows per cluster with which the whole batch is resident (automatic_rows). Each row's sums are the row's own, so
// the bits do not depend on how rows are grouped into clusters.
//
// Every sum has the block kernel's order: a unit's sum over its inputs in input order, a lane's over its
// units in unit order, an output's over its lanes in lane order, and the element code is the header's. So
// the two kernels give equal bits, and both repeat bitwise: no atomics, nothing depends on timing.
#include "../cartpole_rollout.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cooperative_groups.h>
#include <torch/library.h>

#include <array>
#include <map>
#include <mutex>

namespace deepep::rollout {
namespace {

namespace cg = cooperative_groups;

constexpr int kCluster = 8;                // blocks per cluster (the portable maximum)
constexpr int kMinClusterRows = 4;         // environments per cluster: a multiple of kRowTile in [4, 64]
constexpr int kMaxClusterRows = 64;
constexpr int kRowTile = 4;                // rows per thread in a layer's sums
constexpr int kSlots = kLanes / kCluster;  // head lanes per block: lane l is block l % kCluster's slot l / kCluster

// Units j < n that block `rank` owns: j = rank + kCluster * i.
__host__ __device__ inline int64_t owned(int64_t n, int64_t rank) { return (n - rank + kCluster - 1) / kCluster; }

// A weight row's stride in floats: a multiple of 4 whose quotient is odd, so that a warp's float4 loads of 8
// consecutive units' rows fall on distinct banks.
__host__ __device__ inline int64_t padded(int64_t n) {
  int64_t quads = (n + 3) / 4;
  quads += quads % 2 == 0 ? 1 : 0;
  return 4 * quads;
}

__host__ __device__ inline int64_t round4(int64_t n) { return (n + 3) / 4 * 4; }

// A block's shared memory, in floats from its start; the same in every block (sized for rank 0, which owns
// the most units), so one block finds another's partials and inputs at its own offsets.
struct Layout {
  int64_t up, uv, uh;           // units per block: policy, value head, GRU cell
  int64_t sp, sv, sh, width;    // row strides: policy and value weights, GRU hidden weights, inputs [obs; h]
  int64_t wp, wv, wh, wi;       // weights: [up][sp], [uv][sv], [3][uh][sh], [3][uh][kFeedback]
  int64_t inputs, p1, z;        // [2][rows][width] (this timestep's and the next's), [rows][up], [rows][uv]
  int64_t partial, head, fb;    // [2 A rows][kSlots], [rows][2 A], [rows][kFeedback]
  int64_t keep, env, total;     // [rows], [rows][kObs + 2]
  int64_t rows;                 // environments per cluster

  Layout(int64_t hidden, int64_t policy_in, int64_t policy_hidden, int64_t value_hidden, int64_t cluster_rows)
      : rows(cluster_rows) {
    up = owned(policy_hidden, 0);
    uv = owned(value_hidden, 0);
    uh = owned(hidden, 0);
    sp = padded(policy_in);
    sv = padded(kObs + hidden);
    sh = padded(hidden);
    width = round4(kObs + hidden);
    int64_t at = 0;
    const auto take = [&at](int64_t floats) {
      const int64_t start = at;
      at += round4(floats);
      return start;
    };
    wp = take(up * sp);
    wv = take(uv * sv);
    wh = take(3 * uh * sh);
    wi = take(3 * uh * kFeedback);
    inputs = take(2 * rows * width);
    p1 = take(rows * up);
    z = take(rows * uv);
    partial = take(2 * kActions * rows * kSlots);
    head = take(rows * 2 * kActions);
    fb = take(rows * kFeedback);
    keep = take(rows);
    env = take(rows * (kObs + 2));
    total = at;
  }

  int64_t bytes() const { return total * static_cast<int64_t>(sizeof(float)); }
};

// acc[rr] += sum over k < in of x[rr * stride + k] * w[k], k in order, for the kRowTile rows at x (w and x
// 16-byte aligned).
__device__ inline void row_sums(const float* w, int64_t in, const float* x, int64_t stride, float (&acc)[kRowTile]) {
  const int64_t quads = in / 4;
#pragma unroll 4
  for (int64_t q = 0; q < quads; ++q) {
    const float4 wq = reinterpret_cast<const float4*>(w)[q];
#pragma unroll
    for (int rr = 0; rr < kRowTile; ++rr) {
      const float4 xq = reinterpret_cast<const float4*>(x + rr * stride)[q];
      acc[rr] += xq.x * wq.x;
      acc[rr] += xq.y * wq.y;
      acc[rr] += xq.z * wq.z;
      acc[rr] += xq.w * wq.w;
    }
  }
  for (int64_t k = quads * 4; k < in; ++k) {
#pragma unroll
    for (int rr = 0; rr < kRowTile; ++rr) acc[rr] += x[rr * stride + k] * w[k];
  }
}

// acc[g][rr] += sum over k < in of x[rr * stride + k] * w_g[k] for the gates g = r, z, n (w_g = w + g * gate),
// k in order; kQuads: in float4 loads (w, x and the strides 16-byte aligned).
template <bool kQuads>
__device__ inline void gate_row_sums(const float* w, int64_t gate, int64_t in, const float* x, int64_t stride,
                                     float (&acc)[3][kRowTile]) {
  const int64_t quads = kQuads ? in / 4 : 0;
#pragma unroll 2
  for (int64_t q = 0; q < quads; ++q) {
    const float4 wr = reinterpret_cast<const float4*>(w)[q];
    const float4 wz = reinterpret_cast<const float4*>(w + gate)[q];
    const float4 wn = reinterpret_cast<const float4*>(w + 2 * gate)[q];
#pragma unroll
    for (int rr = 0; rr < kRowTile; ++rr) {
      const float4 xq = reinterpret_cast<const float4*>(x + rr * stride)[q];
      acc[0][rr] += xq.x * wr.x;
      acc[1][rr] += xq.x * wz.x;
      acc[2][rr] += xq.x * wn.x;
      acc[0][rr] += xq.y * wr.y;
      acc[1][rr] += xq.y * wz.y;
      acc[2][rr] += xq.y * wn.y;
      acc[0][rr] += xq.z * wr.z;
      acc[1][rr] += xq.z * wz.z;
      acc[2][rr] += xq.z * wn.z;
      acc[0][rr] += xq.w * wr.w;
      acc[1][rr] += xq.w * wz.w;
      acc[2][rr] += xq.w * wn.w;
    }
  }
  for (int64_t k = quads * 4; k < in; ++k) {
#pragma unroll
    for (int rr = 0; rr < kRowTile; ++rr) {
      const float v = x[rr * stride + k];
      acc[0][rr] += v * w[k];
      acc[1][rr] += v * w[gate + k];
      acc[2][rr] += v * w[2 * gate + k];
    }
  }
}

__global__ void __launch_bounds__(kThreads) cartpole_rollout_clusters_kernel(const Args<float> a, const Layout L) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ float4 raw[];
  float* const shared = reinterpret_cast<float*>(raw);
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank());
  const int tid = static_cast<int>(threadIdx.x);
  const int64_t row0 = static_cast<int64_t>(blockIdx.x / kCluster) * L.rows;
  const int64_t count = a.batch - row0 < L.rows ? a.batch - row0 : L.rows;
  const int64_t H = a.hidden, gates = 3 * H, up = owned(a.policy_hidden, rank), uv = owned(a.value_hidden, rank),
                uh = owned(H, rank);
  float *const wp = shared + L.wp, *const wv = shared + L.wv, *const wh = shared + L.wh, *const wi = shared + L.wi;
  float *const p1 = shared + L.p1, *const z = shared + L.z, *const partial = shared + L.partial;
  float *const head = shared + L.head, *const fb = shared + L.fb, *const keep = shared + L.keep;
  float* const env = shared + L.env;
  float* inputs[2] = {shared + L.inputs, shared + L.inputs + L.rows * L.width};

  // The block's weights, once; its rows' inputs and CartPole states (rows past `count` are zeros).
  for (int64_t n = tid; n < up * a.policy_in; n += kThreads) {
    const int64_t i = n % up, k = n / up;
    wp[i * L.sp + k] = a.policy_w1t[k * a.policy_hidden + rank + kCluster * i];
  }
  for (int64_t n = tid; n < uv * (kObs + H); n += kThreads) {
    const int64_t i = n % uv, k = n / uv;
    wv[i * L.sv + k] = a.value_w1t[k * a.value_hidden + rank + kCluster * i];
  }
  for (int64_t n = tid; n < 3 * uh * H; n += kThreads) {
    const int64_t i = n % uh, g = (n / uh) % 3, k = n / (3 * uh);
    wh[(g * L.uh + i) * L.sh + k] = a.gru_whht[k * gates + g * H + rank + kCluster * i];
  }
  for (int64_t n = tid; n < 3 * uh * kFeedback; n += kThreads) {
    const int64_t i = n % uh, g = (n / uh) % 3, k = n / (3 * uh);
    wi[(g * L.uh + i) * kFeedback + k] = a.gru_wiht[k * gates + g * H + rank + kCluster * i];
  }
  for (int64_t n = tid; n < 2 * L.rows * L.width; n += kThreads) {
    const int64_t r = (n / L.width) % L.rows, k = n % L.width, b = row0 + r;
    float v = 0.0f;
    if (n < L.rows * L.width && r < count && k < kObs + H) {
      v = k < kObs ? a.state[b * kObs + k] : a.h0[b * H + (k - kObs)];
    }
    inputs[0][n] = v;
  }
  for (int64_t n = tid; n < L.rows * (kObs + 2); n += kThreads) {
    const int64_t r = n / (kObs + 2), k = n % (kObs + 2), b = row0 + r;
    env[n] = r >= count ? 0.0f : (k < kObs ? a.state[b * kObs + k] : (k == kObs ? a.episode_return[b] : a.episode_length[b]));
  }
  __syncthreads();

  const int64_t row_groups = (count + kRowTile - 1) / kRowTile, outputs = 2 * count * kActions;
  int cur = 0;
  for (int64_t t = 0; t < a.steps; ++t) {
    const float* x = inputs[cur];
    float* const x_next = inputs[cur ^ 1];
    // hidden: p1 = tanh(W_p1 x_p + b_p1) and z = W_v1 x + b_v1 for the block's units, kRowTile rows a thread
    for (int64_t n = tid; n < (up + uv) * row_groups; n += kThreads) {
      const int64_t c = n % (up + uv), r0 = n / (up + uv) * kRowTile;
      const bool policy = c < up;
      const int64_t i = policy ? c : c - up, j = rank + kCluster * i;
      float acc[kRowTile] = {};
      row_sums(policy ? wp + i * L.sp : wv + i * L.sv, policy ? a.policy_in : kObs + H, x + r0 * L.width, L.width,
               acc);
#pragma unroll
      for (int rr = 0; rr < kRowTile; ++rr) {
        if (r0 + rr < count) {
          if (policy) {
            p1[(r0 + rr) * L.up + i] = r_tanh(acc[rr] + a.policy_b1[j]);
          } else {
            z[(r0 + rr) * L.uv + i] = acc[rr] + a.value_b1[j];
          }
        }
      }
    }
    __syncthreads();
    // partials: output o (the logit of row r, action c, or its Q), lane rank + kCluster * s
    for (int64_t n = tid; n < outputs * kSlots; n += kThreads) {
      const int64_t o = n / kSlots, s = n % kSlots, lane = rank + kCluster * s;
      const bool is_q = o >= count * kActions;
      const int64_t ra = is_q ? o - count * kActions : o, r = ra / kActions, c = ra - r * kActions;
      float acc = 0.0f;
      if (!is_q) {
        const float* w = a.policy_w2 + c * a.policy_hidden;
        for (int64_t j = lane; j < a.policy_hidden; j += kLanes) acc += p1[r * L.up + (j - rank) / kCluster] * w[j];
      } else {
        const float* e = a.embedding + c * a.value_hidden;
        for (int64_t j = lane; j < a.value_hidden; j += kLanes) {
          acc += a.value_w2[j] * r_tanh(z[r * L.uv + (j - rank) / kCluster] + e[j]);
        }
      }
      partial[o * kSlots + s] = acc;
    }
    cluster.sync();
    // finish: every output's 32 lanes in lane order, from the blocks that own them
    for (int64_t o = tid; o < outputs; o += kThreads) {
      const bool is_q = o >= count * kActions;
      const int64_t ra = is_q ? o - count * kActions : o, r = ra / kActions, c = ra - r * kActions;
      float sum = 0.0f;
#pragma unroll
      for (int lane = 0; lane < kLanes; ++lane) {
        sum += cluster.map_shared_rank(partial, lane % kCluster)[o * kSlots + lane / kCluster];
      }
      if (is_q) {
        head[r * 2 * kActions + kActions + c] = sum + a.value_b2[0];
      } else {
        head[r * 2 * kActions + c] = finish_logit(a, sum, c);
      }
    }
    __syncthreads();
    // act and env: thread r steps row r; the next timestep's observation into the next inputs
    for (int64_t r = tid; r < count; r += kThreads) {
      float* s = env + r * (kObs + 2);
      act_and_env_row(a, t, row0 + r, head + r * 2 * kActions, x + r * L.width, fb + r * kFeedback, s, keep + r,
                      rank == 0);
      for (int k = 0; k < kObs; ++k) x_next[r * L.width + k] = s[k];
    }
    __syncthreads();
    // gru: h_{t+1} of the block's units, into every block's next inputs
    for (int64_t n = tid; n < uh * row_groups; n += kThreads) {
      const int64_t i = n % uh, r0 = n / uh * kRowTile, j = rank + kCluster * i;
      float gi[3][kRowTile] = {}, gh[3][kRowTile] = {};
      gate_row_sums<false>(wi + i * kFeedback, L.uh * kFeedback, kFeedback, fb + r0 * kFeedback, kFeedback, gi);
      gate_row_sums<true>(wh + i * L.sh, L.uh * L.sh, H, x + r0 * L.width + kObs, L.width, gh);
#pragma unroll
      for (int rr = 0; rr < kRowTile; ++rr) {
        const int64_t r = r0 + rr;
        if (r < count) {
          const float row_gi[3] = {gi[0][rr], gi[1][rr], gi[2][rr]}, row_gh[3] = {gh[0][rr], gh[1][rr], gh[2][rr]};
          const float h_next = gru_unit(a, j, row_gi, row_gh, x[r * L.width + kObs + j], keep[r]);
          a.states[(t * a.batch + row0 + r) * H + j] = h_next;
#pragma unroll
          for (int d = 0; d < kCluster; ++d) cluster.map_shared_rank(x_next, d)[r * L.width + kObs + j] = h_next;
        }
      }
    }
    cluster.sync();
    cur ^= 1;
  }
  if (rank == 0) store_env(a, row0, count, env, tid, kThreads);
#endif
}

cudaLaunchConfig_t launch_config(const Args<float>& args, const Layout& layout, cudaLaunchAttribute* cluster) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned int>((args.batch + layout.rows - 1) / layout.rows * kCluster));
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = static_cast<size_t>(layout.bytes());
  config.stream = at::cuda::getCurrentCUDAStream();
  cluster->id = cudaLaunchAttributeClusterDimension;
  cluster->val.clusterDim.x = kCluster;
  cluster->val.clusterDim.y = 1;
  cluster->val.clusterDim.z = 1;
  config.attrs = cluster;
  config.numAttrs = 1;
  return config;
}

// The rows per cluster of an automatic launch: the fewest (a multiple of kRowTile, from kMinClusterRows) with which
// every cluster of the batch is resident at once, so that no cluster waits for another's whole rollout; where no
// count gets there, the most that fit in shared memory (the fewest waves). Fewer rows per cluster spread a batch over
// more SMs. Remembered per device, batch and layer sizes (the occupancy query costs host time).
int64_t automatic_rows(const Args<float>& args, int64_t max_shared_bytes) {
  static std::mutex mutex;
  static std::map<std::array<int64_t, 6>, int64_t> chosen;
  const std::array<int64_t, 6> key = {at::cuda::current_device(), args.batch,          args.hidden,
                                      args.policy_in,             args.policy_hidden, args.value_hidden};
  const std::lock_guard<std::mutex> lock(mutex);
  const auto found = chosen.find(key);
  if (found != chosen.end()) return found->second;
  int64_t rows = kMinClusterRows;
  for (int64_t r = kMinClusterRows; r <= kMaxClusterRows; r += kRowTile) {
    const Layout layout(args.hidden, args.policy_in, args.policy_hidden, args.value_hidden, r);
    if (layout.bytes() > max_shared_bytes) break;
    rows = r;
    C10_CUDA_CHECK(cudaFuncSetAttribute(cartpole_rollout_clusters_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(layout.bytes())));
    cudaLaunchAttribute cluster[1];
    const cudaLaunchConfig_t config = launch_config(args, layout, cluster);
    int resident = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&resident, cartpole_rollout_clusters_kernel, &config));
    if ((args.batch + r - 1) / r <= resident) break;
  }
  chosen.emplace(key, rows);
  return rows;
}

void launch(const Args<float>& args, int64_t rows_per_cluster) {
  const cudaDeviceProp* device = at::cuda::getCurrentDeviceProperties();
  TORCH_CHECK(device->major >= 9, "deepep::cartpole_rollout_clusters needs thread-block clusters (compute capability ",
              "9.0 or later), got ", device->major, ".", device->minor);
  const auto max_shared_bytes = static_cast<int64_t>(device->sharedMemPerBlockOptin);
  const int64_t rows = rows_per_cluster == 0 ? automatic_rows(args, max_shared_bytes) : rows_per_cluster;
  const Layout layout(args.hidden, args.policy_in, args.policy_hidden, args.value_hidden, rows);
  TORCH_CHECK(layout.bytes() <= max_shared_bytes, "deepep::cartpole_rollout_clusters: ", layout.bytes(),
              " bytes of shared memory per block for H=", args.hidden, " and ", rows,
              " rows per cluster exceed the device's ", max_shared_bytes);
  C10_CUDA_CHECK(cudaFuncSetAttribute(cartpole_rollout_clusters_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(layout.bytes())));
  cudaLaunchAttribute cluster[1];
  const cudaLaunchConfig_t config = launch_config(args, layout, cluster);
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, cartpole_rollout_clusters_kernel, args, layout));
}

Outputs cartpole_rollout_clusters_cuda(const at::Tensor& state, const at::Tensor& episode_return,
                                       const at::Tensor& episode_length, const at::Tensor& hidden,
                                       const at::Tensor& uniforms, const at::Tensor& noise, at::TensorList weights,
                                       double logit_bound, int64_t max_episode_steps, int64_t rows_per_cluster) {
  const c10::cuda::CUDAGuard device_guard(hidden.device());
  TORCH_CHECK(hidden.scalar_type() == at::kFloat, "deepep::cartpole_rollout_clusters: hidden must be float32, got ",
              hidden.scalar_type(), " (deepep::cartpole_rollout runs float64)");
  TORCH_CHECK(rows_per_cluster == 0 || (rows_per_cluster % kRowTile == 0 && rows_per_cluster >= kMinClusterRows &&
                                        rows_per_cluster <= kMaxClusterRows),
              "deepep::cartpole_rollout_clusters: rows_per_cluster must be 0 (automatic) or a multiple of ", kRowTile,
              " in [", kMinClusterRows, ", ", kMaxClusterRows, "], got ", rows_per_cluster);
  return cartpole_rollout_impl(
      state, episode_return, episode_length, hidden, uniforms, noise, weights, logit_bound, max_episode_steps,
      kMaxRows, [rows_per_cluster](const Args<float>& args) { launch(args, rows_per_cluster); },
      [](const Args<double>&) { TORCH_CHECK(false, "deepep::cartpole_rollout_clusters runs float32 only"); });
}

}  // namespace

TORCH_LIBRARY_IMPL(deepep, CUDA, m) { m.impl("cartpole_rollout_clusters", &cartpole_rollout_clusters_cuda); }

}  // namespace deepep::rollout
