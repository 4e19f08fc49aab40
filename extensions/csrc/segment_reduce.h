// Shared declarations of deepep_lightning::segment_reduce (CPU and CUDA kernels); what it computes: segment_reduce.cpp.
#pragma once

#include <ATen/ATen.h>
#include <c10/macros/Macros.h>
#include <ATen/NumericUtils.h>
#include <ATen/OpMathType.h>

#include <optional>
#include <type_traits>

namespace deepep_lightning {

// The reductions, as the schema's `reduce` names them: "prod", "amax", "amin", "mean".
enum class SegmentReduction : int { kProd = 0, kMax = 1, kMin = 2, kMean = 3 };

// Throws c10::Error naming the argument when a shape, dtype or device does not fit, or `reduce` is unknown.
SegmentReduction check_segment_reduce_inputs(const at::Tensor& values, const at::Tensor& keys, int64_t size,
                                             c10::string_view reduce, const std::optional<at::Tensor>& base);

// The keys as int64 in a stable ascending sort, and the entry order that sort makes (entry order kept
// within a key): (sorted_keys [n], order [n]), on the keys' device.
std::tuple<at::Tensor, at::Tensor> sort_segment_keys(const at::Tensor& keys);

// Row `row`'s segment in the sorted keys, by two binary searches: starts[row] = the first position whose key
// is >= row, counts[row] = how many keys equal row. The same code on CPU and CUDA.
C10_HOST_DEVICE inline void segment_bounds_element(int64_t row, int64_t n, const int64_t* __restrict__ sorted_keys,
                                                   int64_t* __restrict__ starts, int64_t* __restrict__ counts) {
  int64_t low = 0, high = n;
  while (low < high) {
    const int64_t mid = low + (high - low) / 2;
    if (sorted_keys[mid] < row) low = mid + 1; else high = mid;
  }
  const int64_t begin = low;
  high = n;
  while (low < high) {
    const int64_t mid = low + (high - low) / 2;
    if (sorted_keys[mid] <= row) low = mid + 1; else high = mid;
  }
  starts[row] = begin;
  counts[row] = low - begin;
}

// a combined with b, computed in PyTorch's op-math type (float for float16/bfloat16) and rounded to
// scalar_t, as torch.mul / torch.maximum / torch.minimum do; maxima and minima propagate NaN, ties keep a.
template <typename scalar_t>
C10_HOST_DEVICE inline scalar_t segment_combine(scalar_t a, scalar_t b, SegmentReduction reduction) {
  using op_t = at::opmath_type<scalar_t>;
  const op_t x = static_cast<op_t>(a), y = static_cast<op_t>(b);
  if (reduction == SegmentReduction::kProd) return static_cast<scalar_t>(x * y);
  if (at::_isnan(x)) return a;
  if (at::_isnan(y)) return b;
  if (reduction == SegmentReduction::kMax) return y > x ? b : a;
  return y < x ? b : a;
}

// a / b rounded toward negative infinity, as PyTorch's integer div(rounding_mode="floor") (a divisor that
// wrapped negative in a narrow integer type included).
template <typename scalar_t>
C10_HOST_DEVICE inline scalar_t segment_divide(scalar_t a, scalar_t b) {
  const int64_t x = static_cast<int64_t>(a), y = static_cast<int64_t>(b);
  const int64_t quotient = x / y;
  return static_cast<scalar_t>((x % y != 0 && (x < 0) != (y < 0)) ? quotient - 1 : quotient);
}

// The "mean" of one output element: the entries summed left to right (from base[row, column] with
// `include_base`, else from 0) and divided by their count (plus one for the base). Floating types sum in the
// op-math type (float for float16/bfloat16) and divide by the exact count, which for float32/float64 is
// PyTorch's sequential CPU index_reduce bit for bit; integers sum and count in their own type and floor-divide,
// as PyTorch's does (a narrow type wraps both, and a count that wraps to 0 divides by 1).
template <typename scalar_t>
C10_HOST_DEVICE inline scalar_t segment_mean(const scalar_t* __restrict__ values, const int64_t* __restrict__ order,
                                             int64_t start, int64_t count, int64_t inner, int64_t column,
                                             scalar_t from, bool from_base) {
  if constexpr (std::is_integral_v<scalar_t>) {
    scalar_t sum = from, entries = static_cast<scalar_t>(from_base ? 1 : 0);
    for (int64_t k = 0; k < count; ++k) {
      sum = static_cast<scalar_t>(sum + values[order[start + k] * inner + column]);
      entries = static_cast<scalar_t>(entries + 1);
    }
    return segment_divide<scalar_t>(sum, entries == 0 ? static_cast<scalar_t>(1) : entries);
  } else {
    using op_t = at::opmath_type<scalar_t>;
    op_t sum = static_cast<op_t>(from);
    for (int64_t k = 0; k < count; ++k) sum += static_cast<op_t>(values[order[start + k] * inner + column]);
    return static_cast<scalar_t>(sum / static_cast<op_t>(count + (from_base ? 1 : 0)));
  }
}

// One output element (row, column) of the [size, inner] result, the same code on CPU and CUDA: combines
// the row's entries values[order[starts[row] + k], column], k = 0 .. counts[row] - 1, left to right,
// starting from base[row, column] with `base` and `include_base` (PyTorch's sequential CPU index_reduce
// with include_self). A row without entries gets base[row, column], or without `base` the identity of a
// product (1), or 0 for maxima and minima.
template <typename scalar_t>
C10_HOST_DEVICE inline void segment_reduce_element(int64_t row, int64_t column, int64_t inner,
                                                   const scalar_t* __restrict__ values,
                                                   const int64_t* __restrict__ order,
                                                   const int64_t* __restrict__ starts,
                                                   const int64_t* __restrict__ counts,
                                                   const scalar_t* __restrict__ base, bool include_base,
                                                   SegmentReduction reduction, scalar_t* __restrict__ out) {
  const int64_t at = row * inner + column;
  const int64_t start = starts[row];
  const int64_t count = counts[row];
  if (count <= 0) {
    out[at] = base != nullptr ? base[at] : static_cast<scalar_t>(reduction == SegmentReduction::kProd ? 1 : 0);
    return;
  }
  const bool from_base = base != nullptr && include_base;
  if (reduction == SegmentReduction::kMean) {
    out[at] = segment_mean<scalar_t>(values, order, start, count, inner, column,
                                     from_base ? base[at] : static_cast<scalar_t>(0), from_base);
    return;
  }
  scalar_t acc = from_base ? base[at] : values[order[start] * inner + column];
  for (int64_t k = from_base ? 0 : 1; k < count; ++k) {
    acc = segment_combine<scalar_t>(acc, values[order[start + k] * inner + column], reduction);
  }
  out[at] = acc;
}

}  // namespace deepep_lightning
