// Shared declarations of deepep_lightning::histc_counts (CPU and CUDA kernels); what it computes: histc_counts.cpp.
#pragma once

#include <ATen/ATen.h>
#include <c10/macros/Macros.h>

#include <type_traits>

namespace deepep_lightning {

// The type PyTorch's histc computes bins in: float for float16/bfloat16/float32, double for float64.
template <typename scalar_t>
using histc_acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;

// Throws c10::Error naming the argument when `self`, `bins` or the range does not fit.
void check_histc_counts_inputs(const at::Tensor& self, int64_t bins, double low, double high);

// The bin of x among `bins` equal bins over [low, high], with PyTorch's arithmetic
// (int((x - low) * bins / (high - low)), high in the last bin), or -1 where x is outside or NaN.
template <typename acc_t>
C10_HOST_DEVICE inline int64_t histc_bin(acc_t x, acc_t low, acc_t high, int64_t bins) {
  if (!(x >= low && x <= high)) return -1;
  int64_t bin = static_cast<int64_t>((x - low) * bins / (high - low));
  if (bin >= bins) bin = bins - 1;  // x == high, and any rounding past the last edge
  if (bin < 0) bin = 0;
  return bin;
}

}  // namespace deepep_lightning
