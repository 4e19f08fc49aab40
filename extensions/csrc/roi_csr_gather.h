// The deterministic backward of torchvision's RoI ops as a channel-independent sparse map and one gather.
//
// roi_align's backward scatters, for every RoI r, bin (ph, pw) and sample of the bin, grad[r, c, ph, pw] *
// w / count into the 4 pixels around the sample, in every channel c. Which pixels a sample touches and with
// which bilinear weight depend on the RoI box alone, never on c. So:
//   1. one thread per sample writes its 4 entries: key = destination pixel (n * H + y) * W + x (the
//      sentinel D = N * H * W when torchvision skips the corner), source = r * PH * PW + ph * PW + pw,
//      weight = w / count (torchvision's bilinear_interpolate_gradient, its formulas and their order);
//   2. a stable sort of the keys (entry order kept among equal keys) groups the entries of each pixel;
//   3. a binary search per pixel gives its segment [start, end) of the sorted entries (CSR offsets);
//   4. one thread per (pixel, group of kGroup channels) sums weight * grad[source, c] over its segment in
//      sorted order, in the op's accumulate type, and writes each grad_input element once.
// Entries cost a few bytes per sample corner (not per channel), and step 4 does the atomic kernel's
// multiply-adds. The sum of each grad_input element runs in an order fixed by the RoIs alone, whatever
// the launch configuration: bitwise reproducible, no float atomics. The CPU kernel runs the same
// per-thread functions (roi_sample_entries, csr_gather_group) in loops, so CPU tests check the CUDA math.
//
// Generic layout of the gather: destination d = (n * B + b) * HW + p writes out[((n * C + c) * B + b) * HW
// + p] (or, plane-major, out[((n * B + b) * C + c) * HW + p]) from grad[(source / bins) * C * bins + c *
// bins + source % bins]; roi_align has B = 1, deform_conv2d B = offset groups, plane-major.
#pragma once

#include <c10/macros/Macros.h>

#include <math.h>

#include <cstdint>
#include <type_traits>

namespace deepep_lightning::roi {

// Entries per sample: the 4 bilinear corners (w1..w4 of torchvision: (y_low, x_low), (y_low, x_high),
// (y_high, x_low), (y_high, x_high)).
constexpr int kCorners = 4;
// Channels per gather thread: the entry reads of a segment serve kGroup channels.
constexpr int kGroup = 8;

// a * b rounded on its own: nvcc contracts a * b + c into one fused multiply-add (one rounding), which the CPU
// build (-ffp-contract=off) and torchvision's CPU kernel do not, so a product that feeds a sum is rounded here
// to keep the CPU's bits on CUDA.
template <typename T>
C10_HOST_DEVICE inline T product(T a, T b) {
#if defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<T, float>) {
    return __fmul_rn(a, b);
  } else if constexpr (std::is_same_v<T, double>) {
    return __dmul_rn(a, b);
  } else {
    return a * b;
  }
#else
  return a * b;
#endif
}

// One RoI's geometry, torchvision's roi_align formulas in the accumulate type T.
template <typename T>
struct RoiBox {
  int64_t batch;
  T start_h, start_w, bin_h, bin_w;
  int64_t grid_h, grid_w;  // samples per bin along y and x (0 when torchvision's loops run no sample)
  T count;                 // torchvision's divisor, grid_h * grid_w
};

template <typename scalar_t, typename T>
C10_HOST_DEVICE inline RoiBox<T> roi_align_box(const scalar_t* roi, T spatial_scale, int64_t pooled_h,
                                               int64_t pooled_w, int64_t sampling_ratio, bool aligned) {
  RoiBox<T> box;
  box.batch = static_cast<int64_t>(static_cast<T>(roi[0]));
  const T offset = aligned ? static_cast<T>(0.5) : static_cast<T>(0);
  const T start_w = product(static_cast<T>(roi[1]), spatial_scale) - offset;
  const T start_h = product(static_cast<T>(roi[2]), spatial_scale) - offset;
  const T end_w = product(static_cast<T>(roi[3]), spatial_scale) - offset;
  const T end_h = product(static_cast<T>(roi[4]), spatial_scale) - offset;
  T roi_w = end_w - start_w;
  T roi_h = end_h - start_h;
  if (!aligned) {  // torchvision forces malformed RoIs to be 1 x 1
    roi_w = roi_w > static_cast<T>(1) ? roi_w : static_cast<T>(1);
    roi_h = roi_h > static_cast<T>(1) ? roi_h : static_cast<T>(1);
  }
  box.start_h = start_h;
  box.start_w = start_w;
  box.bin_h = roi_h / static_cast<T>(pooled_h);
  box.bin_w = roi_w / static_cast<T>(pooled_w);
  int64_t grid_h = sampling_ratio;
  int64_t grid_w = sampling_ratio;
  if (sampling_ratio <= 0) {
    const T ceil_h = ceil(roi_h / static_cast<T>(pooled_h));
    const T ceil_w = ceil(roi_w / static_cast<T>(pooled_w));
    // NaN or negative (aligned, inverted box): torchvision's loops run no sample
    grid_h = ceil_h >= static_cast<T>(1) ? static_cast<int64_t>(ceil_h) : 0;
    grid_w = ceil_w >= static_cast<T>(1) ? static_cast<int64_t>(ceil_w) : 0;
  }
  box.grid_h = grid_h;
  box.grid_w = grid_w;
  box.count = static_cast<T>(grid_h * grid_w);
  return box;
}

// The 4 corners of a sample at (y, x): torchvision's bilinear_interpolate_gradient; false when it skips the
// sample (outside [-1, H] x [-1, W], NaN included).
template <typename T>
C10_HOST_DEVICE inline bool bilinear_corners(int64_t height, int64_t width, T y, T x, T (&w)[kCorners],
                                             int64_t (&pixel)[kCorners]) {
  if (!(y >= static_cast<T>(-1) && y <= static_cast<T>(height) && x >= static_cast<T>(-1) &&
        x <= static_cast<T>(width))) {
    return false;
  }
  if (y <= 0) y = 0;
  if (x <= 0) x = 0;
  int64_t y_low = static_cast<int64_t>(y);
  int64_t x_low = static_cast<int64_t>(x);
  int64_t y_high;
  int64_t x_high;
  if (y_low >= height - 1) {
    y_high = y_low = height - 1;
    y = static_cast<T>(y_low);
  } else {
    y_high = y_low + 1;
  }
  if (x_low >= width - 1) {
    x_high = x_low = width - 1;
    x = static_cast<T>(x_low);
  } else {
    x_high = x_low + 1;
  }
  const T ly = y - static_cast<T>(y_low);
  const T lx = x - static_cast<T>(x_low);
  const T hy = static_cast<T>(1) - ly;
  const T hx = static_cast<T>(1) - lx;
  w[0] = hy * hx;
  w[1] = hy * lx;
  w[2] = ly * hx;
  w[3] = ly * lx;
  pixel[0] = y_low * width + x_low;
  pixel[1] = y_low * width + x_high;
  pixel[2] = y_high * width + x_low;
  pixel[3] = y_high * width + x_high;
  return true;
}

// Sample (iy, ix) of bin (ph, pw): torchvision's y = start + ph * bin + (iy + .5) * bin / grid, and x alike.
template <typename T>
C10_HOST_DEVICE inline void sample_point(const RoiBox<T>& box, int64_t ph, int64_t pw, int64_t iy, int64_t ix, T* y,
                                         T* x) {
  *y = box.start_h + product(static_cast<T>(ph), box.bin_h) +
       static_cast<T>(static_cast<float>(iy) + .5f) * box.bin_h / static_cast<T>(box.grid_h);
  *x = box.start_w + product(static_cast<T>(pw), box.bin_w) +
       static_cast<T>(static_cast<float>(ix) + .5f) * box.bin_w / static_cast<T>(box.grid_w);
}

// Index of the RoI that holds global sample s: sample_offsets is the exclusive prefix sum [R + 1] of the
// samples per RoI (adaptive sampling); with a fixed sampling ratio every RoI has samples_per_roi.
C10_HOST_DEVICE inline int64_t roi_of_sample(int64_t s, const int64_t* sample_offsets, int64_t num_rois,
                                             int64_t samples_per_roi) {
  if (samples_per_roi > 0) return s / samples_per_roi;
  int64_t low = 0;  // the last r with sample_offsets[r] <= s (RoIs without samples are skipped)
  int64_t high = num_rois - 1;
  while (low < high) {
    const int64_t mid = (low + high + 1) / 2;
    if (sample_offsets[mid] <= s) {
      low = mid;
    } else {
      high = mid - 1;
    }
  }
  return low;
}

struct RoiAlignArgs {
  int64_t num_rois, height, width, pooled_h, pooled_w, sampling_ratio, samples_per_roi;
  int64_t num_destinations;  // D = N * H * W: the sentinel key
  bool aligned;
};

// Step 1 for global sample s, written at entry slot e0 .. e0 + 3 of its chunk.
template <typename scalar_t, typename T>
C10_HOST_DEVICE inline void roi_align_sample_entries(int64_t s, int64_t e0, const scalar_t* rois,
                                                     const int64_t* sample_offsets, T spatial_scale,
                                                     const RoiAlignArgs& a, int32_t* keys, int32_t* sources,
                                                     T* weights) {
  const int64_t r = roi_of_sample(s, sample_offsets, a.num_rois, a.samples_per_roi);
  const RoiBox<T> box = roi_align_box<scalar_t, T>(rois + r * 5, spatial_scale, a.pooled_h, a.pooled_w,
                                                   a.sampling_ratio, a.aligned);
  const int64_t first = a.samples_per_roi > 0 ? r * a.samples_per_roi : sample_offsets[r];
  const int64_t per_bin = box.grid_h * box.grid_w;
  const int64_t local = s - first;
  const int64_t bin = local / per_bin;
  const int64_t within = local - bin * per_bin;
  const int64_t iy = within / box.grid_w;
  const int64_t ix = within - iy * box.grid_w;
  const int64_t ph = bin / a.pooled_w;
  const int64_t pw = bin - ph * a.pooled_w;
  T y;
  T x;
  sample_point(box, ph, pw, iy, ix, &y, &x);
  T w[kCorners];
  int64_t pixel[kCorners];
  const bool inside = bilinear_corners<T>(a.height, a.width, y, x, w, pixel);
  const int64_t plane = box.batch * a.height * a.width;
  const int32_t source = static_cast<int32_t>(r * a.pooled_h * a.pooled_w + bin);
  for (int k = 0; k < kCorners; ++k) {
    keys[e0 + k] = static_cast<int32_t>(inside ? plane + pixel[k] : a.num_destinations);
    sources[e0 + k] = source;
    weights[e0 + k] = inside ? w[k] / box.count : static_cast<T>(0);
  }
}

struct GatherArgs {
  int64_t batch, groups_per_plane, channels, planes_per_image, plane_size, bins;
  bool accumulate;   // add to out (a later chunk of entries) instead of overwriting it
  bool plane_major;  // out channel b * channels + c (deform_conv2d's offset groups), else c * planes + b
};

// Step 4 for thread t: destination plane position p, plane b, image n, channels c0 .. c0 + kGroup - 1.
template <typename scalar_t, typename T>
C10_HOST_DEVICE inline void csr_gather_group(int64_t t, const int64_t* offsets, const int64_t* order,
                                             const int32_t* sources, const T* weights, const scalar_t* grad,
                                             const GatherArgs& a, scalar_t* out) {
  const int64_t p = t % a.plane_size;
  int64_t rest = t / a.plane_size;
  const int64_t b = rest % a.planes_per_image;
  rest /= a.planes_per_image;
  const int64_t group = rest % a.groups_per_plane;
  const int64_t n = rest / a.groups_per_plane;
  const int64_t c0 = group * kGroup;
  const int channels_here = static_cast<int>(a.channels - c0 < kGroup ? a.channels - c0 : kGroup);
  const int64_t d = (n * a.planes_per_image + b) * a.plane_size + p;
  T sum[kGroup];
  for (int k = 0; k < kGroup; ++k) sum[k] = static_cast<T>(0);
  const int64_t end = offsets[d + 1];
  for (int64_t e = offsets[d]; e < end; ++e) {
    const int64_t entry = order[e];
    const int64_t source = sources[entry];
    const T weight = weights[entry];
    const int64_t roi = source / a.bins;
    const scalar_t* row = grad + (roi * a.channels + c0) * a.bins + (source - roi * a.bins);
    for (int k = 0; k < kGroup; ++k) {
      if (k < channels_here) sum[k] += weight * static_cast<T>(row[k * a.bins]);
    }
  }
  scalar_t* target = a.plane_major ? out + ((n * a.planes_per_image + b) * a.channels + c0) * a.plane_size + p
                                   : out + ((n * a.channels + c0) * a.planes_per_image + b) * a.plane_size + p;
  const int64_t channel_stride = a.plane_major ? a.plane_size : a.planes_per_image * a.plane_size;
  for (int k = 0; k < kGroup; ++k) {
    if (k < channels_here) {
      scalar_t* slot = target + k * channel_stride;
      *slot = a.accumulate ? static_cast<scalar_t>(static_cast<T>(*slot) + sum[k]) : static_cast<scalar_t>(sum[k]);
    }
  }
}

}  // namespace deepep_lightning::roi
