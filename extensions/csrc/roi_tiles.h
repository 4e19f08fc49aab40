// deepep_lightning::roi_pool_backward, ps_roi_pool_backward and ps_roi_align_backward as tile gathers: each
// grad_input element is written once, as a float sum of its terms in the order torchvision's CPU kernel adds
// them (RoI by RoI; within a RoI, bin by bin for roi_pool, sample by sample and corner by corner for
// ps_roi_align).
//
// grad_input is cut into planes: roi_pool's plane of image n and channel c receives grad[r, c, ph, pw] at the
// forward's argmax of every bin of every RoI of image n; the position-sensitive ops feed bin b = ph * PW + pw of
// output channel c to input channel c * PH * PW + b alone, so their plane (n, c, b) receives, at pixel (h, w),
// one term per RoI whose bin b reaches the pixel (ps_roi_pool: grad[r, c, ph, pw] / area over the bin's
// rectangle) or one per sample corner that lands on it (ps_roi_align: grad[r, c, ph, pw] * w / count). The work
// is cut into items: up to kChannels channels c of image n (and bin b), a kTileRows x kTileCols tile of pixels. An
// item looks at the RoIs in steps of kTilePixels: it lists, in RoI order, the RoIs of the step that are of image
// n and reach the tile (the op's make), then every pixel adds the listed RoIs' terms to its channels' sums (the
// op's pixel). The sums cross the steps in registers and each output element is stored once: no atomics, no
// memset, no host synchronisation (CUDA-graph capturable), and a sum's order is fixed by the RoIs alone. The CPU
// loops run the same functions item by item, so CPU tests check the CUDA math, and in float32 and float64 both
// give torchvision's CPU kernel's bits (its sums run in the same order).
#pragma once

#include <ATen/ATen.h>
#include <c10/macros/Macros.h>

#include <math.h>

#include <cstdint>
#include <type_traits>

#include "roi_csr_gather.h"

namespace deepep_lightning::roi_tiles {

constexpr int kTileRows = 8;
constexpr int kTileCols = 32;  // a warp's pixels: one row of a tile, stored coalesced
constexpr int kTilePixels = kTileRows * kTileCols;  // a CUDA block's threads (a pixel each), and RoIs per step
constexpr int kChannels = 16;  // the most channels an item sums (registers per pixel)
// Items below which an item takes fewer channels: small planes (coarse FPN levels) then still fill a GPU (a few
// blocks of each of ~130 SMs, a few waves), at the cost of listing the RoIs once per item.
constexpr int64_t kEnoughItems = 2048;

struct Shape {
  int64_t num_rois, batch, channels_out;  // channels_out: grad's channels
  int64_t planes;                         // planes a channel feeds: 1 (roi_pool) or PH * PW
  int64_t height, width, pooled_h, pooled_w, sampling_ratio;
  double spatial_scale;
  int64_t channels_per_item;  // 1 .. kChannels (items_for); the bits do not depend on it
};

// One item: channels [c0, c0 + channels_per_item) of image n, bin b (0 for roi_pool), the tile whose first pixel is
// (row0, col0).
struct Item {
  int64_t n, b, c0;
  int row0, col0;
};

C10_HOST_DEVICE inline int64_t tiles_down(const Shape& s) { return (s.height + kTileRows - 1) / kTileRows; }
C10_HOST_DEVICE inline int64_t tiles_across(const Shape& s) { return (s.width + kTileCols - 1) / kTileCols; }
C10_HOST_DEVICE inline int64_t channel_groups(const Shape& s) {
  return (s.channels_out + s.channels_per_item - 1) / s.channels_per_item;
}

C10_HOST_DEVICE inline int64_t item_count(const Shape& s) {
  return channel_groups(s) * s.batch * s.planes * tiles_down(s) * tiles_across(s);
}

// Items in [group, n, b, tile row, tile column] order: neighbouring items share a bin's RoIs.
C10_HOST_DEVICE inline Item item_of(int64_t i, const Shape& s) {
  const int64_t across = tiles_across(s);
  const int64_t tiles = tiles_down(s) * across;
  Item item;
  const int64_t tile = i % tiles;
  i /= tiles;
  item.b = i % s.planes;
  i /= s.planes;
  item.n = i % s.batch;
  item.c0 = (i / s.batch) * s.channels_per_item;
  item.row0 = static_cast<int>(tile / across) * kTileRows;
  item.col0 = static_cast<int>(tile % across) * kTileCols;
  return item;
}

C10_HOST_DEVICE inline int channels_of(const Item& item, const Shape& s) {
  const int64_t left = s.channels_out - item.c0;
  return static_cast<int>(left < s.channels_per_item ? left : s.channels_per_item);
}

// The shape with its channels per item: kChannels, halved while there are fewer than kEnoughItems items.
inline Shape items_for(Shape s) {
  s.channels_per_item = kChannels;
  while (s.channels_per_item > 1 && item_count(s) < kEnoughItems) s.channels_per_item /= 2;
  return s;
}

// Whether rows [h0, h1) x columns [w0, w1) meet the item's tile.
C10_HOST_DEVICE inline bool meets_tile(const Item& item, int h0, int h1, int w0, int w1) {
  return h0 < h1 && w0 < w1 && h0 < item.row0 + kTileRows && h1 > item.row0 && w0 < item.col0 + kTileCols &&
         w1 > item.col0;
}

C10_HOST_DEVICE inline int clip(int value, int high) { return value < 0 ? 0 : (value > high ? high : value); }

// floor and ceil of a bin edge computed in scalar_t, as torchvision's kernels take them: in double for double,
// else in float, which holds every float16/bfloat16/float32 value exactly (and keeps consumer GPUs, slow at double,
// off double arithmetic).
template <typename scalar_t>
C10_HOST_DEVICE inline int floor_int(scalar_t value) {
  if constexpr (std::is_same_v<scalar_t, double>) {
    return static_cast<int>(floor(value));
  } else {
    return static_cast<int>(floorf(static_cast<float>(value)));
  }
}
template <typename scalar_t>
C10_HOST_DEVICE inline int round_int(scalar_t value) {  // C's round: halves away from zero
  if constexpr (std::is_same_v<scalar_t, double>) {
    return static_cast<int>(round(value));
  } else {
    return static_cast<int>(roundf(static_cast<float>(value)));
  }
}
template <typename scalar_t>
C10_HOST_DEVICE inline int ceil_int(scalar_t value) {
  if constexpr (std::is_same_v<scalar_t, double>) {
    return static_cast<int>(ceil(value));
  } else {
    return static_cast<int>(ceilf(static_cast<float>(value)));
  }
}

// A listed roi_pool RoI: its box in pixels (torchvision's roi_pool geometry) and the rectangle its bins cover.
template <typename scalar_t>
struct RoiPoolBox {
  int64_t roi;
  int start_h, start_w;
  scalar_t bin_h, bin_w;
  int h0, h1, w0, w1;
};

// RoI r with torchvision's roi_pool formulas in scalar_t (round of the scaled box, extents + 1 and at least 1,
// bins [floor(ph * bin_h), ceil((ph + 1) * bin_h)) offset and clipped to [0, H]); true when it is of image item.n
// and covers pixels of the tile.
template <typename scalar_t>
C10_HOST_DEVICE inline bool make_roi_pool_box(int64_t r, const scalar_t* rois, const Shape& s, const Item& item,
                                              RoiPoolBox<scalar_t>* box) {
  const scalar_t* roi = rois + r * 5;
  if (static_cast<int64_t>(static_cast<int>(roi[0])) != item.n) return false;  // torchvision: int roi_batch_ind
  const scalar_t scale = static_cast<scalar_t>(s.spatial_scale);
  const int start_w = round_int(roi[1] * scale);
  const int start_h = round_int(roi[2] * scale);
  const int end_w = round_int(roi[3] * scale);
  const int end_h = round_int(roi[4] * scale);
  const int roi_w = end_w - start_w + 1 > 1 ? end_w - start_w + 1 : 1;
  const int roi_h = end_h - start_h + 1 > 1 ? end_h - start_h + 1 : 1;
  box->roi = r;
  box->start_h = start_h;
  box->start_w = start_w;
  box->bin_h = static_cast<scalar_t>(roi_h) / static_cast<scalar_t>(s.pooled_h);
  box->bin_w = static_cast<scalar_t>(roi_w) / static_cast<scalar_t>(s.pooled_w);
  const int height = static_cast<int>(s.height);
  const int width = static_cast<int>(s.width);
  box->h0 = clip(start_h, height);  // bin 0 starts at floor(0) = 0
  box->w0 = clip(start_w, width);
  box->h1 = clip(ceil_int(static_cast<scalar_t>(s.pooled_h) * box->bin_h) + start_h, height);
  box->w1 = clip(ceil_int(static_cast<scalar_t>(s.pooled_w) * box->bin_w) + start_w, width);
  return meets_tile(item, box->h0, box->h1, box->w0, box->w1);
}

// The first of a box's bins that can hold the pixel at offset x from the box's start along an axis: bin p ends at
// ceil((p + 1) * bin) < (p + 1) * bin + 1, so it holds x only if p > (x - 1) / bin - 1 (two more bins of margin
// for the float quotient). Bin starts never decrease, so a walk from here stops at the first bin past x.
template <typename scalar_t>
C10_HOST_DEVICE inline int first_bin(int x, scalar_t bin) {
  const float p = floorf((static_cast<float>(x) - 1.0f) / static_cast<float>(bin)) - 2.0f;
  return p > 0.0f ? static_cast<int>(p) : 0;
}

// Pixel (h, w) adds grad[roi, c, ph, pw] for every bin of every listed RoI whose argmax is the pixel, bins in
// (ph, pw) order, for the item's channels. A bin's argmax lies in the bin, so only the bins that hold the pixel
// are read.
template <typename scalar_t, typename T>
C10_HOST_DEVICE inline void roi_pool_pixel(int h, int w, const RoiPoolBox<scalar_t>* list, int count,
                                           const scalar_t* grad, const int32_t* argmax, const Shape& s,
                                           const Item& item, int channels, T (&sum)[kChannels]) {
  const int64_t bins = s.pooled_h * s.pooled_w;
  const int32_t pixel = h * static_cast<int32_t>(s.width) + w;
  const int height = static_cast<int>(s.height);
  const int width = static_cast<int>(s.width);
  for (int i = 0; i < count; ++i) {
    const RoiPoolBox<scalar_t>& box = list[i];
    if (h < box.h0 || h >= box.h1 || w < box.w0 || w >= box.w1) continue;
    const int64_t first = (box.roi * s.channels_out + item.c0) * bins;
    for (int ph = first_bin(h - box.start_h, box.bin_h); ph < s.pooled_h; ++ph) {
      if (h < clip(floor_int(static_cast<scalar_t>(ph) * box.bin_h) + box.start_h, height)) break;
      if (h >= clip(ceil_int(static_cast<scalar_t>(ph + 1) * box.bin_h) + box.start_h, height)) continue;
      for (int pw = first_bin(w - box.start_w, box.bin_w); pw < s.pooled_w; ++pw) {
        if (w < clip(floor_int(static_cast<scalar_t>(pw) * box.bin_w) + box.start_w, width)) break;
        if (w >= clip(ceil_int(static_cast<scalar_t>(pw + 1) * box.bin_w) + box.start_w, width)) continue;
        const int64_t at = first + ph * s.pooled_w + pw;
#pragma unroll
        for (int k = 0; k < kChannels; ++k) {
          if (k < channels && argmax[at + k * bins] == pixel) sum[k] += static_cast<T>(grad[at + k * bins]);
        }
      }
    }
  }
}

// A listed ps_roi_pool bin: its RoI, its rectangle [h0, h1) x [w0, w1) and its area.
template <typename scalar_t>
struct PoolBin {
  int64_t roi;
  int h0, h1, w0, w1;
  scalar_t area;
};

// Bin item.b of RoI r, torchvision's ps_roi_pool_backward_kernel_impl line by line in scalar_t (roundf, in float, of the
// scaled box, bins [floor(ph * bin_h), ceil((ph + 1) * bin_h)) offset and clipped to [0, H]); true when it is
// of image item.n and not empty and meets the tile.
template <typename scalar_t>
C10_HOST_DEVICE inline bool make_pool_bin(int64_t r, const scalar_t* rois, const Shape& s, const Item& item,
                                          PoolBin<scalar_t>* bin) {
  const scalar_t* roi = rois + r * 5;
  if (static_cast<int64_t>(static_cast<int>(roi[0])) != item.n) return false;  // torchvision: int roi_batch_ind
  const scalar_t scale = static_cast<scalar_t>(s.spatial_scale);
  const int start_w = static_cast<int>(roundf(static_cast<float>(roi[1] * scale)));
  const int start_h = static_cast<int>(roundf(static_cast<float>(roi[2] * scale)));
  const int end_w = static_cast<int>(roundf(static_cast<float>(roi[3] * scale)));
  const int end_h = static_cast<int>(roundf(static_cast<float>(roi[4] * scale)));
  const int roi_w = end_w - start_w > 1 ? end_w - start_w : 1;  // too small RoIs are 1 x 1
  const int roi_h = end_h - start_h > 1 ? end_h - start_h : 1;
  const scalar_t bin_h = static_cast<scalar_t>(roi_h) / static_cast<scalar_t>(s.pooled_h);
  const scalar_t bin_w = static_cast<scalar_t>(roi_w) / static_cast<scalar_t>(s.pooled_w);
  const int ph = static_cast<int>(item.b / s.pooled_w);
  const int pw = static_cast<int>(item.b % s.pooled_w);
  const int height = static_cast<int>(s.height);
  const int width = static_cast<int>(s.width);
  bin->roi = r;
  bin->h0 = clip(floor_int(static_cast<scalar_t>(ph) * bin_h) + start_h, height);
  bin->w0 = clip(floor_int(static_cast<scalar_t>(pw) * bin_w) + start_w, width);
  bin->h1 = clip(ceil_int(static_cast<scalar_t>(ph + 1) * bin_h) + start_h, height);
  bin->w1 = clip(ceil_int(static_cast<scalar_t>(pw + 1) * bin_w) + start_w, width);
  bin->area = static_cast<scalar_t>((bin->h1 - bin->h0) * (bin->w1 - bin->w0));
  return meets_tile(item, bin->h0, bin->h1, bin->w0, bin->w1);
}

// Pixel (h, w) adds grad[roi, c, ph, pw] / area (in scalar_t, as torchvision's kernel computes the term) of every
// listed bin whose rectangle holds it, for the item's channels.
template <typename scalar_t, typename T>
C10_HOST_DEVICE inline void pool_pixel(int h, int w, const PoolBin<scalar_t>* list, int count, const scalar_t* grad,
                                       const Shape& s, const Item& item, int channels, T (&sum)[kChannels]) {
  const int64_t bins = s.pooled_h * s.pooled_w;
  for (int i = 0; i < count; ++i) {
    const PoolBin<scalar_t>& bin = list[i];
    if (h < bin.h0 || h >= bin.h1 || w < bin.w0 || w >= bin.w1) continue;
    const scalar_t* row = grad + (bin.roi * s.channels_out + item.c0) * bins + item.b;
#pragma unroll
    for (int k = 0; k < kChannels; ++k) {
      if (k < channels) sum[k] += static_cast<T>(row[k * bins] / bin.area);
    }
  }
}

// A listed ps_roi_align bin: its RoI, its box (torchvision's aligned roi_align geometry) and the rows
// [h0, h1) x columns [w0, w1) that its samples' corners can reach.
template <typename T>
struct AlignBin {
  int64_t roi;
  roi::RoiBox<T> box;
  int h0, h1, w0, w1;
};

// The first and one past the last pixel row (or column) that bilinear corners of samples in [low, high] reach:
// bilinear_corners clamps a coordinate to [0, size - 1] and takes its floor and the next.
template <typename T>
C10_HOST_DEVICE inline void corner_reach(T low, T high, int64_t size, int* first, int* end) {
  if (!(low <= high) || size <= 0) {  // NaN: bilinear_corners skips every sample
    *first = *end = 0;
    return;
  }
  const T last = static_cast<T>(size - 1);
  *first = low <= static_cast<T>(0) ? 0 : (low >= last ? static_cast<int>(size - 1) : static_cast<int>(low));
  const int top = high <= static_cast<T>(0) ? 0 : (high >= last ? static_cast<int>(size - 1) : static_cast<int>(high));
  *end = top + 2 < size ? top + 2 : static_cast<int>(size);
}

// Bin item.b of RoI r; true when it is of image item.n, has samples and its corners can reach the tile.
template <typename scalar_t, typename T>
C10_HOST_DEVICE inline bool make_align_bin(int64_t r, const scalar_t* rois, const Shape& s, const Item& item,
                                           AlignBin<T>* bin) {
  bin->roi = r;
  bin->box = roi::roi_align_box<scalar_t, T>(rois + r * 5, static_cast<T>(s.spatial_scale), s.pooled_h, s.pooled_w,
                                             s.sampling_ratio, /*aligned=*/true);
  if (bin->box.batch != item.n || bin->box.grid_h <= 0 || bin->box.grid_w <= 0) return false;
  const int64_t ph = item.b / s.pooled_w;
  const int64_t pw = item.b % s.pooled_w;
  T y0, x0, y1, x1;  // the first and the last sample: the samples run monotonically between them
  roi::sample_point(bin->box, ph, pw, 0, 0, &y0, &x0);
  roi::sample_point(bin->box, ph, pw, bin->box.grid_h - 1, bin->box.grid_w - 1, &y1, &x1);
  corner_reach<T>(y0 < y1 ? y0 : y1, y0 < y1 ? y1 : y0, s.height, &bin->h0, &bin->h1);
  corner_reach<T>(x0 < x1 ? x0 : x1, x0 < x1 ? x1 : x0, s.width, &bin->w0, &bin->w1);
  return meets_tile(item, bin->h0, bin->h1, bin->w0, bin->w1);
}

// Pixel (h, w) adds grad[roi, c, ph, pw] * w / count for every corner of every sample of the listed bins that
// lands on it, in torchvision's order (sample row, sample column, corner), for the item's channels.
template <typename scalar_t, typename T>
C10_HOST_DEVICE inline void align_pixel(int h, int w, const AlignBin<T>* list, int count, const scalar_t* grad,
                                        const Shape& s, const Item& item, int channels, T (&sum)[kChannels]) {
  const int64_t bins = s.pooled_h * s.pooled_w;
  const int64_t ph = item.b / s.pooled_w;
  const int64_t pw = item.b % s.pooled_w;
  const int64_t pixel = static_cast<int64_t>(h) * s.width + w;
  for (int i = 0; i < count; ++i) {
    const AlignBin<T>& bin = list[i];
    if (h < bin.h0 || h >= bin.h1 || w < bin.w0 || w >= bin.w1) continue;
    const scalar_t* row = grad + (bin.roi * s.channels_out + item.c0) * bins + item.b;
    for (int64_t iy = 0; iy < bin.box.grid_h; ++iy) {
      for (int64_t ix = 0; ix < bin.box.grid_w; ++ix) {
        T y;
        T x;
        roi::sample_point(bin.box, ph, pw, iy, ix, &y, &x);
        T weight[roi::kCorners];
        int64_t corner[roi::kCorners];
        if (!roi::bilinear_corners<T>(s.height, s.width, y, x, weight, corner)) continue;
        for (int c = 0; c < roi::kCorners; ++c) {
          if (corner[c] != pixel) continue;
#pragma unroll
          for (int k = 0; k < kChannels; ++k) {
            if (k < channels) sum[k] += static_cast<T>(row[k * bins]) * weight[c] / bin.box.count;
          }
        }
      }
    }
  }
}

// Where pixel (h, w) of channel item.c0 + k goes in grad_input [N, C_out * planes, H, W].
C10_HOST_DEVICE inline int64_t out_index(const Shape& s, const Item& item, int k, int h, int w) {
  const int64_t channel = (item.c0 + k) * s.planes + item.b;
  return ((item.n * s.channels_out * s.planes + channel) * s.height + h) * s.width + w;
}

// The three ops as the kernels see them: their inputs, the listed RoI, how an item lists one (make), what a pixel
// adds (pixel).
template <typename scalar_t, typename T>
struct RoiPoolOp {
  using Box = RoiPoolBox<scalar_t>;
  const scalar_t* grad;
  const scalar_t* rois;
  const int32_t* argmax;
  C10_HOST_DEVICE bool make(int64_t r, const Shape& s, const Item& item, Box* box) const {
    return make_roi_pool_box(r, rois, s, item, box);
  }
  C10_HOST_DEVICE void pixel(int h, int w, const Box* list, int count, const Shape& s, const Item& item, int channels,
                             T (&sum)[kChannels]) const {
    roi_pool_pixel<scalar_t, T>(h, w, list, count, grad, argmax, s, item, channels, sum);
  }
};

template <typename scalar_t, typename T>
struct PsRoiPoolOp {
  using Box = PoolBin<scalar_t>;
  const scalar_t* grad;
  const scalar_t* rois;
  C10_HOST_DEVICE bool make(int64_t r, const Shape& s, const Item& item, Box* box) const {
    return make_pool_bin(r, rois, s, item, box);
  }
  C10_HOST_DEVICE void pixel(int h, int w, const Box* list, int count, const Shape& s, const Item& item, int channels,
                             T (&sum)[kChannels]) const {
    pool_pixel<scalar_t, T>(h, w, list, count, grad, s, item, channels, sum);
  }
};

template <typename scalar_t, typename T>
struct PsRoiAlignOp {
  using Box = AlignBin<T>;
  const scalar_t* grad;
  const scalar_t* rois;
  C10_HOST_DEVICE bool make(int64_t r, const Shape& s, const Item& item, Box* box) const {
    return make_align_bin<scalar_t, T>(r, rois, s, item, box);
  }
  C10_HOST_DEVICE void pixel(int h, int w, const Box* list, int count, const Shape& s, const Item& item, int channels,
                             T (&sum)[kChannels]) const {
    align_pixel<scalar_t, T>(h, w, list, count, grad, s, item, channels, sum);
  }
};

enum class Op { kRoiPool, kPsRoiPool, kPsRoiAlign };

// What a device supplies (roi_tiles.cpp, cuda/roi_tiles.cu).
struct Launches {
  // The loop over the items: grad [K, C_out, PH, PW], rois [K, 5] and argmax (roi_pool: int32 of grad's shape;
  // else undefined) contiguous, out [N, C_out * planes, H, W] written whole.
  void (*tiles)(Op op, const at::Tensor& grad, const at::Tensor& rois, const at::Tensor& argmax, const Shape& shape,
                at::Tensor& out);
  // An uninitialised tensor: at::empty would fill it first in deterministic mode, and every element is written.
  at::Tensor (*empty)(at::IntArrayRef sizes, at::ScalarType dtype, at::Device device);
};

// Checks the arguments (naming the op) and runs the device's loop into a new grad_input.
at::Tensor backward_with(const Launches& launches, Op op, const at::Tensor& grad, const at::Tensor& rois,
                         const at::Tensor& argmax, double spatial_scale, int64_t pooled_height, int64_t pooled_width,
                         int64_t sampling_ratio, int64_t batch_size, int64_t channels, int64_t height, int64_t width);

// roi_pool's pooled sizes are grad's (0 for a grad of the wrong rank, which backward_with then refuses).
inline int64_t pooled_size(const at::Tensor& grad, int64_t dim) { return grad.dim() == 4 ? grad.size(dim) : 0; }

}  // namespace deepep_lightning::roi_tiles
