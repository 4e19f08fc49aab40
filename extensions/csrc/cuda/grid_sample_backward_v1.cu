// v1 of the deterministic CUDA backward of bilinear 2-D grid_sample, kept (unchanged) so that one
// GPU run can time it side by side with v2 (grid_sample_backward.cu, the default); selected by
// DEEPEP_REFUSED_OPS_KERNEL=v1. Delete this file once v2 is measured.
//
// PyTorch's grid_sampler_2d_backward scatters weight * grad_output into grad_input with float
// atomicAdd, so the summation order (and the last bits) change from run to run; under
// torch.use_deterministic_algorithms(True) it raises. Here:
//   grad_grid  is per sample point (no reduction across points): one thread per point sums over
//              channels in channel order with PyTorch's formulas (GridSampler.cuh helpers);
//   grad_input is a sort + segmented gather, with no float atomics. A point with top-left corner
//   (y0, x0) = floor(iy, ix) feeds the 4 pixels of "cell" (y0 + 1, x0 + 1) of an
//   (H_in + 1) x (W_in + 1) cell grid (cells -1 .. H_in - 1 shifted by one), so:
//     1. the same point kernel writes per point its cell key = (n * (H_in + 1) + y0 + 1) *
//        (W_in + 1) + x0 + 1 (a sentinel past the last cell when no corner is inside the image)
//        and its 4 corner weights (nw, ne, sw, se, PyTorch's formulas);
//     2. a stable radix sort (cub::DeviceRadixSort::SortPairs, only the bits a key can use)
//        orders the point ids by cell; equal keys keep point order, so the order is a function
//        of the grid only (one key per point, not per corner: 4x less to sort);
//     3. a binary search per cell gives it its segment [start, end) of the sorted points;
//     4. one thread per (pixel, channel) walks the 4 cells that touch its pixel in a fixed order
//        (as se, sw, ne, nw corner), each segment in sorted order, sums weight * grad_output in
//        double and writes its grad_input element once.
// All work is on the current stream, nothing synchronises.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/native/cuda/GridSampler.cuh>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <cub/device/device_radix_sort.cuh>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <tuple>

namespace deepep {

// Defined in ../refused_ops.cpp.
void check_grid_sample_args(const at::Tensor& input, const at::Tensor& grid, int64_t padding_mode);

namespace v1 {
namespace {

using at::native::GridSamplerPadding;

constexpr int kThreads = 256;

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
    at::opmath_type<scalar_t>* __restrict__ weights) {  // [P, 4] nw, ne, sw, se
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
  const int64_t offset_nw = static_cast<int64_t>(y0) * in_w + x0;
  opmath_t gix = 0, giy = 0;
  for (int c = 0; c < channels; ++c) {
    const opmath_t g = static_cast<opmath_t>(grad_n[c * out_hw]);
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

template <typename scalar_t>
__global__ void grid_sample_gather_kernel(
    const int64_t num_pixels, const int channels, const int in_h, const int in_w,
    const int32_t* __restrict__ segment_start,                 // [N * (H_in + 1) * (W_in + 1) + 1]
    const int32_t* __restrict__ order,                         // [P] point ids sorted by cell
    const at::opmath_type<scalar_t>* __restrict__ weights,     // [P, 4]
    const scalar_t* __restrict__ grad_output_nhwc,             // [N, H_out, W_out, C]
    scalar_t* __restrict__ grad_input) {                       // [N, C, H_in, W_in]
  using opmath_t = at::opmath_type<scalar_t>;
  // Channel fastest: the threads of one pixel walk the same segments and read adjacent channels.
  const int64_t index = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (index >= num_pixels * channels) return;
  const int64_t pixel = index / channels;
  const int64_t c = index - pixel * channels;
  const int64_t in_hw = static_cast<int64_t>(in_h) * in_w;
  const int64_t n = pixel / in_hw;
  const int y = static_cast<int>((pixel - n * in_hw) / in_w);
  const int x = static_cast<int>(pixel - n * in_hw - static_cast<int64_t>(y) * in_w);
  // Cells (shifted by one) whose corner k is this pixel: (y, x) se, (y, x+1) sw, (y+1, x) ne, (y+1, x+1) nw.
  const int64_t cell_row = (n * (in_h + 1) + y) * (in_w + 1) + x;
  const int64_t cells[4] = {cell_row, cell_row + 1, cell_row + in_w + 1, cell_row + in_w + 2};
  const int corners[4] = {3, 2, 1, 0};
  // Accumulated in double: heavily overlapped pixels sum thousands of terms, and the result
  // should be as good as any order PyTorch's atomics might pick, not worse.
  double acc = 0;
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    const int32_t end = segment_start[cells[s] + 1];
    for (int32_t j = segment_start[cells[s]]; j < end; ++j) {
      const int64_t point = order[j];
      const opmath_t term = weights[4 * point + corners[s]] *
                            static_cast<opmath_t>(grad_output_nhwc[point * channels + c]);
      acc += static_cast<double>(term);
    }
  }
  grad_input[(n * channels + c) * in_hw + (pixel - n * in_hw)] = static_cast<scalar_t>(acc);
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

unsigned int blocks_for(int64_t count) { return static_cast<unsigned int>((count + kThreads - 1) / kThreads); }

// One batch chunk (cell keys and point ids fit in 32 bits; see the caller).
void launch_backward(const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& grid,
                     GridSamplerPadding padding, bool align_corners, bool input_requires_grad,
                     at::Tensor grad_input, at::Tensor grad_grid) {
  const int64_t batch = input.size(0), channels = input.size(1);
  const int64_t in_h = input.size(2), in_w = input.size(3);
  const int64_t out_hw = grid.size(1) * grid.size(2);
  const int64_t num_points = batch * out_hw;
  const int64_t num_pixels = batch * in_h * in_w;
  const int64_t num_cells = batch * (in_h + 1) * (in_w + 1);
  const int64_t num_entries = input_requires_grad ? num_points : 0;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const at::TensorOptions int_options = input.options().dtype(at::kInt);
  // Cell keys (as uint32) and point ids, unsorted then sorted.
  at::Tensor buffers = at::empty({4, num_entries}, int_options);
  auto* keys = reinterpret_cast<uint32_t*>(buffers[0].data_ptr<int32_t>());
  auto* sorted_keys = reinterpret_cast<uint32_t*>(buffers[1].data_ptr<int32_t>());
  int32_t* point_ids = buffers[2].data_ptr<int32_t>();
  int32_t* order = buffers[3].data_ptr<int32_t>();
  at::Tensor weights = at::empty({num_entries, 4}, input.options().dtype(at::toOpMathType(input.scalar_type())));

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "grid_sample_bilinear2d_backward_cuda", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    grid_sample_point_kernel<scalar_t><<<blocks_for(num_points), kThreads, 0, stream>>>(
        num_points, static_cast<int>(channels), static_cast<int>(in_h), static_cast<int>(in_w), out_hw,
        input.data_ptr<scalar_t>(), grid.data_ptr<scalar_t>(), grad_output.data_ptr<scalar_t>(), padding,
        align_corners, input_requires_grad, static_cast<uint32_t>(num_cells), grad_grid.data_ptr<scalar_t>(),
        keys, point_ids, weights.data_ptr<opmath_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    if (!input_requires_grad) return;

    // Stable LSD radix sort over the bits that a key can use (sentinel included): equal keys keep
    // their point order, so the order depends only on the grid.
    int end_bit = 1;
    while (end_bit < 32 && (static_cast<uint64_t>(num_cells) >> end_bit) != 0) ++end_bit;
    size_t temp_bytes = 0;
    C10_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, keys, sorted_keys, point_ids, order,
                                                   static_cast<int>(num_entries), 0, end_bit, stream));
    at::Tensor temp = at::empty({static_cast<int64_t>(temp_bytes)}, input.options().dtype(at::kByte));
    C10_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp.data_ptr(), temp_bytes, keys, sorted_keys, point_ids,
                                                   order, static_cast<int>(num_entries), 0, end_bit, stream));
    at::Tensor segment_start = at::empty({num_cells + 1}, int_options);
    segment_start_kernel<<<blocks_for(num_cells + 1), kThreads, 0, stream>>>(
        static_cast<int32_t>(num_entries), static_cast<uint32_t>(num_cells), sorted_keys,
        segment_start.data_ptr<int32_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    const at::Tensor grad_output_nhwc = grad_output.permute({0, 2, 3, 1}).contiguous();
    grid_sample_gather_kernel<scalar_t><<<blocks_for(num_pixels * channels), kThreads, 0, stream>>>(
        num_pixels, static_cast<int>(channels), static_cast<int>(in_h), static_cast<int>(in_w),
        segment_start.data_ptr<int32_t>(), order, weights.data_ptr<opmath_t>(),
        grad_output_nhwc.data_ptr<scalar_t>(), grad_input.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace

// Called by grid_sample_backward.cu when DEEPEP_REFUSED_OPS_KERNEL=v1.
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
  at::Tensor grad_grid = at::empty(grid_c.sizes(), grid_c.options());  // [N, H_out, W_out, 2]
  // The gather writes every grad_input element exactly once, so no zero fill is needed.
  at::Tensor grad_input = input_requires_grad ? at::empty(input_c.sizes(), input_c.options())
                                              : at::empty({0}, input_c.options());
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
  for (int64_t begin = 0; begin < input_c.size(0); begin += chunk) {
    const int64_t length = std::min(chunk, input_c.size(0) - begin);
    launch_backward(grad_c.narrow(0, begin, length), input_c.narrow(0, begin, length),
                    grid_c.narrow(0, begin, length), padding, align_corners, input_requires_grad,
                    input_requires_grad ? grad_input.narrow(0, begin, length) : grad_input,
                    grad_grid.narrow(0, begin, length));
  }
  return {grad_input, grad_grid};
}

}  // namespace v1
}  // namespace deepep
