// Launch helpers shared by the grid-stride kernels (the pooling, padding and upsampling gathers,
// gru_cell_backward of the DeepEP workload (deepep/cuda/), segment_reduce, histc_counts).
//
// A gather kernel writes each grad_input element once from a few grad_output elements; its cost is the
// index arithmetic per element. So offsets are uint32 whenever every value that a kernel forms fits
// (divisions then go through at::cuda::detail::IntDivider's multiply-shift instead of a 64-bit
// division), and the grid is a grid-stride loop of a few blocks per SM.
#pragma once

#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/detail/IntegerDivider.cuh>

#include <algorithm>
#include <cstdint>
#include <initializer_list>

namespace deepep_lightning::gather {

constexpr int kThreads = 256;
constexpr int kBlocksPerSm = 8;

// Below this bound the uint32 path is exact: IntDivider<uint32_t> needs values < 2^31, and an index plus
// the grid stride stays below it.
constexpr int64_t kNarrowLimit = int64_t{1} << 30;

inline bool fits_uint32(std::initializer_list<int64_t> values) {
  return std::all_of(values.begin(), values.end(), [](int64_t v) { return v >= 0 && v < kNarrowLimit; });
}

inline unsigned int grid_blocks(int64_t total) {
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  return static_cast<unsigned int>(std::min<int64_t>((total + kThreads - 1) / kThreads, sms * kBlocksPerSm));
}

// Calls launch(uint32_t{}) or launch(int64_t{}): the index type of the kernel to instantiate.
template <typename Launch>
void with_index_type(bool narrow, Launch&& launch) {
  if (narrow) {
    launch(uint32_t{0});
  } else {
    launch(int64_t{0});
  }
}

template <typename index_t>
using Divider = at::cuda::detail::IntDivider<index_t>;

}  // namespace deepep_lightning::gather
