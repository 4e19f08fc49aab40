// The CUDA helper of ../fixed_point_sum.h: the largest finite |value|, as float bits.
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>

#include "../fixed_point_sum.h"
#include "gather_launch.cuh"

namespace deepep_lightning::fixed_point {

namespace {

template <typename scalar_t>
__global__ void max_finite_abs_kernel(int64_t count, const scalar_t* __restrict__ values,
                                      unsigned int* __restrict__ bits) {
  unsigned int largest = 0;  // the bits of a non-negative float order as the float does
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float value = fabsf(static_cast<float>(values[i]));
    if (isfinite(value)) largest = max(largest, __float_as_uint(value));
  }
  largest = __reduce_max_sync(0xffffffffu, largest);  // every lane gets here: whole warps, no early exit
  if ((threadIdx.x & 31) == 0) atomicMax(bits, largest);
}

}  // namespace

void max_finite_abs_cuda(const at::Tensor& values, at::Tensor& max_bits) {
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  if (values.numel() == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, values.scalar_type(), "max_finite_abs_cuda", [&] {
    max_finite_abs_kernel<scalar_t><<<gather::grid_blocks(values.numel()), gather::kThreads, 0, stream>>>(
        values.numel(), values.const_data_ptr<scalar_t>(),
        reinterpret_cast<unsigned int*>(max_bits.data_ptr<int32_t>()));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace deepep_lightning::fixed_point
