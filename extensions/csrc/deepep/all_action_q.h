// Shared declarations of the fused all-action value head (CPU and CUDA kernels).
//
//   q[n, a] = sum_h w[h] * tanh(z[n, h] + E[a, h]) + b
//
// z [N, H], E = action_embedding [A, H], w [H], b 0-dim or [1]  ->  q [N, A].
// Input checks live here so the CPU and CUDA kernels reject bad inputs with the
// same messages (argument name + what was received).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>

namespace deepep {

inline bool is_supported_float(at::ScalarType dtype) {
  return dtype == at::kFloat || dtype == at::kDouble;
}

inline void check_same_dtype_device(const at::Tensor& reference, const at::Tensor& other,
                                    const char* op, const char* name) {
  TORCH_CHECK(other.scalar_type() == reference.scalar_type(), op, ": ", name,
              " must have z's dtype ", reference.scalar_type(), ", got ", other.scalar_type());
  TORCH_CHECK(other.device() == reference.device(), op, ": ", name, " must be on z's device ",
              reference.device(), ", got ", other.device());
}

// Checks z [N, H], action_embedding [A, H], w [H]; returns nothing, throws c10::Error.
inline void check_core_inputs(const char* op, const at::Tensor& z, const at::Tensor& action_embedding,
                              const at::Tensor& w) {
  TORCH_CHECK(z.dim() == 2, op, ": z must be 2-D [N, H], got shape ", z.sizes());
  TORCH_CHECK(is_supported_float(z.scalar_type()), op, ": z must be float32 or float64, got ",
              z.scalar_type());
  TORCH_CHECK(z.size(1) >= 1, op, ": z must have H >= 1 columns, got shape ", z.sizes());
  TORCH_CHECK(action_embedding.dim() == 2, op,
              ": action_embedding must be 2-D [A, H], got shape ", action_embedding.sizes());
  TORCH_CHECK(action_embedding.size(0) >= 1, op,
              ": action_embedding must have A >= 1 rows, got shape ", action_embedding.sizes());
  TORCH_CHECK(action_embedding.size(1) == z.size(1), op, ": action_embedding must be [A, ",
              z.size(1), "] to match z of shape ", z.sizes(), ", got shape ",
              action_embedding.sizes());
  TORCH_CHECK(w.dim() == 1 && w.size(0) == z.size(1), op, ": w must be [", z.size(1),
              "] to match z of shape ", z.sizes(), ", got shape ", w.sizes());
  check_same_dtype_device(z, action_embedding, op, "action_embedding");
  check_same_dtype_device(z, w, op, "w");
}

inline void check_forward_inputs(const at::Tensor& z, const at::Tensor& action_embedding,
                                 const at::Tensor& w, const at::Tensor& b) {
  const char* op = "deepep::all_action_q";
  check_core_inputs(op, z, action_embedding, w);
  TORCH_CHECK(b.dim() <= 1 && b.numel() == 1, op, ": b must be 0-dim or [1], got shape ",
              b.sizes());
  check_same_dtype_device(z, b, op, "b");
}

inline void check_backward_inputs(const at::Tensor& grad_q, const at::Tensor& z,
                                  const at::Tensor& action_embedding, const at::Tensor& w) {
  const char* op = "deepep::all_action_q_backward";
  check_core_inputs(op, z, action_embedding, w);
  TORCH_CHECK(grad_q.dim() == 2 && grad_q.size(0) == z.size(0) &&
                  grad_q.size(1) == action_embedding.size(0),
              op, ": grad_q must be [", z.size(0), ", ", action_embedding.size(0),
              "] (N, A), got shape ", grad_q.sizes());
  check_same_dtype_device(z, grad_q, op, "grad_q");
}

// Rows per chunk of the blocked backward reduction. A function of the shape only (never of
// the thread count or the GPU), so the order of every floating-point sum is fixed.
//   target_chunks: how many chunks we would like (one per worker / per resident block).
inline int64_t rows_per_chunk(int64_t num_rows, int64_t target_chunks, int64_t min_rows) {
  const int64_t wanted = (num_rows + target_chunks - 1) / std::max<int64_t>(target_chunks, 1);
  return std::max<int64_t>(wanted, min_rows);
}

inline int64_t ceil_div(int64_t numerator, int64_t denominator) {
  return (numerator + denominator - 1) / denominator;
}

}  // namespace deepep
