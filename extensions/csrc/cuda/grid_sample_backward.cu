// Deterministic CUDA backward of bilinear 2-D grid_sample (forward: PyTorch's own kernel).
//
// PyTorch's grid_sampler_2d_backward scatters weight * grad_output into grad_input with float
// atomicAdd, so the summation order (and the last bits) change from run to run; under
// torch.use_deterministic_algorithms(True) it raises. Here:
//   grad_grid  is per sample point (no reduction across points): one thread per point sums over
//              channels in channel order with PyTorch's formulas (GridSampler.cuh helpers);
//   grad_input is a sort + segmented gather, with no float atomics. A point with top-left corner
//   (y0, x0) = floor(iy, ix) feeds the 4 pixels of "cell" (y0 + 1, x0 + 1) of an
//   (H_in + 1) x (W_in + 1) cell grid (cells -1 .. H_in - 1 shifted by one), so:
//     1. the point kernel writes per point its cell key = (n * (H_in + 1) + y0 + 1) * (W_in + 1) +
//        x0 + 1 (a sentinel past the last cell when no corner is inside the image), its 4 corner
//        weights (nw, ne, sw, se, PyTorch's formulas) and its grad_output row [C] (grad_output in
//        NHWC, written while the point reads its channels anyway);
//     2. a stable LSD radix sort (cub, only the bits a key can use) orders the point ids by cell;
//        equal keys keep point order, so the order is a function of the grid only;
//     3. a binary search per cell gives it its segment [start, end) of the sorted points;
//     4. a segment of L points is split into L / K full chunks of K = 32 sorted points, from its
//        start, and a tail of L % K points; one thread per (chunk, channel) sums the chunk's terms
//        weight * grad_output per corner, in sorted order, in double, into a fixed slot (the slot
//        index is chunk start / K: full chunks are disjoint runs of K, so no two share a slot);
//     5. one thread per (pixel, group of 1-8 channels) walks the 4 cells that touch its pixel in a
//        fixed order (as se, sw, ne, nw corner) and, in each, adds the full chunks' sums in chunk
//        order, then the tail's terms weight * grad_output in sorted order, in double, one running
//        sum per channel, written once.
// Why deterministic, whatever the launch configuration: every grad_input element is one running
// sum of chunk sums and terms, each chunk sum a running sum of its own terms, and which terms go
// where and in what order is a function of each cell's sorted point list (so of the sample's grid)
// alone: the chunks start at the segment's own start, not at positions in the batch's sorted array,
// so another batch around a sample does not move them. Threads, blocks, the channel grouping and
// the load unrolling change who computes a sum and when its loads are issued, never the order of
// its additions. Segments shorter than K (the usual case) are summed term by term in sorted order;
// longer ones are grouped by chunks (step 4), which rounds differently from a term-by-term sum
// but is just as fixed.
//
// For speed:
//   - outputs and scratch come from at::detail::empty_cuda: at::empty runs a NaN-fill kernel over
//     every new tensor while torch.use_deterministic_algorithms(True) is on (PyTorch's
//     fill_uninitialized_memory), 7 fills a call with at::empty; every byte here is written before
//     it is read. All scratch buffers share one allocation;
//   - grad_output's NHWC rows are written by the point kernel, which reads those channels anyway:
//     no separate permute copy (one launch and 2 x |grad_output| of traffic saved);
//   - the gather reads the segment bounds, point ids and weights once per group of up to 8
//     channels, not once per channel (C x fewer threads for C <= 8), a point's 8 values are one
//     32-byte read, and 4 points' loads are in flight together, so long segments (heavy overlap)
//     cost a quarter of the dependent-load latency;
//   - the sort runs on a cub::DoubleBuffer: no extra key/value copies in its temp storage;
//   - long segments (heavy overlap: a grid that samples a small region, ~1600 points per cell) are
//     pre-summed in chunks of K by many threads (step 4), so a pixel's thread adds L / K + L % K
//     values per cell instead of L, rather than the few threads of covered pixels walking thousands
//     of entries each while the rest of the GPU idles. The chunk pass costs one launch (P / K x C threads,
//     most of which exit after 2-4 cached reads when segments are short); no scan, no host sync.
// All work is on the current stream, nothing synchronises.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/EmptyTensor.h>
#include <ATen/native/cuda/GridSampler.cuh>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cub/device/device_radix_sort.cuh>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <optional>
#include <tuple>

namespace deepep_lightning {

// Defined in ../refused_ops.cpp.
void check_grid_sample_args(const at::Tensor& input, const at::Tensor& grid, int64_t padding_mode);
at::Tensor grid_sample_bilinear2d_forward(const at::Tensor& input, const at::Tensor& grid,
                                          int64_t padding_mode, bool align_corners);

namespace {

using at::native::GridSamplerPadding;

constexpr int kThreads = 256;
constexpr int kMaxChannelsPerThread = 8;  // float: one 32-byte read per point visit
constexpr int kUnroll = 4;             // points of a segment whose loads are issued together
constexpr size_t kScratchAlignment = 256;
constexpr int kChunk = 32;             // sorted entries per pre-summed chunk of a long segment

template <typename scalar_t>
__global__ void grid_sample_point_kernel(
    const int64_t num_points, const int channels, const int in_h, const int in_w, const int64_t out_hw,
    const scalar_t* __restrict__ input,        // [N, C, H_in, W_in]
    const scalar_t* __restrict__ grid,         // [N, H_out, W_out, 2]
    const scalar_t* __restrict__ grad_output,  // [N, C, H_out, W_out]
    const GridSamplerPadding padding_mode, const bool align_corners, const bool want_input_grad,
    const uint32_t sentinel,
    scalar_t* __restrict__ grad_grid,                   // [N, H_out, W_out, 2]
    uint32_t* __restrict__ keys,                        // [P] cell of each point
    int32_t* __restrict__ point_ids,                    // [P] 0, 1, 2, ... (sort payload)
    at::opmath_type<scalar_t>* __restrict__ weights,    // [P, 4] nw, ne, sw, se
    scalar_t* __restrict__ grad_rows) {                 // [P, C] or nullptr (not needed, or C == 1)
  using opmath_t = at::opmath_type<scalar_t>;
  const int64_t point = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (point >= num_points) return;
  const int64_t n = point / out_hw;
  const int64_t hw = point - n * out_hw;
  const int64_t in_hw = static_cast<int64_t>(in_h) * in_w;

  opmath_t gx_mult, gy_mult;
  const opmath_t ix = at::native::grid_sampler_compute_source_index_set_grad(
      static_cast<opmath_t>(grid[2 * point]), in_w, padding_mode, align_corners, &gx_mult);
  const opmath_t iy = at::native::grid_sampler_compute_source_index_set_grad(
      static_cast<opmath_t>(grid[2 * point + 1]), in_h, padding_mode, align_corners, &gy_mult);
  const int x0 = static_cast<int>(::floor(ix));
  const int y0 = static_cast<int>(::floor(iy));
  const int x1 = x0 + 1;
  const int y1 = y0 + 1;
  // Corner order nw, ne, sw, se and the surfaces as in PyTorch's kernel.
  const int corner_x[4] = {x0, x1, x0, x1};
  const int corner_y[4] = {y0, y0, y1, y1};
  const opmath_t corner_weight[4] = {(x1 - ix) * (y1 - iy), (ix - x0) * (y1 - iy),
                                     (x1 - ix) * (iy - y0), (ix - x0) * (iy - y0)};
  bool inside[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) inside[k] = at::native::within_bounds_2d(corner_y[k], corner_x[k], in_h, in_w);

  if (want_input_grad) {
    // Some corner is inside iff the cell is in [0, H_in] x [0, W_in] (corners x0, x0 + 1).
    const bool any_inside = inside[0] || inside[1] || inside[2] || inside[3];
    keys[point] = any_inside ? static_cast<uint32_t>((n * (in_h + 1) + y0 + 1) * (in_w + 1) + x0 + 1) : sentinel;
    point_ids[point] = static_cast<int32_t>(point);
#pragma unroll
    for (int k = 0; k < 4; ++k) weights[4 * point + k] = corner_weight[k];
  }

  const scalar_t* input_n = input + n * channels * in_hw;
  const scalar_t* grad_n = grad_output + n * channels * out_hw + hw;
  scalar_t* grad_row = grad_rows == nullptr ? nullptr : grad_rows + point * channels;
  const int64_t offset_nw = static_cast<int64_t>(y0) * in_w + x0;
  opmath_t gix = 0, giy = 0;
  for (int c = 0; c < channels; ++c) {
    const scalar_t grad_value = grad_n[c * out_hw];
    if (grad_row != nullptr) grad_row[c] = grad_value;
    const opmath_t g = static_cast<opmath_t>(grad_value);
    const scalar_t* plane = input_n + c * in_hw;
    if (inside[0]) {
      const opmath_t v = static_cast<opmath_t>(plane[offset_nw]);
      gix -= v * (y1 - iy) * g;
      giy -= v * (x1 - ix) * g;
    }
    if (inside[1]) {
      const opmath_t v = static_cast<opmath_t>(plane[offset_nw + 1]);
      gix += v * (y1 - iy) * g;
      giy -= v * (ix - x0) * g;
    }
    if (inside[2]) {
      const opmath_t v = static_cast<opmath_t>(plane[offset_nw + in_w]);
      gix -= v * (iy - y0) * g;
      giy += v * (x1 - ix) * g;
    }
    if (inside[3]) {
      const opmath_t v = static_cast<opmath_t>(plane[offset_nw + in_w + 1]);
      gix += v * (iy - y0) * g;
      giy += v * (ix - x0) * g;
    }
  }
  grad_grid[2 * point] = static_cast<scalar_t>(gx_mult * gix);
  grad_grid[2 * point + 1] = static_cast<scalar_t>(gy_mult * giy);
}

// segment_start[q] = first j with sorted_keys[j] >= q, q in [0, num_cells]: a binary search per
// cell, O(log P) reads, whatever the overlap.
__global__ void segment_start_kernel(const int32_t num_entries, const uint32_t num_cells,
                                     const uint32_t* __restrict__ sorted_keys, int32_t* __restrict__ segment_start) {
  const int64_t q = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (q > num_cells) return;
  int32_t low = 0, high = num_entries;
  while (low < high) {
    const int32_t mid = low + (high - low) / 2;
    if (sorted_keys[mid] < static_cast<uint32_t>(q)) low = mid + 1; else high = mid;
  }
  segment_start[q] = low;
}

// A cell's segment [s, e) is split into its full chunks [s + m K, s + (m + 1) K), m < (e - s) / K,
// and a tail [s + (e - s) / K * K, e) of fewer than K entries (K = kChunk). Full chunks are disjoint
// runs of K entries, so no two start in the same slot [b K, (b + 1) K) of the sorted array: the
// chunk starting in slot b keeps its 4 corner sums at partials[b] (P / K slots, no scan, no
// host sync). One thread per (slot, channel), channel fastest; it finds the chunk starting in its
// slot, if any: it belongs either to the cell of the slot's first entry (a segment starting at or
// before b K) or, starting later in the slot, to the cell of the slot's last entry (a full chunk
// starting inside the slot covers its last entry). It sums the chunk's K terms per corner in sorted
// order, in double, from zero. Slots without a chunk are left unwritten; the gather never reads them.
template <typename scalar_t>
__global__ void grid_sample_chunk_kernel(
    const int64_t num_items, const int channels, const uint32_t num_cells,
    const uint32_t* __restrict__ sorted_keys,               // [P]
    const int32_t* __restrict__ segment_start,              // [num_cells + 1]
    const int32_t* __restrict__ order,                      // [P] point ids sorted by cell
    const at::opmath_type<scalar_t>* __restrict__ weights,  // [P, 4]
    const scalar_t* __restrict__ grad_rows,                 // [P, C]
    double* __restrict__ partials) {                        // [P / K, 4, C]
  using opmath_t = at::opmath_type<scalar_t>;
  const int64_t index = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (index >= num_items) return;
  const int64_t slot = index / channels;
  const int channel = static_cast<int>(index - slot * channels);
  const int32_t slot_begin = static_cast<int32_t>(slot * kChunk);  // slot < P / K: the whole slot is in [0, P)
  int32_t chunk = -1;
  const uint32_t first_key = sorted_keys[slot_begin];
  if (first_key < num_cells) {  // segment start s <= slot_begin: its first chunk start at or after slot_begin
    const int32_t s = segment_start[first_key];
    const int32_t j = s + (slot_begin - s + kChunk - 1) / kChunk * kChunk;
    if (j + kChunk <= segment_start[first_key + 1]) chunk = j;
  }
  if (chunk < 0) {
    const uint32_t last_key = sorted_keys[slot_begin + kChunk - 1];
    if (last_key < num_cells) {
      const int32_t s = segment_start[last_key];
      if (s > slot_begin && s + kChunk <= segment_start[last_key + 1]) chunk = s;
    }
  }
  if (chunk < 0) return;
  double acc[4] = {0, 0, 0, 0};
#pragma unroll 8
  for (int i = 0; i < kChunk; ++i) {
    const int64_t point = order[chunk + i];
    const opmath_t g = static_cast<opmath_t>(grad_rows[point * channels + channel]);
#pragma unroll
    for (int corner = 0; corner < 4; ++corner) {
      acc[corner] += static_cast<double>(weights[4 * point + corner] * g);
    }
  }
  double* out = partials + slot * 4 * channels + channel;
#pragma unroll
  for (int corner = 0; corner < 4; ++corner) out[corner * channels] = acc[corner];
}

// kChannels: channels per thread (1, 2, 4 or 8; the sums do not depend on it).
template <typename scalar_t, int kChannels>
__global__ void grid_sample_gather_kernel(
    const int64_t num_items, const int channels, const int channel_groups, const int in_h, const int in_w,
    const int32_t* __restrict__ segment_start,              // [N * (H_in + 1) * (W_in + 1) + 1]
    const int32_t* __restrict__ order,                      // [P] point ids sorted by cell
    const at::opmath_type<scalar_t>* __restrict__ weights,  // [P, 4]
    const scalar_t* __restrict__ grad_rows,                 // [P, C]: grad_output as [N, H_out, W_out, C]
    const double* __restrict__ partials,                    // [P / K, 4, C]: full chunks' sums
    scalar_t* __restrict__ grad_input) {                    // [N, C, H_in, W_in]
  using opmath_t = at::opmath_type<scalar_t>;
  // Pixel fastest: a warp holds 32 neighbouring pixels of one channel group, so its grad_input
  // stores are coalesced and neighbours share cells (their loads hit L1).
  const int64_t index = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (index >= num_items) return;
  const int64_t in_hw = static_cast<int64_t>(in_h) * in_w;
  const int64_t plane = index / in_hw;  // n * channel_groups + group
  const int64_t pixel = index - plane * in_hw;
  const int64_t n = plane / channel_groups;
  const int channel_begin = static_cast<int>(plane - n * channel_groups) * kChannels;
  const int count = min(kChannels, channels - channel_begin);
  const int y = static_cast<int>(pixel / in_w);
  const int x = static_cast<int>(pixel - static_cast<int64_t>(y) * in_w);
  // Cells (shifted by one) whose corner 3 - s is this pixel, s = 0..3: (y, x) se, (y, x+1) sw,
  // (y+1, x) ne, (y+1, x+1) nw. Their segment bounds are loaded together, up front.
  const int32_t* starts = segment_start + (n * (in_h + 1) + y) * (in_w + 1) + x;
  int32_t begin[4], end[4];
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    const int64_t cell = (s & 1) + (s >> 1) * static_cast<int64_t>(in_w + 1);
    begin[s] = starts[cell];
    end[s] = starts[cell + 1];
  }
  const scalar_t* rows = grad_rows + channel_begin;
  // Accumulated in double: heavily overlapped pixels sum thousands of terms, and the result
  // should be as good as any order PyTorch's atomics might pick, not worse.
  double acc[kChannels];
#pragma unroll
  for (int k = 0; k < kChannels; ++k) acc[k] = 0;
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    const int corner = 3 - s;
    // The segment's full chunks, pre-summed (chunk m starts in slot begin / K + m), in chunk order,
    // then its tail entry by entry.
    const int32_t full_chunks = (end[s] - begin[s]) / kChunk;
    const double* chunk_sums = partials + ((begin[s] / kChunk) * int64_t{4} + corner) * channels + channel_begin;
    const int64_t slot_stride = int64_t{4} * channels;
    int32_t m = 0;
    for (; m + kUnroll <= full_chunks; m += kUnroll) {
      double sums[kUnroll][kChannels];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
        for (int k = 0; k < kChannels; ++k) sums[u][k] = k < count ? chunk_sums[(m + u) * slot_stride + k] : 0.0;
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
        for (int k = 0; k < kChannels; ++k) {
          if (k < count) acc[k] += sums[u][k];
        }
      }
    }
    for (; m < full_chunks; ++m) {
#pragma unroll
      for (int k = 0; k < kChannels; ++k) {
        if (k < count) acc[k] += chunk_sums[m * slot_stride + k];
      }
    }
    int32_t j = begin[s] + full_chunks * kChunk;
    for (; j + kUnroll <= end[s]; j += kUnroll) {
      // All loads of kUnroll points first, then the additions in segment order.
      int64_t point[kUnroll];
      opmath_t weight[kUnroll];
      scalar_t value[kUnroll][kChannels];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) point[u] = order[j + u];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        weight[u] = weights[4 * point[u] + corner];
        const scalar_t* row = rows + point[u] * channels;
#pragma unroll
        for (int k = 0; k < kChannels; ++k) value[u][k] = k < count ? row[k] : scalar_t(0);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
        for (int k = 0; k < kChannels; ++k) {
          if (k < count) acc[k] += static_cast<double>(weight[u] * static_cast<opmath_t>(value[u][k]));
        }
      }
    }
    for (; j < end[s]; ++j) {
      const int64_t point = order[j];
      const opmath_t weight = weights[4 * point + corner];
      const scalar_t* row = rows + point * channels;
#pragma unroll
      for (int k = 0; k < kChannels; ++k) {
        if (k < count) acc[k] += static_cast<double>(weight * static_cast<opmath_t>(row[k]));
      }
    }
  }
  scalar_t* out = grad_input + (n * channels + channel_begin) * in_hw + pixel;
#pragma unroll
  for (int k = 0; k < kChannels; ++k) {
    if (k < count) out[k * in_hw] = static_cast<scalar_t>(acc[k]);
  }
}

unsigned int blocks_for(int64_t count) { return static_cast<unsigned int>((count + kThreads - 1) / kThreads); }

// A CUDA tensor without at::empty's deterministic-mode NaN fill: for buffers written in full
// before anything reads them.
at::Tensor empty_unfilled(at::IntArrayRef sizes, at::ScalarType dtype, at::Device device) {
  return at::Tensor(at::detail::empty_cuda(sizes, dtype, device, std::nullopt));
}

// Byte offsets of the buffers carved out of one scratch allocation.
struct ScratchLayout {
  size_t total = 0;
  size_t add(size_t bytes) {
    const size_t offset = total;
    total += (bytes + kScratchAlignment - 1) / kScratchAlignment * kScratchAlignment;
    return offset;
  }
};

// One batch chunk (cell keys and point ids fit in 32 bits; see the caller).
void launch_backward(const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& grid,
                     GridSamplerPadding padding, bool align_corners, bool input_requires_grad,
                     at::Tensor grad_input, at::Tensor grad_grid) {
  const int64_t batch = input.size(0), channels = input.size(1);
  const int64_t in_h = input.size(2), in_w = input.size(3);
  const int64_t out_hw = grid.size(1) * grid.size(2);
  const int64_t num_points = batch * out_hw;
  const int64_t num_cells = batch * (in_h + 1) * (in_w + 1);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  // Stable LSD radix sort over the bits that a key can use (sentinel included).
  int end_bit = 1;
  while (end_bit < 32 && (static_cast<uint64_t>(num_cells) >> end_bit) != 0) ++end_bit;

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "grid_sample_bilinear2d_backward_cuda", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    const scalar_t* grad_data = grad_output.data_ptr<scalar_t>();
    if (!input_requires_grad) {
      grid_sample_point_kernel<scalar_t><<<blocks_for(num_points), kThreads, 0, stream>>>(
          num_points, static_cast<int>(channels), static_cast<int>(in_h), static_cast<int>(in_w), out_hw,
          input.data_ptr<scalar_t>(), grid.data_ptr<scalar_t>(), grad_data, padding, align_corners,
          /*want_input_grad=*/false, 0u, grad_grid.data_ptr<scalar_t>(), nullptr, nullptr, nullptr, nullptr);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      return;
    }
    const int num_entries = static_cast<int>(num_points);
    cub::DoubleBuffer<uint32_t> key_buffers(nullptr, nullptr);
    cub::DoubleBuffer<int32_t> id_buffers(nullptr, nullptr);
    size_t sort_bytes = 0;
    C10_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, sort_bytes, key_buffers, id_buffers, num_entries, 0,
                                                   end_bit, stream));
    // With C == 1, NCHW grad_output already is [P, C].
    const bool copy_rows = channels > 1;
    ScratchLayout layout;
    const size_t key_bytes = sizeof(uint32_t) * num_points;
    const size_t keys_current = layout.add(key_bytes), keys_alternate = layout.add(key_bytes);
    const size_t ids_current = layout.add(key_bytes), ids_alternate = layout.add(key_bytes);
    const size_t weights_at = layout.add(sizeof(opmath_t) * 4 * num_points);
    const size_t starts_at = layout.add(sizeof(int32_t) * (num_cells + 1));
    const size_t rows_at = layout.add(copy_rows ? sizeof(scalar_t) * num_points * channels : 0);
    const int64_t num_slots = num_points / kChunk;
    const size_t partials_at = layout.add(sizeof(double) * 4 * num_slots * channels);
    const size_t sort_at = layout.add(sort_bytes);
    const at::Tensor scratch = empty_unfilled({static_cast<int64_t>(layout.total)}, at::kByte, input.device());
    auto* base = static_cast<unsigned char*>(scratch.data_ptr());
    auto* keys = reinterpret_cast<uint32_t*>(base + keys_current);
    auto* point_ids = reinterpret_cast<int32_t*>(base + ids_current);
    auto* weights = reinterpret_cast<opmath_t*>(base + weights_at);
    auto* segment_start = reinterpret_cast<int32_t*>(base + starts_at);
    scalar_t* grad_rows = copy_rows ? reinterpret_cast<scalar_t*>(base + rows_at) : nullptr;
    auto* partials = reinterpret_cast<double*>(base + partials_at);

    grid_sample_point_kernel<scalar_t><<<blocks_for(num_points), kThreads, 0, stream>>>(
        num_points, static_cast<int>(channels), static_cast<int>(in_h), static_cast<int>(in_w), out_hw,
        input.data_ptr<scalar_t>(), grid.data_ptr<scalar_t>(), grad_data, padding, align_corners,
        /*want_input_grad=*/true, static_cast<uint32_t>(num_cells), grad_grid.data_ptr<scalar_t>(), keys,
        point_ids, weights, grad_rows);
    C10_CUDA_KERNEL_LAUNCH_CHECK();

    // Equal keys keep their point order (stable), so the order depends only on the grid.
    key_buffers = cub::DoubleBuffer<uint32_t>(keys, reinterpret_cast<uint32_t*>(base + keys_alternate));
    id_buffers = cub::DoubleBuffer<int32_t>(point_ids, reinterpret_cast<int32_t*>(base + ids_alternate));
    C10_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(base + sort_at, sort_bytes, key_buffers, id_buffers,
                                                   num_entries, 0, end_bit, stream));
    segment_start_kernel<<<blocks_for(num_cells + 1), kThreads, 0, stream>>>(
        num_entries, static_cast<uint32_t>(num_cells), key_buffers.Current(), segment_start);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    const scalar_t* rows = copy_rows ? grad_rows : grad_data;
    if (num_slots > 0) {
      const int64_t chunk_items = num_slots * channels;
      grid_sample_chunk_kernel<scalar_t><<<blocks_for(chunk_items), kThreads, 0, stream>>>(
          chunk_items, static_cast<int>(channels), static_cast<uint32_t>(num_cells), key_buffers.Current(),
          segment_start, id_buffers.Current(), weights, rows, partials);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    // Channels per thread: 8 (one 32-byte read per point visit) while that still gives the GPU a full
    // wave of threads; fewer when the input is small, so the serial walks of long segments (a grid
    // that samples a small region heavily) spread over more threads. Few channels: at most 4.
    const cudaDeviceProp* properties = at::cuda::getCurrentDeviceProperties();
    const int64_t full_wave = static_cast<int64_t>(properties->multiProcessorCount) *
                              properties->maxThreadsPerMultiProcessor;
    int channels_per_thread = channels <= 4 ? 4 : kMaxChannelsPerThread;
    while (channels_per_thread > 1 &&
           batch * ((channels + channels_per_thread - 1) / channels_per_thread) * in_h * in_w < full_wave) {
      channels_per_thread /= 2;
    }
    const int64_t channel_groups = (channels + channels_per_thread - 1) / channels_per_thread;
    const int64_t num_items = batch * channel_groups * in_h * in_w;
    const auto gather = channels_per_thread == 1   ? grid_sample_gather_kernel<scalar_t, 1>
                        : channels_per_thread == 2 ? grid_sample_gather_kernel<scalar_t, 2>
                        : channels_per_thread == 4 ? grid_sample_gather_kernel<scalar_t, 4>
                                                   : grid_sample_gather_kernel<scalar_t, kMaxChannelsPerThread>;
    gather<<<blocks_for(num_items), kThreads, 0, stream>>>(
        num_items, static_cast<int>(channels), static_cast<int>(channel_groups), static_cast<int>(in_h),
        static_cast<int>(in_w), segment_start, id_buffers.Current(), weights, rows, partials,
        grad_input.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

std::tuple<at::Tensor, at::Tensor> grid_sample_bilinear2d_backward_cuda(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& grid,
    int64_t padding_mode, bool align_corners, bool input_requires_grad) {
  check_grid_sample_args(input, grid, padding_mode);
  TORCH_CHECK(input.is_cuda(), "grid_sample_bilinear2d_backward: input must be a CUDA tensor, got ",
              input.device());
  TORCH_CHECK(grad_output.device() == input.device() && grad_output.scalar_type() == input.scalar_type(),
              "grid_sample_bilinear2d_backward: grad_output must match input's device and dtype, got ",
              grad_output.device(), " ", grad_output.scalar_type());
  TORCH_CHECK(grad_output.dim() == 4 && grad_output.size(0) == input.size(0) &&
                  grad_output.size(1) == input.size(1) && grad_output.size(2) == grid.size(1) &&
                  grad_output.size(3) == grid.size(2),
              "grid_sample_bilinear2d_backward: grad_output must be [N, C, H_out, W_out] = [",
              input.size(0), ", ", input.size(1), ", ", grid.size(1), ", ", grid.size(2), "], got ",
              grad_output.sizes());
  TORCH_CHECK(input.size(2) <= INT_MAX / 2 && input.size(3) <= INT_MAX / 2 && input.size(1) <= INT_MAX,
              "grid_sample_bilinear2d_backward: input sizes must fit in int32, got ", input.sizes());
  const c10::cuda::CUDAGuard device_guard(input.device());
  const at::Tensor input_c = input.contiguous();
  const at::Tensor grid_c = grid.contiguous();
  const at::Tensor grad_c = grad_output.contiguous();
  // Both are written in full by the kernels below (the gather writes every grad_input element once).
  at::Tensor grad_grid = empty_unfilled(grid_c.sizes(), grid_c.scalar_type(), grid_c.device());  // [N, H_out, W_out, 2]
  const int64_t no_elements[1] = {0};
  at::Tensor grad_input = empty_unfilled(input_requires_grad ? input_c.sizes() : at::IntArrayRef(no_elements),
                                         input_c.scalar_type(), input_c.device());
  if (grid_c.numel() == 0 || input_c.numel() == 0) {  // nothing to sample: all gradients are zero
    return {grad_input.zero_(), grad_grid.zero_()};
  }
  const auto padding = static_cast<GridSamplerPadding>(padding_mode);
  // Samples never share destination pixels, so the batch splits exactly into chunks whose cell
  // keys and point ids fit in 32 bits; the split depends on the shape only.
  const int64_t per_sample_points = grid_c.size(1) * grid_c.size(2);
  const int64_t per_sample_cells = (input_c.size(2) + 1) * (input_c.size(3) + 1);
  const int64_t limit = INT_MAX - 1;
  TORCH_CHECK(per_sample_points <= limit && per_sample_cells <= limit,
              "grid_sample_bilinear2d_backward: one sample needs H_out * W_out and (H_in + 1) * (W_in + 1) "
              "below 2^31, got grid ", grid_c.sizes(), " and input ", input_c.sizes());
  const int64_t chunk = std::max<int64_t>(1, std::min(limit / per_sample_points, limit / per_sample_cells));
  if (chunk >= input_c.size(0)) {  // the usual case: one chunk, no narrow views
    launch_backward(grad_c, input_c, grid_c, padding, align_corners, input_requires_grad, grad_input, grad_grid);
    return {grad_input, grad_grid};
  }
  for (int64_t begin = 0; begin < input_c.size(0); begin += chunk) {
    const int64_t length = std::min(chunk, input_c.size(0) - begin);
    launch_backward(grad_c.narrow(0, begin, length), input_c.narrow(0, begin, length),
                    grid_c.narrow(0, begin, length), padding, align_corners, input_requires_grad,
                    input_requires_grad ? grad_input.narrow(0, begin, length) : grad_input,
                    grad_grid.narrow(0, begin, length));
  }
  return {grad_input, grad_grid};
}

}  // namespace

TORCH_LIBRARY_IMPL(deepep_lightning, CUDA, m) {
  m.impl("grid_sample_bilinear2d", &grid_sample_bilinear2d_forward);
  m.impl("grid_sample_bilinear2d_backward", &grid_sample_bilinear2d_backward_cuda);
}

}  // namespace deepep_lightning
