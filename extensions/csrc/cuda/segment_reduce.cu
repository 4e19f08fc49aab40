// CUDA kernel of deepep::segment_reduce (what it computes: ../segment_reduce.cpp, element code in
// ../segment_reduce.h).
//
// One thread per output element (row, column) of [size, inner], grid-stride; consecutive threads take
// consecutive columns of a row, so the loads of an entry's row are coalesced and its position in `order`
// is read by the whole warp at once. Each thread combines its row's entries in key-sorted entry order:
// no atomics, bitwise reproducible. A row with m entries costs its threads m dependent loads (one hot
// key serialises, as PyTorch's atomics on one address do). One launch on the current stream, checked, no
// synchronisation: CUDA-graph capturable.
#include "../segment_reduce.h"

#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "gather_launch.cuh"


namespace deepep {
namespace {

using gather::grid_blocks;
using gather::kThreads;

template <typename scalar_t>
__global__ void segment_reduce_kernel(const scalar_t* __restrict__ values, const int64_t* __restrict__ order,
                                      const int64_t* __restrict__ starts, const int64_t* __restrict__ counts,
                                      SegmentReduction reduction, scalar_t* __restrict__ out, int64_t size,
                                      int64_t inner) {
  const int64_t total = size * inner;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    const int64_t row = i / inner;
    segment_reduce_element<scalar_t>(row, i - row * inner, inner, values, order, starts, counts, reduction, out);
  }
}

at::Tensor segment_reduce_cuda(const at::Tensor& values, const at::Tensor& order, const at::Tensor& starts,
                               const at::Tensor& counts, c10::string_view reduce) {
  const SegmentReduction reduction = check_segment_reduce_inputs(values, order, starts, counts, reduce);
  const c10::cuda::CUDAGuard device_guard(values.device());
  const at::Tensor values_c = values.contiguous(), order_c = order.contiguous();
  const at::Tensor starts_c = starts.contiguous(), counts_c = counts.contiguous();
  const int64_t size = starts_c.size(0);
  const int64_t inner = values_c.size(1);
  at::Tensor out = at::empty({size, inner}, values_c.options());
  const int64_t total = size * inner;
  if (total == 0) return out;
  const unsigned int blocks = grid_blocks(total);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_ALL_TYPES_AND2(at::kHalf, at::kBFloat16, values_c.scalar_type(), "segment_reduce_cuda", [&] {
    segment_reduce_kernel<scalar_t><<<blocks, kThreads, 0, stream>>>(
        values_c.data_ptr<scalar_t>(), order_c.data_ptr<int64_t>(), starts_c.data_ptr<int64_t>(),
        counts_c.data_ptr<int64_t>(), reduction, out.data_ptr<scalar_t>(), size, inner);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(deepep, CUDA, m) { m.impl("segment_reduce", &segment_reduce_cuda); }

}  // namespace deepep
