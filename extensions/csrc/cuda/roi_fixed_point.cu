// CUDA kernels of deepep_lightning::roi_pool_backward (schema, host driver and CPU loops: ../roi_fixed_point.cpp;
// the per-thread math: ../roi_fixed_point.h and ../fixed_point_sum.h).
//
// torchvision's kernel adds each bin's gradient into grad_input with float atomicAdd: the order of the
// additions, and so the last bits, change from run to run, and it refuses deterministic mode. These kernels
// keep that one pass over the bins, one thread per bin, but add each term as a 64-bit integer (its value in
// fixed-point quanta) with integer atomicAdd: integer addition is associative, so the sums do not depend on
// the order the atomics land in. The largest finite |grad| (fixed_point_sum.cu) once, then per chunk of
// channels the atomics and the pass that writes grad_input and clears the sums. Nothing reads data on the host: CUDA-graph capturable.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/EmptyTensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../roi_fixed_point.h"
#include "gather_launch.cuh"

#include <algorithm>

namespace deepep_lightning::roi_fixed_point {

namespace {

using gather::grid_blocks;
using gather::kThreads;

__device__ inline void add_term(unsigned long long* sums, unsigned int* flags, const Shape& shape, const Slot& slot,
                                double term, int s) {
  if (isfinite(term)) {  // two's complement: adding the unsigned bits adds the signed values
    atomicAdd(sums + sum_index(shape, slot), static_cast<unsigned long long>(fixed_point::quantize(term, s)));
  } else {
    atomicOr(flags + flag_word(shape, slot), fixed_point::flag_of(term) << fixed_point::flag_shift(slot.position));
  }
}

template <typename scalar_t>
__global__ void roi_pool_kernel(int64_t threads, const scalar_t* __restrict__ grad, const scalar_t* __restrict__ rois,
                                const int32_t* __restrict__ argmax, Shape shape, Chunk chunk,
                                const unsigned int* __restrict__ max_bits, unsigned long long* __restrict__ sums,
                                unsigned int* __restrict__ flags) {
  const int s = fixed_point::scale_exponent(__uint_as_float(*max_bits), shape.terms_bits);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < threads;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    Slot slot{0, 0};
    int64_t source = 0;
    if (roi_pool_term(i, rois, argmax, shape, chunk, &slot, &source)) {
      add_term(sums, flags, shape, slot, static_cast<double>(grad[source]), s);
    }
  }
}

// One thread per output (blockIdx.y walks the chunk's planes, so a thread divides once per plane; consecutive
// threads read and write consecutive sums and outputs): reads its sum and its byte of the flag word it shares
// with three neighbours in its warp, writes grad_input, and clears the sum and, once the warp has read it, the
// word for the next chunk.
template <typename scalar_t>
__global__ void finish_kernel(Shape shape, Chunk chunk, const unsigned int* __restrict__ max_bits,
                              long long* __restrict__ sums, unsigned int* __restrict__ flags,
                              scalar_t* __restrict__ out) {
  const int s = fixed_point::scale_exponent(__uint_as_float(*max_bits), shape.terms_bits);
  const int64_t plane_size = shape.height * shape.width;
  const int64_t padded = (plane_size + 31) / 32 * 32;  // whole warps: every lane reaches __syncwarp
  for (int64_t plane = blockIdx.y; plane < shape.batch * chunk.count; plane += gridDim.y) {
    const int64_t n = plane / chunk.count;
    scalar_t* destination = out + (n * shape.channels + chunk.first + plane % chunk.count) * plane_size;
    for (int64_t p = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; p < padded;
         p += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      const bool active = p < plane_size;
      const Slot slot{plane, p};
      const unsigned int word_flags = active ? flags[flag_word(shape, slot)] : 0u;
      __syncwarp();  // the word's four lanes have read it before the first clears it
      if (!active) continue;
      const int64_t index = sum_index(shape, slot);
      const uint32_t flag = (word_flags >> fixed_point::flag_shift(p)) & 0xffu;
      const double value = fixed_point::finish(sums[index], flag, s);
      sums[index] = 0;
      if ((p & 3) == 0) flags[flag_word(shape, slot)] = 0;
      destination[p] = static_cast<scalar_t>(static_cast<float>(value));
    }
  }
}

void accumulate_cuda(const at::Tensor& grad, const at::Tensor& rois, const at::Tensor& argmax, const Shape& shape,
                     const Chunk& chunk, const at::Tensor& max_bits, at::Tensor& sums, at::Tensor& flags) {
  const int64_t threads = shape.num_rois * chunk.count * shape.pooled_h * shape.pooled_w;
  if (threads == 0) return;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "roi_pool_backward_cuda", [&] {
    roi_pool_kernel<scalar_t><<<grid_blocks(threads), kThreads, 0, stream>>>(
        threads, grad.const_data_ptr<scalar_t>(), rois.const_data_ptr<scalar_t>(), argmax.const_data_ptr<int32_t>(),
        shape, chunk, reinterpret_cast<const unsigned int*>(max_bits.const_data_ptr<int32_t>()),
        reinterpret_cast<unsigned long long*>(sums.data_ptr<int64_t>()),
        reinterpret_cast<unsigned int*>(flags.data_ptr<int32_t>()));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void finish_cuda(const Shape& shape, const Chunk& chunk, const at::Tensor& max_bits, at::Tensor& sums,
                 at::Tensor& flags, at::Tensor& out) {
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int64_t planes = shape.batch * chunk.count;
  const int64_t plane_size = shape.height * shape.width;
  if (planes == 0 || plane_size == 0) return;
  const dim3 grid(static_cast<unsigned int>(std::min<int64_t>((plane_size + kThreads - 1) / kThreads, 64)),
                  static_cast<unsigned int>(std::min<int64_t>(planes, 65535)));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "roi_pool_backward_cuda", [&] {
    finish_kernel<scalar_t><<<grid, kThreads, 0, stream>>>(
        shape, chunk, reinterpret_cast<const unsigned int*>(max_bits.const_data_ptr<int32_t>()),
        reinterpret_cast<long long*>(sums.data_ptr<int64_t>()), reinterpret_cast<unsigned int*>(flags.data_ptr<int32_t>()),
        out.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

at::Tensor empty_cuda(at::IntArrayRef sizes, at::ScalarType dtype, at::Device device) {
  return at::Tensor(at::detail::empty_cuda(sizes, dtype, device, std::nullopt));
}

const Launches kCudaLaunches{&fixed_point::max_finite_abs_cuda, &accumulate_cuda, &finish_cuda, &empty_cuda};

at::Tensor roi_pool_backward_cuda(const at::Tensor& grad, const at::Tensor& rois, const at::Tensor& argmax,
                                  int64_t batch_size, int64_t channels, int64_t height, int64_t width) {
  TORCH_CHECK(grad.is_cuda(), "roi_pool_backward_cuda: grad must be a CUDA tensor, got ", grad.device());
  const c10::cuda::CUDAGuard device_guard(grad.device());
  return backward_with(kCudaLaunches, grad, rois, argmax, batch_size, channels, height, width);
}

}  // namespace

TORCH_LIBRARY_IMPL(deepep_lightning, CUDA, m) {
  m.impl("roi_pool_backward", &roi_pool_backward_cuda);
}

}  // namespace deepep_lightning::roi_fixed_point
