// deepep_lightning::roi_pool_backward: torchvision's backward as a fixed-point scatter-add
// (fixed_point_sum.h): the atomic kernel's one pass over the gradient, with integer additions, so the result
// is bitwise reproducible and the same on the CPU and on CUDA. The per-thread math is here; roi_fixed_point.cpp
// holds the schemas, the host driver and the CPU loops, cuda/roi_fixed_point.cu the kernels.
//
// roi_pool: bin (k, c, ph, pw) adds grad[k, c, ph, pw] at the forward's argmax (its flat position in the
// H x W plane; -1: an empty bin adds nothing) of plane (batch of RoI k, c). A pixel receives at most K * PH * PW
// terms.
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

namespace deepep_lightning::roi_fixed_point {

struct Shape {
  int64_t num_rois, batch, channels, height, width, pooled_h, pooled_w;
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

// The term of chunk-local thread i (bins of the chunk's channels, [K, count, PH, PW] order): false for
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

// The device-specific steps of backward_with.
struct Launches {
  // max_bits[0] = the float bits of the largest finite |grad| (0 when there is none); max_bits is zeroed.
  void (*max_abs)(const at::Tensor& grad, at::Tensor& max_bits);
  // Adds the chunk's terms into sums (chunk-local [N * count, H * W], int64) and flags (Slot's layout).
  void (*accumulate)(const at::Tensor& grad, const at::Tensor& rois, const at::Tensor& argmax, const Shape& shape,
                     const Chunk& chunk, const at::Tensor& max_bits, at::Tensor& sums, at::Tensor& flags);
  // Writes the chunk's outputs into out ([N, C, H, W]) and zeroes its sums and flags.
  void (*finish)(const Shape& shape, const Chunk& chunk, const at::Tensor& max_bits, at::Tensor& sums,
                 at::Tensor& flags, at::Tensor& out);
  // An uninitialised tensor (every element is written before it is read).
  at::Tensor (*empty)(at::IntArrayRef sizes, at::ScalarType dtype, at::Device device);
};

// The whole op on one device: checks, the chunks, the passes.
at::Tensor backward_with(const Launches& launches, const at::Tensor& grad, const at::Tensor& rois,
                         const at::Tensor& argmax, int64_t batch_size, int64_t channels, int64_t height, int64_t width);

}  // namespace deepep_lightning::roi_fixed_point
