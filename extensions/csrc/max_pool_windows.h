// The output windows of a max pooling that can hold one input position, and the two ways of summing the
// gradient of the windows' maxima: shared by the CPU and CUDA kernels of deepep_lightning::argmax_window_backward
// (max_pool_backward.cpp, cuda/max_pool_backward.cu), so both add the same terms in the same order.
#pragma once

#include <c10/macros/Macros.h>

#include <cstdint>

namespace deepep_lightning {

struct PoolWindows {
  int in[3];  // input sizes (d, h, w); a 2-D pooling has d = 1
  int out[3];
  int kernel[3];  // unused when adaptive
  int stride[3];
  int padding[3];
  int dilation[3];
  bool adaptive;
};

// The output cells [*first, *last) along dim whose window can hold input position i: for a max pooling
// PyTorch's own p_start / p_end (max_pool2d backward); for an adaptive pooling, where window o of n
// outputs over m inputs is [floor(o m / n), ceil((o + 1) m / n)), the o in [floor(i n / m), ceil((i + 1) n / m)).
C10_HOST_DEVICE inline void pool_window_range(const PoolWindows& w, int dim, int i, int* first, int* last) {
  const int n_in = w.in[dim], n_out = w.out[dim];
  int begin, end;
  if (w.adaptive) {
    begin = static_cast<int>((static_cast<int64_t>(i) * n_out) / n_in);
    end = static_cast<int>((static_cast<int64_t>(i + 1) * n_out + n_in - 1) / n_in);
  } else {
    const int span = (w.kernel[dim] - 1) * w.dilation[dim] + 1;
    const int shifted = i + w.padding[dim];
    begin = shifted < span ? 0 : (shifted - span) / w.stride[dim] + 1;
    end = shifted / w.stride[dim] + 1;
  }
  *first = begin;
  *last = end < n_out ? end : n_out;
}

// grad_input[item] for item = plane * in_cells + cell: the sum, in ascending (oz, oy, ox) order, of the
// grad_output cells whose window can hold cell and whose saved index is cell.
template <typename scalar_t, typename acc_t>
C10_HOST_DEVICE inline scalar_t pool_gather_one(const PoolWindows& w, int64_t item, const scalar_t* grad_output,
                                                const int64_t* indices) {
  const int64_t in_cells = static_cast<int64_t>(w.in[0]) * w.in[1] * w.in[2];
  const int64_t out_cells = static_cast<int64_t>(w.out[0]) * w.out[1] * w.out[2];
  const int64_t plane = item / in_cells;
  const int64_t cell = item - plane * in_cells;
  const int x = static_cast<int>(cell % w.in[2]);
  const int y = static_cast<int>((cell / w.in[2]) % w.in[1]);
  const int z = static_cast<int>(cell / (static_cast<int64_t>(w.in[2]) * w.in[1]));
  int z0, z1, y0, y1, x0, x1;
  pool_window_range(w, 0, z, &z0, &z1);
  pool_window_range(w, 1, y, &y0, &y1);
  pool_window_range(w, 2, x, &x0, &x1);
  const int64_t base = plane * out_cells;
  acc_t sum = acc_t(0);
  for (int oz = z0; oz < z1; ++oz) {
    for (int oy = y0; oy < y1; ++oy) {
      const int64_t row = base + (static_cast<int64_t>(oz) * w.out[1] + oy) * w.out[2];
      for (int ox = x0; ox < x1; ++ox) {
        if (indices[row + ox] == cell) sum += static_cast<acc_t>(grad_output[row + ox]);
      }
    }
  }
  return static_cast<scalar_t>(sum);
}

// ---- scatter in passes of disjoint windows -------------------------------------------------------------
//
// Windows o and o + classes along a dim never share an input cell, so the windows whose coordinates are
// congruent modulo (classes[0], classes[1], classes[2]) -- one "pass" -- write disjoint cells: each adds its
// gradient to its argmax cell with a plain read-modify-write, no atomics. The passes run one after the
// other in lexicographic order of the congruence class, so a cell receives its terms in that fixed order.

// Most passes worth launching; beyond it the gather (pool_gather_one) runs instead.
constexpr int kMaxScatterPasses = 8;

// Whether to scatter in `passes` passes rather than gather. A float16/bfloat16 cell would round its partial
// sum to the narrow type after every pass, while the gather sums in float: narrow types scatter only when
// one pass (no partial sums) covers the windows.
inline bool pool_scatter_in_passes(int passes, bool narrow) {
  return passes == 1 || (!narrow && passes <= kMaxScatterPasses);
}

// The least c such that windows o and o + c along dim are disjoint for every o.
inline int pool_window_classes(const PoolWindows& w, int dim) {
  const int n_in = w.in[dim], n_out = w.out[dim];
  if (!w.adaptive) {
    const int span = (w.kernel[dim] - 1) * w.dilation[dim] + 1;
    const int classes = (span + w.stride[dim] - 1) / w.stride[dim];
    return classes < n_out ? classes : (n_out > 0 ? n_out : 1);
  }
  int classes = 1;
  for (int o = 0; o < n_out; ++o) {  // window o is [floor(o m / n), ceil((o + 1) m / n))
    const int64_t end = (static_cast<int64_t>(o + 1) * n_in + n_out - 1) / n_out;
    while (o + classes < n_out && (static_cast<int64_t>(o + classes) * n_in) / n_out < end) ++classes;
  }
  return classes;
}

// The number of passes (the product of the classes, which it writes to classes[0..2]).
inline int pool_scatter_passes(const PoolWindows& w, int classes[3]) {
  int passes = 1;
  for (int d = 0; d < 3; ++d) {
    classes[d] = pool_window_classes(w, d);
    passes *= classes[d];
  }
  return passes;
}

// One pass: the windows first[d] + k * step[d], k in [0, count[d]).
struct ScatterPass {
  int first[3];
  int step[3];
  int count[3];
};

inline ScatterPass scatter_pass(const PoolWindows& w, const int classes[3], int pass) {
  ScatterPass p{};
  int rest = pass;  // pass = (cz * classes[1] + cy) * classes[2] + cx
  for (int d = 2; d >= 0; --d) {
    p.first[d] = rest % classes[d];
    rest /= classes[d];
    p.step[d] = classes[d];
    p.count[d] = w.out[d] > p.first[d] ? (w.out[d] - p.first[d] + classes[d] - 1) / classes[d] : 0;
  }
  return p;
}

// Window `item` of pass p (item = ((plane * count[0] + kz) * count[1] + ky) * count[2] + kx) adds its
// grad_output to grad_input at its saved index, when its window can hold that cell (the gather's rule).
template <typename scalar_t, typename acc_t>
C10_HOST_DEVICE inline void pool_scatter_one(const PoolWindows& w, const ScatterPass& p, int64_t item,
                                             const scalar_t* grad_output, const int64_t* indices,
                                             scalar_t* grad_input) {
  const int kx = static_cast<int>(item % p.count[2]);
  int64_t rest = item / p.count[2];
  const int ky = static_cast<int>(rest % p.count[1]);
  rest /= p.count[1];
  const int kz = static_cast<int>(rest % p.count[0]);
  const int64_t plane = rest / p.count[0];
  const int oz = p.first[0] + kz * p.step[0], oy = p.first[1] + ky * p.step[1], ox = p.first[2] + kx * p.step[2];
  const int64_t in_cells = static_cast<int64_t>(w.in[0]) * w.in[1] * w.in[2];
  const int64_t j = ((plane * w.out[0] + oz) * w.out[1] + oy) * static_cast<int64_t>(w.out[2]) + ox;
  const int64_t cell = indices[j];
  if (cell < 0 || cell >= in_cells) return;
  const int coordinate[3] = {static_cast<int>(cell / (static_cast<int64_t>(w.in[2]) * w.in[1])),
                             static_cast<int>((cell / w.in[2]) % w.in[1]), static_cast<int>(cell % w.in[2])};
  const int window[3] = {oz, oy, ox};
  for (int d = 0; d < 3; ++d) {
    int first, last;
    pool_window_range(w, d, coordinate[d], &first, &last);
    if (window[d] < first || window[d] >= last) return;
  }
  scalar_t& target = grad_input[plane * in_cells + cell];
  target = static_cast<scalar_t>(static_cast<acc_t>(target) + static_cast<acc_t>(grad_output[j]));
}

}  // namespace deepep_lightning
