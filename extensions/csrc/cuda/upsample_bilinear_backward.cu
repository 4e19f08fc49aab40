// Deterministic CUDA backward of bilinear upsampling (F.interpolate(mode="bilinear"), 4-D input,
// antialias=False); the forward is PyTorch's own kernel.
//
// PyTorch's upsample_bilinear2d_backward scatters every grad_output element into its 4 source
// pixels with float atomicAdd (nondeterministic order; refused under
// torch.use_deterministic_algorithms(True)). The map is separable, grad_input = A_hᵀ · grad_output
// · A_w per plane, and along each axis output index o reads source i0(o) with weight 1 - lambda(o)
// and source i0(o) + p(o) with weight lambda(o) (p = 0 on the last row/column), with i0, lambda
// from PyTorch's own area_pixel_compute_scale / area_pixel_compute_source_index (UpSample.cuh), so
// the index map is PyTorch's exactly. i0 is non-decreasing in o, hence the outputs that read
// source i are one contiguous range [start(i - 1), start(i + 1)), start(i) = the first o with
// i0(o) >= i (a binary search over PyTorch's formula).
//
// One kernel, one block per (group of 1-8 planes, 32 x 32 tile of grad_input), 32 x 8 threads; per plane:
//   1. column pass: for every output row oh the tile reads (its window), lane x sums its output
//      columns, column_sum(oh, x) = sum over ow in [start_w(x - 1), start_w(x + 1)) of
//      A_w(ow, x) * grad_output(oh, ow), in increasing ow, into shared memory (coalesced along W);
//   2. row pass: thread (x, y) adds A_h(oh, y) * column_sum(oh, x) over oh in
//      [start_h(y - 1), start_h(y + 1)) in increasing oh, and writes grad_input(y, x) once.
// Windows taller than the shared buffer (upsampling by more than ~3.8x) go through it in chunks
// of output rows; the row sums carry over, so the chunking does not change them.
// Why deterministic, whatever the launch configuration: column_sum(oh, x) is a function of
// (oh, x) alone and every grad_input element is one running sum over oh in increasing order, so
// the tile shape, the chunking and the block count change who computes a sum, never its order.
// Sums are in accscalar_t (float for float/half/bfloat16, double for double): every sum has the
// few taps of one axis (2-3 for scale <= 1.5x, ~2s for scale s), not the s^2 of a 2-D window.
//
// For speed:
//   - 1 launch: the indices are computed where they are used, segment starts once per block into
//     shared memory;
//   - grad_output is read once, coalesced; each grad_input element is one running sum over the few
//     row taps of its column sums, not over its whole 2-D window;
//   - grad_input from at::detail::empty_cuda: at::empty's deterministic-mode NaN fill would write
//     it once more; every element is written by the kernel.
// All work is on the current stream, nothing synchronises.
#include <ATen/ATen.h>
#include <ATen/AccumulateType.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/EmptyTensor.h>
#include <ATen/native/cuda/UpSample.cuh>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <climits>
#include <optional>

namespace deepep_lightning {

// Defined in ../refused_ops.cpp.
void check_upsample_args(const at::Tensor& grad_output, at::IntArrayRef input_size);
at::Tensor upsample_bilinear2d_forward(const at::Tensor& input, at::IntArrayRef output_size,
                                       bool align_corners, std::optional<double> scale_h,
                                       std::optional<double> scale_w);

namespace {

constexpr int kTileWidth = 32;  // input columns per block: the lanes of a warp
constexpr int kWarps = 8;       // blockDim = (kTileWidth, kWarps)
constexpr int kRowsPerThread = 4;
constexpr int kTileHeight = kWarps * kRowsPerThread;  // input rows per block
constexpr int kChunkRows = 128;  // output rows whose column sums fit in shared memory at once

// One axis of the map, as PyTorch's kernel computes it.
template <typename accscalar_t>
struct AxisMap {
  accscalar_t scale;  // area_pixel_compute_scale
  int in_size;
  int out_size;
  bool align_corners;

  __device__ __forceinline__ accscalar_t source(int o) const {
    return at::native::area_pixel_compute_source_index<accscalar_t>(scale, o, align_corners, /*cubic=*/false);
  }

  // i0(o): truncation as in PyTorch's kernel (source >= 0), clamped to the last index.
  __device__ __forceinline__ int first_source(int o) const {
    const int truncated = static_cast<int>(source(o));
    return truncated < in_size - 1 ? truncated : in_size - 1;
  }

  // Weight with which output o reads source i (0 when it does not): 1 - lambda for i0, lambda for
  // i0 + p, both when they coincide (the last row/column).
  __device__ __forceinline__ accscalar_t weight(int o, int i) const {
    const accscalar_t real = source(o);
    const int truncated = static_cast<int>(real);
    const int i0 = truncated < in_size - 1 ? truncated : in_size - 1;
    const int i1 = i0 + (i0 < in_size - 1 ? 1 : 0);
    const accscalar_t lambda = real - truncated;
    accscalar_t result = 0;
    if (i0 == i) result += static_cast<accscalar_t>(1) - lambda;
    if (i1 == i) result += lambda;
    return result;
  }

  // First o in [0, out_size] with first_source(o) >= i (out_size when none).
  __device__ int start(int i) const {
    if (i <= 0) return 0;
    if (i >= in_size) return out_size;
    int low = 0, high = out_size;
    while (low < high) {
      const int mid = low + (high - low) / 2;
      if (first_source(mid) < i) low = mid + 1; else high = mid;
    }
    return low;
  }
};

template <typename scalar_t, typename accscalar_t>
__global__ void __launch_bounds__(kTileWidth * kWarps) upsample_bilinear_backward_kernel(
    const int tiles_x, const int tiles_per_plane, const int64_t planes, const int planes_per_block,
    const AxisMap<accscalar_t> rows, const AxisMap<accscalar_t> columns,
    const scalar_t* __restrict__ grad_output,  // [N * C, H_out, W_out]
    scalar_t* __restrict__ grad_input) {       // [N * C, H_in, W_in]
  __shared__ accscalar_t column_sums[kChunkRows][kTileWidth];  // [output row - chunk begin, tile column]
  __shared__ int row_start[kTileHeight + 2];                   // start_h(y0 - 1 + k)
  __shared__ int column_start[kTileWidth + 2];                 // start_w(x0 - 1 + k)
  const int lane = threadIdx.x, warp = threadIdx.y;
  const int64_t plane_group = blockIdx.x / tiles_per_plane;
  const int tile = static_cast<int>(blockIdx.x - plane_group * tiles_per_plane);
  const int y0 = (tile / tiles_x) * kTileHeight;
  const int x0 = (tile % tiles_x) * kTileWidth;
  const int in_h = rows.in_size, in_w = columns.in_size;
  const int out_h = rows.out_size, out_w = columns.out_size;

  const int thread = warp * kTileWidth + lane;
  if (thread < kTileHeight + 2) {
    row_start[thread] = rows.start(y0 - 1 + thread);
  } else if (thread < kTileHeight + 2 + kTileWidth + 2) {
    const int k = thread - (kTileHeight + 2);
    column_start[k] = columns.start(x0 - 1 + k);
  }
  __syncthreads();

  const int x = x0 + lane;
  const bool column_inside = x < in_w;
  const int column_begin = column_start[lane], column_end = column_start[lane + 2];
  int row_begin[kRowsPerThread], row_end[kRowsPerThread];
#pragma unroll
  for (int r = 0; r < kRowsPerThread; ++r) {
    const int t = warp + kWarps * r;  // this thread's input rows: y0 + t (none past the last row)
    row_begin[r] = row_start[t];
    row_end[r] = y0 + t < in_h ? row_start[t + 2] : row_start[t];
  }
  // Output rows read by the tile: [start_h(y0 - 1), start_h(y0 + kTileHeight)).
  const int window_end = row_start[kTileHeight + 1];
  // The segment starts depend on the tile only: one block does the same tile of several planes.
  const int64_t group_end = (plane_group + 1) * planes_per_block;
  const int64_t plane_end = group_end < planes ? group_end : planes;
  for (int64_t plane = plane_group * planes_per_block; plane < plane_end; ++plane) {
    const scalar_t* grad_plane = grad_output + plane * out_h * out_w;
    accscalar_t acc[kRowsPerThread];
#pragma unroll
    for (int r = 0; r < kRowsPerThread; ++r) acc[r] = 0;
    for (int chunk_begin = row_start[0]; chunk_begin < window_end; chunk_begin += kChunkRows) {
      const int chunk_end = min(chunk_begin + kChunkRows, window_end);
      if (column_inside) {
        for (int oh = chunk_begin + warp; oh < chunk_end; oh += kWarps) {
          const scalar_t* grad_row = grad_plane + static_cast<int64_t>(oh) * out_w;
          accscalar_t sum = 0;
          for (int ow = column_begin; ow < column_end; ++ow) {
            sum += columns.weight(ow, x) * static_cast<accscalar_t>(grad_row[ow]);
          }
          column_sums[oh - chunk_begin][lane] = sum;
        }
      }
      __syncthreads();
      if (column_inside) {
#pragma unroll
        for (int r = 0; r < kRowsPerThread; ++r) {
          const int y = y0 + warp + kWarps * r;
          const int begin = max(row_begin[r], chunk_begin), end = min(row_end[r], chunk_end);
          for (int oh = begin; oh < end; ++oh) {
            acc[r] += rows.weight(oh, y) * column_sums[oh - chunk_begin][lane];
          }
        }
      }
      __syncthreads();  // before the next chunk (or plane) overwrites column_sums
    }
    if (column_inside) {
#pragma unroll
      for (int r = 0; r < kRowsPerThread; ++r) {
        const int y = y0 + warp + kWarps * r;
        if (y < in_h) grad_input[(plane * in_h + y) * in_w + x] = static_cast<scalar_t>(acc[r]);
      }
    }
  }
}

at::Tensor upsample_bilinear2d_backward_cuda(const at::Tensor& grad_output, at::IntArrayRef input_size,
                                             bool align_corners, std::optional<double> scale_h,
                                             std::optional<double> scale_w) {
  check_upsample_args(grad_output, input_size);
  TORCH_CHECK(grad_output.is_cuda(), "upsample_bilinear2d_backward: grad_output must be a CUDA tensor, got ",
              grad_output.device());
  const c10::cuda::CUDAGuard device_guard(grad_output.device());
  const int64_t in_h = input_size[2], in_w = input_size[3];
  const int64_t out_h = grad_output.size(2), out_w = grad_output.size(3);
  // Tile arithmetic reaches in_h + kTileHeight + 1 and in_w + kTileWidth + 1.
  const int64_t size_limit = INT_MAX - 2 * (kTileHeight + kTileWidth);
  TORCH_CHECK(in_h < size_limit && in_w < size_limit && out_h < size_limit && out_w < size_limit,
              "upsample_bilinear2d_backward: spatial sizes must be below 2^31 - ", 2 * (kTileHeight + kTileWidth),
              ", got input_size ", input_size, " and grad_output ", grad_output.sizes());
  const at::Tensor grad_c = grad_output.contiguous();
  // Written in full by the kernel: no deterministic-mode fill needed.
  at::Tensor grad_input = at::Tensor(at::detail::empty_cuda(input_size, grad_c.scalar_type(), grad_c.device(),
                                                            std::nullopt));
  if (grad_input.numel() == 0) return grad_input;
  if (grad_c.numel() == 0) return grad_input.zero_();
  const int64_t planes = input_size[0] * input_size[1];
  const int64_t tiles_x = (in_w + kTileWidth - 1) / kTileWidth;
  const int64_t tiles_per_plane = tiles_x * ((in_h + kTileHeight - 1) / kTileHeight);
  TORCH_CHECK(tiles_per_plane <= INT_MAX && planes * tiles_per_plane <= INT_MAX,
              "upsample_bilinear2d_backward: at most 2^31 - 1 tiles of ", kTileHeight, " x ", kTileWidth,
              " input pixels, got input_size ", input_size);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  // Several planes per block when there are blocks to spare (small planes, e.g. downsampling): the
  // segment starts (binary searches) and block set-up are paid once per tile instead of per plane.
  // Keep at least ~2 full waves of blocks; at most 8 planes per block.
  const int64_t wave = static_cast<int64_t>(at::cuda::getCurrentDeviceProperties()->multiProcessorCount) *
                       (2048 / (kTileWidth * kWarps));
  const int planes_per_block =
      static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(8, planes * tiles_per_plane / (2 * wave))));
  const int64_t plane_groups = (planes + planes_per_block - 1) / planes_per_block;

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad_c.scalar_type(), "upsample_bilinear2d_backward_cuda", [&] {
    using accscalar_t = at::acc_type<scalar_t, /*is_cuda=*/true>;
    const AxisMap<accscalar_t> rows{
        at::native::area_pixel_compute_scale<accscalar_t>(static_cast<int>(in_h), static_cast<int>(out_h),
                                                          align_corners, scale_h),
        static_cast<int>(in_h), static_cast<int>(out_h), align_corners};
    const AxisMap<accscalar_t> columns{
        at::native::area_pixel_compute_scale<accscalar_t>(static_cast<int>(in_w), static_cast<int>(out_w),
                                                          align_corners, scale_w),
        static_cast<int>(in_w), static_cast<int>(out_w), align_corners};
    upsample_bilinear_backward_kernel<scalar_t, accscalar_t>
        <<<static_cast<unsigned int>(plane_groups * tiles_per_plane), dim3(kTileWidth, kWarps), 0, stream>>>(
            static_cast<int>(tiles_x), static_cast<int>(tiles_per_plane), planes, planes_per_block, rows, columns,
            grad_c.data_ptr<scalar_t>(), grad_input.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return grad_input;
}

}  // namespace

TORCH_LIBRARY_IMPL(deepep_lightning, CUDA, m) {
  m.impl("upsample_bilinear2d", &upsample_bilinear2d_forward);
  m.impl("upsample_bilinear2d_backward", &upsample_bilinear2d_backward_cuda);
}

}  // namespace deepep_lightning
