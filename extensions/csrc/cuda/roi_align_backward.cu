// Deterministic CUDA kernels of deepep_lightning::roi_align_backward (schema, host driver and CPU kernels:
// ../roi_align_backward.cpp; the per-thread math: ../roi_csr_gather.h).
//
// torchvision's roi_align_backward_kernel adds into grad_input with float atomicAdd, so the last bits
// change from run to run and it refuses deterministic mode. Here one thread per sample writes its 4
// (pixel, bin, weight) entries, a stable sort orders them by pixel, and one thread per (pixel, group of 8
// channels) sums its pixel's entries in sorted order and writes each grad_input element once. The order of
// every sum is a function of the RoIs alone, so the result is bitwise reproducible whatever the launch
// configuration. With a fixed sampling ratio nothing synchronises the host and no allocation size depends
// on data (CUDA-graph capturable); adaptive sampling reads its sample count on the host.
//
// Outputs and scratch come from at::detail::empty_cuda: at::empty NaN-fills new memory in deterministic
// mode, and every byte here is written before it is read.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/EmptyTensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../roi_align_backward.h"
#include "gather_launch.cuh"

namespace deepep_lightning::roi {

namespace {

template <typename scalar_t, typename T>
__global__ void sample_counts_kernel(const scalar_t* __restrict__ rois, T spatial_scale, RoiAlignArgs args,
                                     int64_t* __restrict__ counts) {
  for (int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; r < args.num_rois;
       r += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const RoiBox<T> box = roi_align_box<scalar_t, T>(rois + r * 5, spatial_scale, args.pooled_h, args.pooled_w,
                                                     args.sampling_ratio, args.aligned);
    counts[r] = args.pooled_h * args.pooled_w * box.grid_h * box.grid_w;
  }
}

template <typename scalar_t, typename T>
__global__ void entries_kernel(int64_t first, int64_t count, const scalar_t* __restrict__ rois,
                               const int64_t* __restrict__ sample_offsets, T spatial_scale, RoiAlignArgs args,
                               int32_t* __restrict__ keys, int32_t* __restrict__ sources, T* __restrict__ weights) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    roi_align_sample_entries<scalar_t, T>(first + i, i * kCorners, rois, sample_offsets, spatial_scale, args, keys,
                                          sources, weights);
  }
}

template <typename scalar_t, typename T>
__global__ void gather_kernel(int64_t threads, const int64_t* __restrict__ offsets, const int64_t* __restrict__ order,
                              const int32_t* __restrict__ sources, const T* __restrict__ weights,
                              const scalar_t* __restrict__ grad, GatherArgs args, scalar_t* __restrict__ out) {
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < threads;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    csr_gather_group<scalar_t, T>(t, offsets, order, sources, weights, grad, args, out);
  }
}

void sample_counts_cuda(const at::Tensor& rois, double spatial_scale, const RoiAlignArgs& args,
                        at::Tensor& sample_offsets) {
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, rois.scalar_type(), "roi_align_backward_cuda", [&] {
    using T = at::opmath_type<scalar_t>;
    sample_counts_kernel<scalar_t, T><<<gather::grid_blocks(args.num_rois), gather::kThreads, 0, stream>>>(
        rois.const_data_ptr<scalar_t>(), static_cast<T>(spatial_scale), args, sample_offsets.data_ptr<int64_t>() + 1);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void entries_cuda(int64_t first, int64_t count, const at::Tensor& rois, const at::Tensor& sample_offsets,
                  double spatial_scale, const RoiAlignArgs& args, at::Tensor& keys, at::Tensor& sources,
                  at::Tensor& weights) {
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int64_t* offsets = sample_offsets.defined() ? sample_offsets.const_data_ptr<int64_t>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, rois.scalar_type(), "roi_align_backward_cuda", [&] {
    using T = at::opmath_type<scalar_t>;
    entries_kernel<scalar_t, T><<<gather::grid_blocks(count), gather::kThreads, 0, stream>>>(
        first, count, rois.const_data_ptr<scalar_t>(), offsets, static_cast<T>(spatial_scale), args,
        keys.data_ptr<int32_t>(), sources.data_ptr<int32_t>(), weights.data_ptr<T>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

at::Tensor empty_cuda(at::IntArrayRef sizes, at::ScalarType dtype, at::Device device) {
  return at::Tensor(at::detail::empty_cuda(sizes, dtype, device, std::nullopt));
}

at::Tensor roi_align_backward_cuda(const at::Tensor& grad, const at::Tensor& rois, double spatial_scale,
                                   int64_t pooled_height, int64_t pooled_width, int64_t batch_size, int64_t channels,
                                   int64_t height, int64_t width, int64_t sampling_ratio, bool aligned) {
  TORCH_CHECK(grad.is_cuda(), "roi_align_backward_cuda: grad must be a CUDA tensor, got ", grad.device());
  const c10::cuda::CUDAGuard device_guard(grad.device());
  static const RoiAlignLaunches launches{&sample_counts_cuda, &entries_cuda, &csr_gather_cuda, &empty_cuda};
  return roi_align_backward_with(launches, grad, rois, spatial_scale, pooled_height, pooled_width, batch_size,
                                 channels, height, width, sampling_ratio, aligned);
}

}  // namespace

void csr_gather_cuda(const at::Tensor& offsets, const at::Tensor& order, const at::Tensor& sources,
                     const at::Tensor& weights, const at::Tensor& grad, const GatherArgs& args, at::Tensor& out) {
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int64_t threads = args.batch * args.groups_per_plane * args.planes_per_image * args.plane_size;
  if (threads == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "csr_gather_cuda", [&] {
    using T = at::opmath_type<scalar_t>;
    gather_kernel<scalar_t, T><<<gather::grid_blocks(threads), gather::kThreads, 0, stream>>>(
        threads, offsets.const_data_ptr<int64_t>(), order.const_data_ptr<int64_t>(),
        sources.const_data_ptr<int32_t>(), weights.const_data_ptr<T>(), grad.const_data_ptr<scalar_t>(), args,
        out.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

TORCH_LIBRARY_IMPL(deepep_lightning, CUDA, m) {
  m.impl("roi_align_backward", &roi_align_backward_cuda);
}

}  // namespace deepep_lightning::roi
