// The output windows of a max pooling that can hold one input position: shared by the CPU and CUDA
// kernels of deepep::argmax_window_backward (max_pool_backward.cpp, cuda/max_pool_backward.cu), so both
// visit the same cells in the same order.
#pragma once

#include <c10/macros/Macros.h>

#include <cstdint>

namespace deepep {

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

}  // namespace deepep
