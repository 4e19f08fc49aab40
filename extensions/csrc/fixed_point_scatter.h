// deepep_lightning::fixed_point_scatter_add: segment_scatter_add's arguments and result (index_add along one
// dimension onto base or zeros) with the sum of each output element exact in fixed point (fixed_point_sum.h):
// PyTorch's atomic kernel's one pass over the terms, with 64-bit integer atomics, so the bits do not depend on
// the order of the additions and the CPU and CUDA kernels agree bit for bit. The per-thread math is here;
// fixed_point_scatter.cpp holds the schema, the host driver and the CPU loops, cuda/fixed_point_scatter.cu the
// kernels.
//
// src is viewed as [outer, entries, inner], out as [outer, size, inner]; term (o, i, c) = src[o, i, c] * alpha,
// added to out[o, index[i], c]: an output element receives at most `entries` terms. Each output element's sum
// is rounded once and added to base once (fl(base + sum)); an element no term reached, or whose terms sum to an
// exact zero, keeps base's bits.
//
// The sums of a chunk of output rows live beside out (an int64 and a flag byte per element, the flag bytes of a
// row in whole 32-bit words): to hold the extra memory to a fifth of out's bytes (or 16 MiB when that is more),
// the rows go in chunks, each one pass over all terms (those of other rows skipped) and one pass that adds its
// rows into out and clears the sums for the next.
#pragma once

#include <ATen/ATen.h>
#include <c10/macros/Macros.h>

#include <cstdint>

#include "fixed_point_sum.h"

namespace deepep_lightning::fixed_point_scatter {

struct Layout {
  int64_t outer, entries, size, inner;
  double alpha;
  int terms_bits;  // fixed_point::term_bits(entries)
};

// The output rows [first, first + count) of one chunk.
struct Rows {
  int64_t first, count;
};

C10_HOST_DEVICE inline int64_t words_per_row(const Layout& layout) { return fixed_point::flag_words(layout.inner); }

// Term t ([outer, entries, inner] order) goes to output row index[i] of block o, column c: its entry i, and
// (chunk_row) its chunk-local row q = o * count + (row - first), or -1 when that row is not in the chunk.
C10_HOST_DEVICE inline int64_t entry_of(int64_t t, const Layout& layout) { return (t / layout.inner) % layout.entries; }

C10_HOST_DEVICE inline int64_t chunk_row(int64_t t, int64_t row, const Layout& layout, const Rows& rows) {
  if (row < rows.first || row >= rows.first + rows.count) return -1;
  return (t / (layout.inner * layout.entries)) * rows.count + (row - rows.first);
}

// out's value at an element whose base is `base`, from its sum in quanta and its flags.
C10_HOST_DEVICE inline float finished(float base, int64_t sum, uint32_t flags, int s) {
  if (sum == 0 && flags == 0) return base;  // nothing to add: base's bits, a negative zero included
  return static_cast<float>(static_cast<double>(base) + fixed_point::finish(sum, flags, s));
}

// The device-specific steps of scatter_add_with.
struct Launches {
  void (*max_abs)(const at::Tensor& src, at::Tensor& max_bits);
  // Adds the chunk's terms into sums ([outer * count, inner] int64) and flags ([outer * count, words] int32).
  void (*accumulate)(const at::Tensor& src, const at::Tensor& index, const Layout& layout, const Rows& rows,
                     const at::Tensor& max_bits, at::Tensor& sums, at::Tensor& flags);
  // Adds the chunk's sums into out's rows, zeroes its sums and flags.
  void (*finish)(const Layout& layout, const Rows& rows, const at::Tensor& max_bits, at::Tensor& sums,
                 at::Tensor& flags, at::Tensor& out);
};

at::Tensor scatter_add_with(const Launches& launches, const at::Tensor& src, const at::Tensor& index, int64_t size,
                            int64_t dim, const std::optional<at::Tensor>& base, double alpha);

}  // namespace deepep_lightning::fixed_point_scatter
