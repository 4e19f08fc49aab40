// deepep_lightning::roi_pool_backward, deepep_lightning::ps_roi_pool_backward and the 16/32-bit
// deepep_lightning::ps_roi_align_backward: torchvision's backwards as fixed-point scatter-adds
// (fixed_point_sum.h): the atomic kernels' one pass over the gradient, with integer additions, so the result
// is bitwise reproducible and the same on the CPU and on CUDA. The per-thread math is here; roi_fixed_point.cpp
// holds the schemas, the host driver and the CPU loops, cuda/roi_fixed_point.cu the kernels.
//
// roi_pool: bin (k, c, ph, pw) adds grad[k, c, ph, pw] at the forward's argmax (its flat position in the
// H x W plane; -1: an empty bin adds nothing) of plane (batch of RoI k, c). A pixel receives at most K * PH * PW
// terms.
// ps_roi_pool: bin b = ph * PW + pw of output channel c feeds input channel c * PH * PW + b (what the
// forward's channel_mapping always holds): every pixel of the bin's rectangle receives grad[k, c, ph, pw] /
// area, torchvision's formulas (roundf of the scaled box, bins [floor(ph * bin_h), ceil((ph + 1) * bin_h)),
// offset and clipped to [0, H]) in the gradient's own type, as its CUDA kernel computes them. A pixel receives
// at most K terms.
// ps_roi_align: bin b of output channel c feeds input channel c * PH * PW + b at the 4 bilinear corners of each
// of its samples (torchvision's aligned roi_align geometry, roi_csr_gather.h), each corner grad * w / count. A
// bin's samples are at least half a pixel apart once a bin is a pixel wide (adaptive sampling: grid =
// ceil(bin)), so at most 5 x 5 of them reach a pixel (all sampling_ratio^2 with a fixed ratio), each with up to
// 4 corners there (clamped at the border): a pixel receives at most 4 * K * 25 (or 4 * K * ratio^2) terms.
//
// The sums live in an int64 array beside grad_input with a flag byte per element (Slot): to hold them to 16 MiB, which
// stays in the L2 (fixed_point_sum.h, rows_per_chunk), grad_input's channels are done in chunks, each chunk
// one pass over its channels' bins and one pass that writes its outputs and clears the sums for the next.
#pragma once

#include <ATen/ATen.h>
#include <c10/macros/Macros.h>

#include <math.h>

#include <cstdint>

#include "fixed_point_sum.h"
#include "roi_csr_gather.h"

namespace deepep_lightning::roi_fixed_point {

enum class Op { kRoiPool, kPsRoiPool, kPsRoiAlign };

struct Shape {
  int64_t num_rois, batch, channels, height, width, pooled_h, pooled_w, sampling_ratio;
  int terms_bits;  // fixed_point::term_bits of the op's bound on the terms per pixel
};

// The grad_input channels [first, first + count) of one chunk.
struct Chunk {
  int64_t first, count;
};

// Where a term lands: the chunk-local plane q ([N, count] order) and the position p in its H x W plane. The
// sums are [N * count, H * W]; the flags keep a byte per element in 32-bit words, each plane padded to whole words
// (words_per_plane = ceil(H * W / 4)), so the pass that finishes a plane reads its flags without division.
struct Slot {
  int64_t plane, position;
};

C10_HOST_DEVICE inline int64_t words_per_plane(const Shape& shape) {
  return fixed_point::flag_words(shape.height * shape.width);
}
C10_HOST_DEVICE inline int64_t sum_index(const Shape& shape, const Slot& slot) {
  return slot.plane * shape.height * shape.width + slot.position;
}
C10_HOST_DEVICE inline int64_t flag_word(const Shape& shape, const Slot& slot) {
  return slot.plane * words_per_plane(shape) + (slot.position >> 2);
}

// roi_pool's term of chunk-local thread i (bins of the chunk's channels, [K, count, PH, PW] order): false for
// an empty bin, else where it lands and its source index in grad.
template <typename scalar_t, typename index_t>
C10_HOST_DEVICE inline bool roi_pool_term(int64_t i, const scalar_t* rois, const index_t* argmax, const Shape& shape,
                                          const Chunk& chunk, Slot* slot, int64_t* source) {
  const int64_t bins = shape.pooled_h * shape.pooled_w;
  const int64_t bin = i % bins;
  const int64_t local_channel = (i / bins) % chunk.count;
  const int64_t k = i / (bins * chunk.count);
  *source = (k * shape.channels + chunk.first + local_channel) * bins + bin;
  const int64_t position = static_cast<int64_t>(argmax[*source]);
  if (position < 0) return false;
  const int64_t n = static_cast<int64_t>(static_cast<int>(rois[k * 5]));  // torchvision: int roi_batch_ind
  if (n < 0 || n >= shape.batch) return false;  // a box of no image of the batch adds nothing
  slot->plane = n * chunk.count + local_channel;
  slot->position = position;
  return true;
}

C10_HOST_DEVICE inline int clip(int value, int high) { return value < 0 ? 0 : (value > high ? high : value); }

// A ps_roi_pool bin's rectangle [h0, h1) x [w0, w1) and the value every pixel of it receives.
template <typename scalar_t>
struct PsBin {
  int64_t batch;
  int h0, h1, w0, w1;
  scalar_t value;
};

// The bin of chunk-local thread i ([K, count] order over the chunk's input channels) and its value from grad,
// torchvision's ps_roi_pool_backward_kernel_impl line by line in scalar_t.
template <typename scalar_t>
C10_HOST_DEVICE inline PsBin<scalar_t> ps_roi_pool_bin(int64_t i, const scalar_t* grad, const scalar_t* rois,
                                                       scalar_t spatial_scale, const Shape& shape,
                                                       const Chunk& chunk, int64_t* source) {
  const int64_t k = i / chunk.count;
  const int64_t channel = chunk.first + i % chunk.count;  // input channel c * PH * PW + b
  const int64_t b = channel % (shape.pooled_h * shape.pooled_w);
  const int ph = static_cast<int>(b / shape.pooled_w);
  const int pw = static_cast<int>(b % shape.pooled_w);
  const scalar_t* roi = rois + k * 5;
  PsBin<scalar_t> bin;
  bin.batch = static_cast<int64_t>(static_cast<int>(roi[0]));
  const int start_w = static_cast<int>(roundf(static_cast<float>(roi[1] * spatial_scale)));
  const int start_h = static_cast<int>(roundf(static_cast<float>(roi[2] * spatial_scale)));
  const int end_w = static_cast<int>(roundf(static_cast<float>(roi[3] * spatial_scale)));
  const int end_h = static_cast<int>(roundf(static_cast<float>(roi[4] * spatial_scale)));
  const int roi_w = end_w - start_w > 1 ? end_w - start_w : 1;  // too small RoIs are 1 x 1
  const int roi_h = end_h - start_h > 1 ? end_h - start_h : 1;
  const scalar_t bin_h = static_cast<scalar_t>(roi_h) / static_cast<scalar_t>(shape.pooled_h);
  const scalar_t bin_w = static_cast<scalar_t>(roi_w) / static_cast<scalar_t>(shape.pooled_w);
  const int height = static_cast<int>(shape.height);
  const int width = static_cast<int>(shape.width);
  bin.h0 = clip(static_cast<int>(floorf(static_cast<float>(static_cast<scalar_t>(ph) * bin_h))) + start_h, height);
  bin.w0 = clip(static_cast<int>(floorf(static_cast<float>(static_cast<scalar_t>(pw) * bin_w))) + start_w, width);
  bin.h1 = clip(static_cast<int>(ceilf(static_cast<float>(static_cast<scalar_t>(ph + 1) * bin_h))) + start_h, height);
  bin.w1 = clip(static_cast<int>(ceilf(static_cast<float>(static_cast<scalar_t>(pw + 1) * bin_w))) + start_w, width);
  if (bin.batch < 0 || bin.batch >= shape.batch) bin.h1 = bin.h0;  // a box of no image of the batch adds nothing
  const bool empty = bin.h1 <= bin.h0 || bin.w1 <= bin.w0;
  const scalar_t area = static_cast<scalar_t>((bin.h1 - bin.h0) * (bin.w1 - bin.w0));
  *source = k * shape.channels + channel;  // grad [K, C / (PH * PW), PH, PW] is [K, C] flat
  bin.value = empty ? static_cast<scalar_t>(0) : grad[*source] / area;
  return bin;
}

// A ps_roi_align bin of chunk-local thread i ([K, count] order over the chunk's input channels): its box
// (no samples for a box of no image of the batch), position, chunk-local plane and gradient.
template <typename T>
struct PsAlignBin {
  roi::RoiBox<T> box;
  int64_t ph, pw, plane;
  T grad;
};

template <typename scalar_t, typename T>
C10_HOST_DEVICE inline PsAlignBin<T> ps_roi_align_bin(int64_t i, const scalar_t* grad, const scalar_t* rois,
                                                      T spatial_scale, const Shape& shape, const Chunk& chunk) {
  const int64_t k = i / chunk.count;
  const int64_t local_channel = i % chunk.count;
  const int64_t channel = chunk.first + local_channel;
  const int64_t b = channel % (shape.pooled_h * shape.pooled_w);
  PsAlignBin<T> bin;
  bin.box = roi::roi_align_box<scalar_t, T>(rois + k * 5, spatial_scale, shape.pooled_h, shape.pooled_w,
                                            shape.sampling_ratio, /*aligned=*/true);
  if (bin.box.batch < 0 || bin.box.batch >= shape.batch) bin.box.grid_h = 0;
  bin.ph = b / shape.pooled_w;
  bin.pw = b % shape.pooled_w;
  bin.plane = bin.box.batch * chunk.count + local_channel;
  bin.grad = static_cast<T>(grad[k * shape.channels + channel]);  // grad [K, C / (PH * PW), PH, PW] is [K, C]
  return bin;
}

// The device-specific steps of backward_with.
struct Launches {
  // max_bits[0] = the float bits of the largest finite |grad| (0 when there is none); max_bits is zeroed.
  void (*max_abs)(const at::Tensor& grad, at::Tensor& max_bits);
  // Adds the chunk's terms into sums (chunk-local [N * count, H * W], int64) and flags (Slot's layout).
  void (*accumulate)(Op op, const at::Tensor& grad, const at::Tensor& rois, const at::Tensor& argmax,
                     double spatial_scale, const Shape& shape, const Chunk& chunk, const at::Tensor& max_bits,
                     at::Tensor& sums, at::Tensor& flags);
  // Writes the chunk's outputs into out ([N, C, H, W]) and zeroes its sums and flags.
  void (*finish)(const Shape& shape, const Chunk& chunk, const at::Tensor& max_bits, at::Tensor& sums,
                 at::Tensor& flags, at::Tensor& out);
  // An uninitialised tensor (every element is written before it is read).
  at::Tensor (*empty)(at::IntArrayRef sizes, at::ScalarType dtype, at::Device device);
};

// roi_pool's pooled sizes are grad's (0 for a grad of the wrong rank, which backward_with then refuses).
inline int64_t pooled_size(const at::Tensor& grad, int64_t dim) { return grad.dim() == 4 ? grad.size(dim) : 0; }

// The whole op on one device: checks, the chunks, the passes.
at::Tensor backward_with(const Launches& launches, Op op, const at::Tensor& grad, const at::Tensor& rois,
                         const at::Tensor& argmax, double spatial_scale, int64_t pooled_height, int64_t pooled_width,
                         int64_t sampling_ratio, int64_t batch_size, int64_t channels, int64_t height, int64_t width);

// ps_roi_align_backward for float16/bfloat16/float32 grads on each device (roi_align_backward.cpp and
// cuda/roi_align_backward.cu send those dtypes here; float64 keeps the sorted gather).
at::Tensor ps_roi_align_backward_cpu(const at::Tensor& grad, const at::Tensor& rois, double spatial_scale,
                                     int64_t pooled_height, int64_t pooled_width, int64_t sampling_ratio,
                                     int64_t batch_size, int64_t channels, int64_t height, int64_t width);
at::Tensor ps_roi_align_backward_cuda(const at::Tensor& grad, const at::Tensor& rois, double spatial_scale,
                                      int64_t pooled_height, int64_t pooled_width, int64_t sampling_ratio,
                                      int64_t batch_size, int64_t channels, int64_t height, int64_t width);

}  // namespace deepep_lightning::roi_fixed_point
