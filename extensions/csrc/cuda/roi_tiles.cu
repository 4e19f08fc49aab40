// CUDA kernel of deepep_lightning::roi_pool_backward, ps_roi_pool_backward and ps_roi_align_backward (schemas,
// checks and CPU loops: ../roi_tiles.cpp; the per-thread math: ../roi_tiles.h).
//
// torchvision's kernels add each bin's terms into a zeroed grad_input with float atomicAdd: the order of the
// additions, and so the last bits, change from run to run, and all three refuse deterministic mode. Here a block of
// kTilePixels threads owns an item (a tile of one plane, up to kChannels channels), a pixel a thread. Per
// step of kTilePixels RoIs each thread looks at one RoI; those that reach the tile are compacted into shared
// memory in RoI order (a ballot per warp, the warps' counts in order); then every thread adds the listed
// RoIs' terms to its sums. After the last step each thread stores its channels' outputs (a warp stores a tile
// row: coalesced). Every grad_input element is written once, zeros included.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/EmptyTensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../roi_tiles.h"
#include "gather_launch.cuh"

namespace deepep_lightning::roi_tiles {

namespace {

constexpr int kWarps = kTilePixels / 32;

template <typename OpT, typename scalar_t, typename T>
__global__ void __launch_bounds__(kTilePixels)
    tiles_kernel(OpT op, Shape s, int64_t items, scalar_t* __restrict__ out) {
  using Box = typename OpT::Box;
  __shared__ Box list[kTilePixels];
  __shared__ int warp_counts[kWarps];
  const int t = threadIdx.x;
  const int lane = t & 31;
  const int warp = t >> 5;
  for (int64_t i = blockIdx.x; i < items; i += gridDim.x) {
    const Item item = item_of(i, s);
    const int channels = channels_of(item, s);
    const int h = item.row0 + t / kTileCols;
    const int w = item.col0 + t % kTileCols;
    const bool mine = h < s.height && w < s.width;
    T sum[kChannels];
#pragma unroll
    for (int k = 0; k < kChannels; ++k) sum[k] = static_cast<T>(0);
    for (int64_t first = 0; first < s.num_rois; first += kTilePixels) {
      Box box;
      const bool listed = first + t < s.num_rois && op.make(first + t, s, item, &box);
      const unsigned int ballot = __ballot_sync(0xffffffffu, listed);
      if (lane == 0) warp_counts[warp] = __popc(ballot);
      __syncthreads();
      int before = 0;
      int count = 0;
#pragma unroll
      for (int v = 0; v < kWarps; ++v) {
        before += v < warp ? warp_counts[v] : 0;
        count += warp_counts[v];
      }
      if (listed) list[before + __popc(ballot & ((1u << lane) - 1u))] = box;
      __syncthreads();
      if (mine && count > 0) op.pixel(h, w, list, count, s, item, channels, sum);
      __syncthreads();  // the list and the counts are read before the next step writes them
    }
    if (mine) {
#pragma unroll
      for (int k = 0; k < kChannels; ++k) {
        if (k < channels) out[out_index(s, item, k, h, w)] = static_cast<scalar_t>(sum[k]);
      }
    }
  }
}

template <typename OpT, typename scalar_t>
void launch(const OpT& op, const Shape& shape, int64_t items, at::Tensor& out) {
  tiles_kernel<OpT, scalar_t, at::opmath_type<scalar_t>>
      <<<gather::grid_blocks(items * kTilePixels), kTilePixels, 0, at::cuda::getCurrentCUDAStream()>>>(
          op, shape, items, out.data_ptr<scalar_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void tiles_cuda(Op op, const at::Tensor& grad, const at::Tensor& rois, const at::Tensor& argmax, const Shape& shape,
                at::Tensor& out) {
  const int64_t items = item_count(shape);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "roi_tiles_cuda", [&] {
    using T = at::opmath_type<scalar_t>;
    const scalar_t* grad_data = grad.const_data_ptr<scalar_t>();
    const scalar_t* roi_data = rois.const_data_ptr<scalar_t>();
    if (op == Op::kRoiPool) {
      const RoiPoolOp<scalar_t, T> pool{grad_data, roi_data, argmax.const_data_ptr<int32_t>()};
      launch<RoiPoolOp<scalar_t, T>, scalar_t>(pool, shape, items, out);
    } else if (op == Op::kPsRoiPool) {
      launch<PsRoiPoolOp<scalar_t, T>, scalar_t>({grad_data, roi_data}, shape, items, out);
    } else {
      launch<PsRoiAlignOp<scalar_t, T>, scalar_t>({grad_data, roi_data}, shape, items, out);
    }
  });
}

at::Tensor empty_cuda(at::IntArrayRef sizes, at::ScalarType dtype, at::Device device) {
  return at::Tensor(at::detail::empty_cuda(sizes, dtype, device, std::nullopt));
}

const Launches kCudaLaunches{&tiles_cuda, &empty_cuda};

at::Tensor roi_pool_backward_cuda(const at::Tensor& grad, const at::Tensor& rois, const at::Tensor& argmax,
                                  double spatial_scale, int64_t batch_size, int64_t channels, int64_t height,
                                  int64_t width) {
  TORCH_CHECK(grad.is_cuda(), "roi_pool_backward_cuda: grad must be a CUDA tensor, got ", grad.device());
  const c10::cuda::CUDAGuard device_guard(grad.device());
  return backward_with(kCudaLaunches, Op::kRoiPool, grad, rois, argmax, spatial_scale, pooled_size(grad, 2),
                       pooled_size(grad, 3), 0, batch_size, channels, height, width);
}

at::Tensor ps_roi_pool_backward_cuda(const at::Tensor& grad, const at::Tensor& rois, double spatial_scale,
                                     int64_t pooled_height, int64_t pooled_width, int64_t batch_size,
                                     int64_t channels, int64_t height, int64_t width) {
  TORCH_CHECK(grad.is_cuda(), "ps_roi_pool_backward_cuda: grad must be a CUDA tensor, got ", grad.device());
  const c10::cuda::CUDAGuard device_guard(grad.device());
  return backward_with(kCudaLaunches, Op::kPsRoiPool, grad, rois, at::Tensor(), spatial_scale, pooled_height,
                       pooled_width, 0, batch_size, channels, height, width);
}

at::Tensor ps_roi_align_backward_cuda(const at::Tensor& grad, const at::Tensor& rois,
                                      const at::Tensor& channel_mapping, double spatial_scale, int64_t pooled_height,
                                      int64_t pooled_width, int64_t sampling_ratio, int64_t batch_size,
                                      int64_t channels, int64_t height, int64_t width) {
  TORCH_CHECK(grad.is_cuda(), "ps_roi_align_backward_cuda: grad must be a CUDA tensor, got ", grad.device());
  const c10::cuda::CUDAGuard device_guard(grad.device());
  return backward_with(kCudaLaunches, Op::kPsRoiAlign, grad, rois, at::Tensor(), spatial_scale, pooled_height,
                       pooled_width, sampling_ratio, batch_size, channels, height, width);
}

}  // namespace

TORCH_LIBRARY_IMPL(deepep_lightning, CUDA, m) {
  m.impl("roi_pool_backward", &roi_pool_backward_cuda);
  m.impl("ps_roi_pool_backward", &ps_roi_pool_backward_cuda);
  m.impl("ps_roi_align_backward", &ps_roi_align_backward_cuda);
}

}  // namespace deepep_lightning::roi_tiles
