// Deterministic CUDA kernels of deepep_lightning::deform_conv2d_grad_input and deform_conv2d_sample_grads
// (schemas, host drivers and CPU kernels: ../deform_conv2d_backward.cpp; the per-sample math:
// ../deform_conv2d_backward.h; the gather: ../roi_csr_gather.h). torchvision's deformable_col2im_kernel adds
// into grad_input with float atomicAdd; here one thread per deformable sample writes its 4
// channel-independent entries, a stable sort orders them by pixel and one thread per (pixel, group of 8
// channels) sums them in that order. The offset and mask gradients and the im2col are one thread per sample,
// summing over channels in order. Bitwise reproducible, no host sync, no data-dependent allocation
// (CUDA-graph capturable).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/EmptyTensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../deform_conv2d_backward.h"
#include "gather_launch.cuh"

namespace deepep_lightning::roi {

namespace {

template <typename scalar_t, typename T>
__global__ void deform_entries_kernel(int64_t first, int64_t count, const scalar_t* __restrict__ offset,
                                      const scalar_t* __restrict__ mask, DeformArgs args, int32_t* __restrict__ keys,
                                      int32_t* __restrict__ sources, T* __restrict__ weights) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    deform_sample_entries<scalar_t, T>(first + i, i * kCorners, offset, mask, args, keys, sources, weights);
  }
}

void deform_entries_cuda(int64_t first, int64_t count, const at::Tensor& offset, const at::Tensor& mask,
                         const DeformArgs& args, at::Tensor& keys, at::Tensor& sources, at::Tensor& weights) {
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, offset.scalar_type(), "deform_conv2d_grad_input_cuda", [&] {
    using T = at::opmath_type<scalar_t>;
    deform_entries_kernel<scalar_t, T><<<gather::grid_blocks(count), gather::kThreads, 0, stream>>>(
        first, count, offset.const_data_ptr<scalar_t>(), mask.const_data_ptr<scalar_t>(), args,
        keys.data_ptr<int32_t>(), sources.data_ptr<int32_t>(), weights.data_ptr<T>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

template <typename scalar_t, typename T>
__global__ void deform_grads_kernel(int64_t count, const scalar_t* __restrict__ input,
                                    const scalar_t* __restrict__ offset, const scalar_t* __restrict__ mask,
                                    DeformArgs args, scalar_t* columns, scalar_t* __restrict__ grad_offset,
                                    scalar_t* __restrict__ grad_mask) {
  for (int64_t s = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; s < count;
       s += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    deform_sample_grads<scalar_t, T>(s, input, offset, mask, args, columns, grad_offset, grad_mask);
  }
}

void deform_grads_cuda(const at::Tensor& input, const at::Tensor& offset, const at::Tensor& mask,
                       const DeformArgs& args, at::Tensor& columns, at::Tensor& grad_offset, at::Tensor& grad_mask) {
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int64_t count = args.offset_groups * args.kernel_h * args.kernel_w * args.batch * args.out_h * args.out_w;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "deform_conv2d_sample_grads_cuda", [&] {
    using T = at::opmath_type<scalar_t>;
    deform_grads_kernel<scalar_t, T><<<gather::grid_blocks(count), gather::kThreads, 0, stream>>>(
        count, input.const_data_ptr<scalar_t>(), offset.const_data_ptr<scalar_t>(), mask.const_data_ptr<scalar_t>(),
        args, columns.data_ptr<scalar_t>(), grad_offset.data_ptr<scalar_t>(), grad_mask.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

at::Tensor empty_cuda(at::IntArrayRef sizes, at::ScalarType dtype, at::Device device) {
  return at::Tensor(at::detail::empty_cuda(sizes, dtype, device, std::nullopt));
}

const DeformLaunches kCudaLaunches{&deform_entries_cuda, &csr_gather_cuda, &deform_grads_cuda, &empty_cuda};

at::Tensor deform_conv2d_grad_input_cuda(const at::Tensor& columns, const at::Tensor& offset, const at::Tensor& mask,
                                         int64_t height, int64_t width, int64_t kernel_h, int64_t kernel_w,
                                         int64_t stride_h, int64_t stride_w, int64_t pad_h, int64_t pad_w,
                                         int64_t dilation_h, int64_t dilation_w, int64_t offset_groups,
                                         bool use_mask) {
  TORCH_CHECK(columns.is_cuda(), "deform_conv2d_grad_input_cuda: columns must be a CUDA tensor, got ",
              columns.device());
  const c10::cuda::CUDAGuard device_guard(columns.device());
  return deform_conv2d_grad_input_with(kCudaLaunches, columns, offset, mask, height, width, kernel_h, kernel_w,
                                       stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w, offset_groups,
                                       use_mask);
}

std::tuple<at::Tensor, at::Tensor> deform_conv2d_sample_grads_cuda(at::Tensor& columns, const at::Tensor& input,
                                                                   const at::Tensor& offset, const at::Tensor& mask,
                                                                   int64_t kernel_h, int64_t kernel_w,
                                                                   int64_t stride_h, int64_t stride_w, int64_t pad_h,
                                                                   int64_t pad_w, int64_t dilation_h,
                                                                   int64_t dilation_w, int64_t offset_groups,
                                                                   bool use_mask) {
  TORCH_CHECK(columns.is_cuda(), "deform_conv2d_sample_grads_cuda: columns must be a CUDA tensor, got ",
              columns.device());
  const c10::cuda::CUDAGuard device_guard(columns.device());
  return deform_conv2d_sample_grads_with(kCudaLaunches, columns, input, offset, mask, kernel_h, kernel_w, stride_h,
                                         stride_w, pad_h, pad_w, dilation_h, dilation_w, offset_groups, use_mask);
}

}  // namespace

TORCH_LIBRARY_IMPL(deepep_lightning, CUDA, m) {
  m.impl("deform_conv2d_grad_input", &deform_conv2d_grad_input_cuda);
  m.impl("deform_conv2d_sample_grads", &deform_conv2d_sample_grads_cuda);
}

}  // namespace deepep_lightning::roi
