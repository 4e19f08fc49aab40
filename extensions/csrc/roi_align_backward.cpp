// deepep_lightning::roi_align_backward: torchvision::_roi_align_backward (same schema, same result up to the order
// of the additions), deterministic on every device.
//
//   roi_align_backward(grad [K, C, PH, PW], rois [K, 5], spatial_scale, pooled_height, pooled_width,
//                      batch_size, channels, height, width, sampling_ratio, aligned) -> [N, C, H, W]
//
// torchvision's CUDA kernel adds grad * w / count into grad_input with float atomicAdd (run-to-run
// different last bits; it refuses deterministic mode). Here the sparse map from samples to pixels is built
// once for all channels and gathered in a fixed order (roi_csr_gather.h). The entries of a chunk cost about
// 40 bytes per sample corner; with adaptive sampling (sampling_ratio <= 0) a large RoI has many samples, so
// the samples are processed in chunks of at most max(2^18, |grad_input| / 800 bytes) samples (entries of
// at most a fifth of grad_input, or 40 MiB), each chunk's sums added to grad_input in chunk order. The
// adaptive case reads the total sample count on the host (one sync); a fixed sampling ratio needs none.
// The CPU kernel runs the same per-thread functions in loops (torchvision's CPU kernel is deterministic
// already; this one exists so that CPU tests check the CUDA math).
//
// Arguments are validated in Python before this op runs (DESIGN.md section 7); the checks here guard
// direct torch.ops callers.
#include "roi_align_backward.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <torch/library.h>

#include <algorithm>

namespace deepep_lightning::roi {

namespace {

constexpr int64_t kMinChunkSamples = int64_t{1} << 18;
constexpr int64_t kBytesPerSample = 800;  // 4 entries of ~40 bytes, against a fifth of grad_input

int64_t max_chunk_samples(int64_t grad_input_bytes) {
  return std::max(kMinChunkSamples, grad_input_bytes / kBytesPerSample);
}

at::ScalarType weight_dtype(at::ScalarType dtype) { return dtype == at::kDouble ? at::kDouble : at::kFloat; }

}  // namespace

namespace {

void check_roi_align_backward_args(const at::Tensor& grad, const at::Tensor& rois, int64_t pooled_height,
                                   int64_t pooled_width, int64_t batch_size, int64_t channels, int64_t height,
                                   int64_t width) {
  const char* op = "roi_align_backward";
  TORCH_CHECK(grad.dim() == 4, op, ": grad must be 4-D [K, C, PH, PW], got shape ", grad.sizes());
  TORCH_CHECK(rois.dim() == 2 && rois.size(1) == 5 && rois.size(0) == grad.size(0), op,
              ": rois must be [K, 5] with K = ", grad.size(0), ", got shape ", rois.sizes());
  TORCH_CHECK(at::isFloatingType(grad.scalar_type()) && rois.scalar_type() == grad.scalar_type(), op,
              ": grad and rois must have one floating dtype, got ", grad.scalar_type(), " and ", rois.scalar_type());
  TORCH_CHECK(rois.device() == grad.device(), op, ": rois must be on grad's device ", grad.device(), ", got ",
              rois.device());
  TORCH_CHECK(pooled_height > 0 && pooled_width > 0 && grad.size(2) == pooled_height && grad.size(3) == pooled_width,
              op, ": pooled_height, pooled_width must be positive and match grad's shape ", grad.sizes(), ", got ",
              pooled_height, ", ", pooled_width);
  TORCH_CHECK(batch_size >= 0 && height >= 0 && width >= 0 && channels == grad.size(1), op,
              ": batch_size, height, width must be >= 0 and channels = ", grad.size(1), ", got ", batch_size, ", ",
              channels, ", ", height, ", ", width);
  TORCH_CHECK(batch_size * height * width < INT32_MAX && grad.size(0) * pooled_height * pooled_width < INT32_MAX, op,
              ": batch_size * height * width and K * PH * PW must be below 2^31 - 1");
}

}  // namespace

at::Tensor roi_align_backward_with(const RoiAlignLaunches& launches, const at::Tensor& grad, const at::Tensor& rois,
                                   double spatial_scale, int64_t pooled_height, int64_t pooled_width,
                                   int64_t batch_size, int64_t channels, int64_t height, int64_t width,
                                   int64_t sampling_ratio, bool aligned) {
  check_roi_align_backward_args(grad, rois, pooled_height, pooled_width, batch_size, channels, height, width);
  const at::Device device = grad.device();
  const int64_t num_rois = rois.size(0);
  const int64_t destinations = batch_size * height * width;
  at::Tensor out = launches.empty({batch_size, channels, height, width}, grad.scalar_type(), device);
  const at::Tensor grad_c = grad.contiguous();
  const at::Tensor rois_c = rois.contiguous();
  RoiAlignArgs args{num_rois,       height,       width,  pooled_height, pooled_width,
                    sampling_ratio, /*samples_per_roi=*/0, destinations, aligned};
  at::Tensor sample_offsets;
  int64_t total = 0;
  if (sampling_ratio > 0) {
    args.samples_per_roi = pooled_height * pooled_width * sampling_ratio * sampling_ratio;
    total = num_rois * args.samples_per_roi;
  } else if (num_rois > 0) {
    sample_offsets = at::zeros({num_rois + 1}, at::TensorOptions().dtype(at::kLong).device(device));
    launches.sample_counts(rois_c, spatial_scale, args, sample_offsets);
    sample_offsets.cumsum_(0);
    total = sample_offsets[num_rois].item<int64_t>();  // host sync: the adaptive sample count is data
  }
  if (total == 0 || channels == 0 || destinations == 0) return out.zero_();
  const int64_t chunk = max_chunk_samples(out.numel() * static_cast<int64_t>(out.element_size()));
  const GatherArgs gather_args{batch_size,     (channels + kGroup - 1) / kGroup, channels, /*planes_per_image=*/1,
                               height * width, pooled_height * pooled_width,     /*accumulate=*/false,
                               /*plane_major=*/false};
  for (int64_t first = 0; first < total; first += chunk) {
    const int64_t count = std::min(chunk, total - first);
    at::Tensor keys = launches.empty({count * kCorners}, at::kInt, device);
    at::Tensor sources = launches.empty({count * kCorners}, at::kInt, device);
    at::Tensor weights = launches.empty({count * kCorners}, weight_dtype(grad.scalar_type()), device);
    launches.entries(first, count, rois_c, sample_offsets, spatial_scale, args, keys, sources, weights);
    GatherArgs chunk_args = gather_args;
    chunk_args.accumulate = first > 0;
    sort_and_gather(keys, sources, weights, destinations, grad_c, chunk_args, launches.gather, out);
  }
  return out;
}

void sort_and_gather(const at::Tensor& keys, const at::Tensor& sources, const at::Tensor& weights,
                     int64_t destinations, const at::Tensor& grad, const GatherArgs& args, GatherLaunch gather,
                     at::Tensor& out) {
  const auto [sorted, order] = keys.sort(/*stable=*/true, /*dim=*/0, /*descending=*/false);
  const at::Tensor positions =
      at::arange(destinations + 1, at::TensorOptions().dtype(at::kInt).device(keys.device()));
  const at::Tensor offsets = at::searchsorted(sorted, positions);
  gather(offsets, order, sources, weights, grad, args, out);
}

void csr_gather_cpu(const at::Tensor& offsets, const at::Tensor& order, const at::Tensor& sources,
                    const at::Tensor& weights, const at::Tensor& grad, const GatherArgs& args, at::Tensor& out) {
  const int64_t threads = args.batch * args.groups_per_plane * args.planes_per_image * args.plane_size;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "csr_gather_cpu", [&] {
    using T = at::opmath_type<scalar_t>;
    for (int64_t t = 0; t < threads; ++t) {
      csr_gather_group<scalar_t, T>(t, offsets.const_data_ptr<int64_t>(), order.const_data_ptr<int64_t>(),
                                    sources.const_data_ptr<int32_t>(), weights.const_data_ptr<T>(),
                                    grad.const_data_ptr<scalar_t>(), args, out.data_ptr<scalar_t>());
    }
  });
}

namespace {

void sample_counts_cpu(const at::Tensor& rois, double spatial_scale, const RoiAlignArgs& args,
                       at::Tensor& sample_offsets) {
  int64_t* counts = sample_offsets.data_ptr<int64_t>() + 1;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, rois.scalar_type(), "roi_align_backward_cpu", [&] {
    using T = at::opmath_type<scalar_t>;
    const scalar_t* data = rois.const_data_ptr<scalar_t>();
    for (int64_t r = 0; r < args.num_rois; ++r) {
      const RoiBox<T> box = roi_align_box<scalar_t, T>(data + r * 5, static_cast<T>(spatial_scale), args.pooled_h,
                                                       args.pooled_w, args.sampling_ratio, args.aligned);
      counts[r] = args.pooled_h * args.pooled_w * box.grid_h * box.grid_w;
    }
  });
}

void entries_cpu(int64_t first, int64_t count, const at::Tensor& rois, const at::Tensor& sample_offsets,
                 double spatial_scale, const RoiAlignArgs& args, at::Tensor& keys, at::Tensor& sources,
                 at::Tensor& weights) {
  const int64_t* offsets = sample_offsets.defined() ? sample_offsets.const_data_ptr<int64_t>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, rois.scalar_type(), "roi_align_backward_cpu", [&] {
    using T = at::opmath_type<scalar_t>;
    for (int64_t i = 0; i < count; ++i) {
      roi_align_sample_entries<scalar_t, T>(first + i, i * kCorners, rois.const_data_ptr<scalar_t>(), offsets,
                                            static_cast<T>(spatial_scale), args, keys.data_ptr<int32_t>(),
                                            sources.data_ptr<int32_t>(), weights.data_ptr<T>());
    }
  });
}

at::Tensor empty_cpu(at::IntArrayRef sizes, at::ScalarType dtype, at::Device device) {
  return at::empty(sizes, at::TensorOptions().dtype(dtype).device(device));
}

at::Tensor roi_align_backward_cpu(const at::Tensor& grad, const at::Tensor& rois, double spatial_scale,
                                  int64_t pooled_height, int64_t pooled_width, int64_t batch_size, int64_t channels,
                                  int64_t height, int64_t width, int64_t sampling_ratio, bool aligned) {
  TORCH_CHECK(grad.is_cpu(), "roi_align_backward_cpu: grad must be a CPU tensor, got ", grad.device());
  static const RoiAlignLaunches launches{&sample_counts_cpu, &entries_cpu, &csr_gather_cpu, &empty_cpu};
  return roi_align_backward_with(launches, grad, rois, spatial_scale, pooled_height, pooled_width, batch_size,
                                 channels, height, width, sampling_ratio, aligned);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(deepep_lightning, m) {
  m.def(
      "roi_align_backward(Tensor grad, Tensor rois, float spatial_scale, int pooled_height, int pooled_width, "
      "int batch_size, int channels, int height, int width, int sampling_ratio, bool aligned) -> Tensor");
}

TORCH_LIBRARY_IMPL(deepep_lightning, CPU, m) {
  m.impl("roi_align_backward", &roi_align_backward_cpu);
}

}  // namespace deepep_lightning::roi
