// Order-independent sums for deterministic scatter-adds: every term is rounded once to an integer multiple of a
// power-of-two quantum, the integers are added with 64-bit integer additions (atomics on a GPU), and each sum is
// rounded once back to floating point. Integer addition is associative, so every order of the additions gives
// the same bits: the scatter keeps the atomic kernel's one pass over its terms and loses only its run-to-run
// variation (the fixed-point accumulation of GPU molecular dynamics codes, AMBER's SPFP among them).
//
// The quantum: with M the largest finite |term| (M < 2^e) and at most 2^b terms per sum, every term becomes
// llrint(term * 2^s) with s = 62 - b - e, so |sum| < 2^62 + 2^b < 2^63 and nothing overflows. Each term is
// off by at most half a quantum, 2^-(63 - b - e), i.e. 2^-(62 - b) * M: with b = 16 (65536 terms per sum) a sum
// of t terms is within t * 2^-46 * M of the exact sum of the terms, where float32 atomics round every partial
// sum to 2^-24 of its magnitude. The CPU and CUDA kernels run these functions, so they agree bit for bit.
//
// A non-finite term is not added: it sets a flag bit of its output (one byte per output, in 32-bit words that
// atomicOr can reach), and the output becomes what a float sum gives: NaN if a NaN or both infinities arrived,
// else the infinity that did.
#pragma once

#include <ATen/ATen.h>
#include <c10/macros/Macros.h>

#include <math.h>

#include <cstdint>

namespace deepep_lightning::fixed_point {

// A sum of at most 2^b terms of magnitude below 2^e stays below 2^kSumBits quanta.
constexpr int kSumBits = 62;

// Flag bits of an output that received a non-finite term.
constexpr uint32_t kPositiveInfinity = 1;
constexpr uint32_t kNegativeInfinity = 2;
constexpr uint32_t kNaN = 4;

// b of the header: the bits of a bound on the number of terms of one sum (2^b > terms_bound).
inline int term_bits(int64_t terms_bound) {
  int bits = 0;
  for (; terms_bound > 0; terms_bound >>= 1) ++bits;
  return bits;
}

// s of the header from M (the largest finite |term|, as float; 0 when there is none).
C10_HOST_DEVICE inline int scale_exponent(float max_abs, int terms_bits) {
  int e = 0;
  frexpf(max_abs, &e);  // max_abs = m * 2^e with m in [0.5, 1), so max_abs < 2^e (0 gives e = 0)
  return kSumBits - terms_bits - e;
}

// A finite term in quanta 2^-s: one rounding, to nearest, ties to even (the scaling by 2^s is exact).
C10_HOST_DEVICE inline int64_t quantize(double term, int s) { return llrint(ldexp(term, s)); }

// The flag of a non-finite term.
C10_HOST_DEVICE inline uint32_t flag_of(double term) {
  return isnan(term) ? kNaN : (term > 0 ? kPositiveInfinity : kNegativeInfinity);
}

// 32-bit flag words of a row of n outputs (a byte each, every row padded to whole words).
C10_HOST_DEVICE inline int64_t flag_words(int64_t n) { return (n + 3) / 4; }

// How many rows of row_elements outputs one chunk of sums may hold: the sums and flags (9 bytes an output) take at
// most 16 MiB, so that on a Hopper GPU (50 MB of L2) a chunk's atomics, the finish pass's reads and its clears for
// the next chunk stay in the L2 beside the output's stream instead of going to HBM; at least one row, at most rows.
inline int64_t rows_per_chunk(int64_t rows, int64_t row_elements) {
  constexpr int64_t kSumBytes = int64_t{16} << 20;
  constexpr int64_t kSumBytesPerElement = 9;  // an int64 sum and a flag byte
  const int64_t per_row = row_elements * kSumBytesPerElement > 0 ? row_elements * kSumBytesPerElement : 1;
  const int64_t fit = kSumBytes / per_row;
  return fit < 1 ? 1 : (fit > rows ? (rows > 0 ? rows : 1) : fit);
}

// The flag byte of output e in its word of the flag array (four outputs per 32-bit word).
C10_HOST_DEVICE inline uint32_t flag_shift(int64_t e) { return static_cast<uint32_t>(e & 3) * 8; }

// A sum in quanta and its output's flags, as a double: the one rounding of the sum happens here (and, for
// outputs narrower than double, in the caller's cast).
C10_HOST_DEVICE inline double finish(int64_t sum, uint32_t flags, int s) {
  if (flags != 0) {
    if ((flags & kNaN) != 0 || (flags & (kPositiveInfinity | kNegativeInfinity)) == (kPositiveInfinity | kNegativeInfinity)) {
      return NAN;
    }
    return (flags & kPositiveInfinity) != 0 ? INFINITY : -INFINITY;
  }
  return ldexp(static_cast<double>(sum), -s);
}

// max_bits (int32 [1], zeroed) = the float bits of the largest finite |value| of values (contiguous), 0 when there
// is none: M of the header, on the CPU (fixed_point_sum.cpp) and CUDA (cuda/fixed_point_sum.cu, atomicMax on the
// bits, which order non-negative floats as the floats do).
void max_finite_abs_cpu(const at::Tensor& values, at::Tensor& max_bits);
void max_finite_abs_cuda(const at::Tensor& values, at::Tensor& max_bits);

// The float a CPU max_bits holds.
float max_finite_abs_of(const at::Tensor& max_bits);

}  // namespace deepep_lightning::fixed_point
