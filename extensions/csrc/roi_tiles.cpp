// deepep_lightning::roi_pool_backward, ps_roi_pool_backward and ps_roi_align_backward: torchvision's
// _roi_pool_backward, _ps_roi_pool_backward and _ps_roi_align_backward as the tile gathers of roi_tiles.h: every
// grad_input element written once, its terms summed in torchvision's CPU order. Bitwise reproducible, the same
// bits on the CPU and CUDA, no host synchronisation and no data-dependent allocation (CUDA-graph capturable),
// float16/bfloat16/float32/float64 (16-bit terms summed in float and rounded once).
//
//   roi_pool_backward(grad [K, C, PH, PW], rois [K, 5], argmax [K, C, PH, PW] int32, spatial_scale, batch_size,
//                     channels, height, width) -> [N, C, H, W]
//   ps_roi_pool_backward(grad [K, C / (PH * PW), PH, PW], rois [K, 5], spatial_scale, pooled_height,
//                        pooled_width, batch_size, channels, height, width) -> [N, C, H, W]
//   ps_roi_align_backward(grad [K, C / (PH * PW), PH, PW], rois, channel_mapping, spatial_scale, pooled_height,
//                         pooled_width, sampling_ratio, batch_size, channels, height, width) -> [N, C, H, W]
//
// roi_pool's argmax is its forward's (a bin's maximum lies in the bin: the gather reads a bin's argmax only at
// the pixels of the bin). ps_roi_align's channel_mapping, which always holds c * PH * PW + b, is in its schema so
// that the route passes torchvision's arguments through, and is not read. This file holds the schemas, the
// checks, the host driver and the CPU loops (items in parallel: each writes its own outputs); cuda/roi_tiles.cu
// the kernel. Arguments are validated in Python before these ops run; the checks here guard direct torch.ops
// callers.
#include "roi_tiles.h"

#include <ATen/Dispatch.h>
#include <ATen/EmptyTensor.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

namespace deepep_lightning::roi_tiles {

namespace {

const char* op_name(Op op) {
  return op == Op::kRoiPool ? "roi_pool_backward" : (op == Op::kPsRoiPool ? "ps_roi_pool_backward" : "ps_roi_align_backward");
}

void check_args(Op op, const at::Tensor& grad, const at::Tensor& rois, const at::Tensor& argmax,
                int64_t pooled_height, int64_t pooled_width, int64_t batch_size, int64_t channels, int64_t height,
                int64_t width) {
  const char* name = op_name(op);
  TORCH_CHECK(grad.dim() == 4, name, ": grad must be 4-D [K, C_out, PH, PW], got shape ", grad.sizes());
  TORCH_CHECK(at::isFloatingType(grad.scalar_type()) && rois.scalar_type() == grad.scalar_type(), name,
              ": grad and rois must have one floating dtype, got ", grad.scalar_type(), " and ", rois.scalar_type());
  TORCH_CHECK(rois.dim() == 2 && rois.size(0) == grad.size(0) && rois.size(1) == 5, name,
              ": rois must be [K, 5] with K = ", grad.size(0), ", got shape ", rois.sizes());
  TORCH_CHECK(rois.device() == grad.device(), name, ": rois must be on grad's device ", grad.device(), ", got ",
              rois.device());
  TORCH_CHECK(pooled_height > 0 && pooled_width > 0 && grad.size(2) == pooled_height && grad.size(3) == pooled_width,
              name, ": pooled_height, pooled_width must be positive and match grad's shape ", grad.sizes(), ", got ",
              pooled_height, ", ", pooled_width);
  const int64_t planes = op == Op::kRoiPool ? 1 : pooled_height * pooled_width;
  TORCH_CHECK(batch_size >= 0 && height >= 0 && width >= 0 && channels == grad.size(1) * planes, name,
              ": batch_size, height, width must be >= 0 and channels = ", grad.size(1) * planes, ", got ", batch_size,
              ", ", channels, ", ", height, ", ", width);
  if (op == Op::kRoiPool) {
    TORCH_CHECK(argmax.sizes() == grad.sizes() && argmax.scalar_type() == at::kInt && argmax.device() == grad.device(),
                name, ": argmax must be int32 of grad's shape and device, got ", argmax.scalar_type(), " ",
                argmax.sizes(), " on ", argmax.device());
    TORCH_CHECK(height * width < INT32_MAX, name, ": height * width must be below 2^31 - 1 (int32 argmax)");
  }
  TORCH_CHECK(height < INT32_MAX - kTileCols && width < INT32_MAX - kTileCols, name,
              ": height and width must be below 2^31 - 33, got ", height, ", ", width);
}

template <typename OpT, typename scalar_t, typename T>
void tiles_cpu_typed(const OpT& op, const Shape& s, at::Tensor& out) {
  scalar_t* out_data = out.data_ptr<scalar_t>();
  at::parallel_for(0, item_count(s), 1, [&](int64_t begin, int64_t end) {
    std::vector<typename OpT::Box> list;
    for (int64_t i = begin; i < end; ++i) {
      const Item item = item_of(i, s);
      const int channels = channels_of(item, s);
      list.clear();
      typename OpT::Box box;
      for (int64_t r = 0; r < s.num_rois; ++r) {
        if (op.make(r, s, item, &box)) list.push_back(box);
      }
      for (int p = 0; p < kTilePixels; ++p) {
        const int h = item.row0 + p / kTileCols;
        const int w = item.col0 + p % kTileCols;
        if (h >= s.height || w >= s.width) continue;
        T sum[kChannels];
        for (int k = 0; k < kChannels; ++k) sum[k] = static_cast<T>(0);
        op.pixel(h, w, list.data(), static_cast<int>(list.size()), s, item, channels, sum);
        for (int k = 0; k < channels; ++k) out_data[out_index(s, item, k, h, w)] = static_cast<scalar_t>(sum[k]);
      }
    }
  });
}

void tiles_cpu(Op op, const at::Tensor& grad, const at::Tensor& rois, const at::Tensor& argmax, const Shape& shape,
               at::Tensor& out) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "roi_tiles_cpu", [&] {
    using T = at::opmath_type<scalar_t>;
    const scalar_t* grad_data = grad.const_data_ptr<scalar_t>();
    const scalar_t* roi_data = rois.const_data_ptr<scalar_t>();
    if (op == Op::kRoiPool) {
      const RoiPoolOp<scalar_t, T> pool{grad_data, roi_data, argmax.const_data_ptr<int32_t>()};
      tiles_cpu_typed<RoiPoolOp<scalar_t, T>, scalar_t, T>(pool, shape, out);
    } else if (op == Op::kPsRoiPool) {
      tiles_cpu_typed<PsRoiPoolOp<scalar_t, T>, scalar_t, T>({grad_data, roi_data}, shape, out);
    } else {
      tiles_cpu_typed<PsRoiAlignOp<scalar_t, T>, scalar_t, T>({grad_data, roi_data}, shape, out);
    }
  });
}

at::Tensor empty_cpu(at::IntArrayRef sizes, at::ScalarType dtype, at::Device device) {
  return at::detail::empty_cpu(sizes, dtype, /*pin_memory=*/false, std::nullopt);
}

const Launches kCpuLaunches{&tiles_cpu, &empty_cpu};

at::Tensor roi_pool_backward_cpu(const at::Tensor& grad, const at::Tensor& rois, const at::Tensor& argmax,
                                 double spatial_scale, int64_t batch_size, int64_t channels, int64_t height,
                                 int64_t width) {
  TORCH_CHECK(grad.is_cpu(), "roi_pool_backward_cpu: grad must be a CPU tensor, got ", grad.device());
  return backward_with(kCpuLaunches, Op::kRoiPool, grad, rois, argmax, spatial_scale, pooled_size(grad, 2),
                       pooled_size(grad, 3), 0, batch_size, channels, height, width);
}

at::Tensor ps_roi_pool_backward_cpu(const at::Tensor& grad, const at::Tensor& rois, double spatial_scale,
                                    int64_t pooled_height, int64_t pooled_width, int64_t batch_size, int64_t channels,
                                    int64_t height, int64_t width) {
  TORCH_CHECK(grad.is_cpu(), "ps_roi_pool_backward_cpu: grad must be a CPU tensor, got ", grad.device());
  return backward_with(kCpuLaunches, Op::kPsRoiPool, grad, rois, at::Tensor(), spatial_scale, pooled_height,
                       pooled_width, 0, batch_size, channels, height, width);
}

at::Tensor ps_roi_align_backward_cpu(const at::Tensor& grad, const at::Tensor& rois, const at::Tensor& channel_mapping,
                                     double spatial_scale, int64_t pooled_height, int64_t pooled_width,
                                     int64_t sampling_ratio, int64_t batch_size, int64_t channels, int64_t height,
                                     int64_t width) {
  TORCH_CHECK(grad.is_cpu(), "ps_roi_align_backward_cpu: grad must be a CPU tensor, got ", grad.device());
  return backward_with(kCpuLaunches, Op::kPsRoiAlign, grad, rois, at::Tensor(), spatial_scale, pooled_height,
                       pooled_width, sampling_ratio, batch_size, channels, height, width);
}

}  // namespace

at::Tensor backward_with(const Launches& launches, Op op, const at::Tensor& grad, const at::Tensor& rois,
                         const at::Tensor& argmax, double spatial_scale, int64_t pooled_height, int64_t pooled_width,
                         int64_t sampling_ratio, int64_t batch_size, int64_t channels, int64_t height, int64_t width) {
  check_args(op, grad, rois, argmax, pooled_height, pooled_width, batch_size, channels, height, width);
  const int64_t planes = op == Op::kRoiPool ? 1 : pooled_height * pooled_width;
  const Shape shape = items_for({grad.size(0), batch_size, grad.size(1), planes, height, width, pooled_height,
                                  pooled_width, sampling_ratio, spatial_scale, kChannels});
  at::Tensor out = launches.empty({batch_size, channels, height, width}, grad.scalar_type(), grad.device());
  if (item_count(shape) > 0) {
    launches.tiles(op, grad.contiguous(), rois.contiguous(), op == Op::kRoiPool ? argmax.contiguous() : argmax, shape, out);
  }
  return out;
}

TORCH_LIBRARY_FRAGMENT(deepep_lightning, m) {
  m.def(
      "roi_pool_backward(Tensor grad, Tensor rois, Tensor argmax, float spatial_scale, int batch_size, int channels, "
      "int height, int width) -> Tensor");
  m.def(
      "ps_roi_pool_backward(Tensor grad, Tensor rois, float spatial_scale, int pooled_height, int pooled_width, "
      "int batch_size, int channels, int height, int width) -> Tensor");
  m.def(
      "ps_roi_align_backward(Tensor grad, Tensor rois, Tensor channel_mapping, float spatial_scale, "
      "int pooled_height, int pooled_width, int sampling_ratio, int batch_size, int channels, int height, "
      "int width) -> Tensor");
}

TORCH_LIBRARY_IMPL(deepep_lightning, CPU, m) {
  m.impl("roi_pool_backward", &roi_pool_backward_cpu);
  m.impl("ps_roi_pool_backward", &ps_roi_pool_backward_cpu);
  m.impl("ps_roi_align_backward", &ps_roi_align_backward_cpu);
}

}  // namespace deepep_lightning::roi_tiles
