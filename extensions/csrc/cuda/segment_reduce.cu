// CUDA kernels of deepep_lightning::segment_reduce (what it computes: ../segment_reduce.cpp, element code in
// ../segment_reduce.h).
//
// After the stable sort of the keys (at::sort), two launches on the current stream:
//   1. segment_bounds_kernel: one thread per output row finds the row's segment of the sorted keys by
//      binary search; the first thread also asserts that every key lies in [0, size) (the sorted keys'
//      ends), a device assert as PyTorch's index kernels raise;
//   2. segment_reduce_kernel: one thread per output element (row, column) of [size, inner], grid-stride;
//      consecutive threads take consecutive columns of a row, so the loads of an entry's row are coalesced
//      and its position in `order` is read by the whole warp at once. Each thread combines its row's entries
//      in key-sorted entry order, then `base`: no atomics, bitwise reproducible. A row with m entries costs
//      its threads m dependent loads (one hot key serialises, as PyTorch's atomics on one address do).
// Checked launches, no synchronisation: CUDA-graph capturable.
#include "../segment_reduce.h"

#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "gather_launch.cuh"


namespace deepep_lightning {
namespace {

using gather::grid_blocks;
using gather::kThreads;

__global__ void segment_bounds_kernel(const int64_t* __restrict__ sorted_keys, int64_t n, int64_t size,
                                      int64_t* __restrict__ starts, int64_t* __restrict__ counts) {
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (first == 0 && n > 0) {
    CUDA_KERNEL_ASSERT(sorted_keys[0] >= 0 && sorted_keys[n - 1] < size && "segment_reduce: index out of range");
  }
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t row = first; row < size; row += stride) segment_bounds_element(row, n, sorted_keys, starts, counts);
}

template <typename scalar_t>
__global__ void segment_reduce_kernel(const scalar_t* __restrict__ values, const int64_t* __restrict__ order,
                                      const int64_t* __restrict__ starts, const int64_t* __restrict__ counts,
                                      const scalar_t* __restrict__ base, bool include_base,
                                      SegmentReduction reduction, scalar_t* __restrict__ out, int64_t size,
                                      int64_t inner) {
  const int64_t total = size * inner;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    const int64_t row = i / inner;
    segment_reduce_element<scalar_t>(row, i - row * inner, inner, values, order, starts, counts, base, include_base,
                                     reduction, out);
  }
}

std::tuple<at::Tensor, at::Tensor> segment_reduce_cuda(const at::Tensor& values, const at::Tensor& keys,
                                                       int64_t size, c10::string_view reduce,
                                                       const std::optional<at::Tensor>& base, bool include_base) {
  const SegmentReduction reduction = check_segment_reduce_inputs(values, keys, size, reduce, base);
  const c10::cuda::CUDAGuard device_guard(values.device());
  const at::Tensor values_c = values.contiguous();
  const at::Tensor base_c = base.has_value() ? base->contiguous() : at::Tensor();
  at::Tensor sorted_keys, order;
  std::tie(sorted_keys, order) = sort_segment_keys(keys);
  const int64_t n = sorted_keys.size(0);
  const int64_t inner = values_c.size(1);
  at::Tensor starts = at::empty({size}, keys.options().dtype(at::kLong));
  at::Tensor counts = at::empty({size}, keys.options().dtype(at::kLong));
  at::Tensor out = at::empty({size, inner}, values_c.options());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  // one thread at least, so that keys into an empty output (size 0) are asserted too
  segment_bounds_kernel<<<grid_blocks(std::max<int64_t>(size, 1)), kThreads, 0, stream>>>(
      sorted_keys.data_ptr<int64_t>(), n, size, starts.data_ptr<int64_t>(), counts.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const int64_t total = size * inner;
  if (total == 0) return {out, counts};
  AT_DISPATCH_ALL_TYPES_AND2(at::kHalf, at::kBFloat16, values_c.scalar_type(), "segment_reduce_cuda", [&] {
    segment_reduce_kernel<scalar_t><<<grid_blocks(total), kThreads, 0, stream>>>(
        values_c.data_ptr<scalar_t>(), order.data_ptr<int64_t>(), starts.data_ptr<int64_t>(),
        counts.data_ptr<int64_t>(), base_c.defined() ? base_c.data_ptr<scalar_t>() : nullptr, include_base,
        reduction, out.data_ptr<scalar_t>(), size, inner);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {out, counts};
}

}  // namespace

TORCH_LIBRARY_IMPL(deepep_lightning, CUDA, m) { m.impl("segment_reduce", &segment_reduce_cuda); }

}  // namespace deepep_lightning
