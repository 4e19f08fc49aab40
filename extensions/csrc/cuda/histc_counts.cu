// CUDA kernel of deepep_lightning::histc_counts (what it computes: ../histc_counts.cpp, the bin: ../histc_counts.h).
//
// Grid-stride over the elements. With at most kSharedBins bins (and fewer than 2^32 elements, so a
// block's 32-bit counters cannot wrap) each block counts in shared memory and adds its counts to the
// output once per bin; otherwise every element adds to the output directly. Every add is an integer
// atomicAdd, exact in any order: the counts are bitwise reproducible. One zero-fill and one launch on the
// current stream, checked, no synchronisation: CUDA-graph capturable.
#include "../histc_counts.h"

#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "gather_launch.cuh"

#include <cstdint>

namespace deepep_lightning {
namespace {

using gather::grid_blocks;
using gather::kThreads;
constexpr int64_t kSharedBins = 8192;  // 32 KiB of 32-bit counters per block

using Count = unsigned long long int;  // atomicAdd's 64-bit integer type; int64 counts are stored in it
static_assert(sizeof(Count) == sizeof(int64_t), "histc_counts stores int64 counts as unsigned long long");

template <typename scalar_t>
__global__ void histc_counts_kernel(const scalar_t* __restrict__ values, int64_t n, histc_acc_t<scalar_t> low,
                                    histc_acc_t<scalar_t> high, int64_t bins, bool shared, Count* __restrict__ counts) {
  using acc_t = histc_acc_t<scalar_t>;
  extern __shared__ unsigned int block_counts[];
  if (shared) {
    for (int64_t b = threadIdx.x; b < bins; b += blockDim.x) block_counts[b] = 0;
    __syncthreads();
  }
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const int64_t bin = histc_bin<acc_t>(static_cast<acc_t>(values[i]), low, high, bins);
    if (bin < 0) continue;
    if (shared) {
      atomicAdd(&block_counts[bin], 1u);
    } else {
      atomicAdd(&counts[bin], Count{1});
    }
  }
  if (shared) {
    __syncthreads();
    for (int64_t b = threadIdx.x; b < bins; b += blockDim.x) {
      if (block_counts[b] != 0) atomicAdd(&counts[b], static_cast<Count>(block_counts[b]));
    }
  }
}

at::Tensor histc_counts_cuda(const at::Tensor& self, int64_t bins, double low, double high) {
  check_histc_counts_inputs(self, bins, low, high);
  const c10::cuda::CUDAGuard device_guard(self.device());
  const at::Tensor values = self.contiguous();
  at::Tensor counts = at::zeros({bins}, values.options().dtype(at::kLong));
  const int64_t n = values.numel();
  if (n == 0) return counts;
  const bool shared = bins <= kSharedBins && n < (int64_t{1} << 32);
  const size_t shared_bytes = shared ? static_cast<size_t>(bins) * sizeof(unsigned int) : 0;
  const unsigned int blocks = grid_blocks(n);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, values.scalar_type(), "histc_counts_cuda", [&] {
    using acc_t = histc_acc_t<scalar_t>;
    histc_counts_kernel<scalar_t><<<blocks, kThreads, shared_bytes, stream>>>(
        values.data_ptr<scalar_t>(), n, static_cast<acc_t>(low), static_cast<acc_t>(high), bins, shared,
        reinterpret_cast<Count*>(counts.data_ptr<int64_t>()));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return counts;
}

}  // namespace

TORCH_LIBRARY_IMPL(deepep_lightning, CUDA, m) { m.impl("histc_counts", &histc_counts_cuda); }

}  // namespace deepep_lightning
