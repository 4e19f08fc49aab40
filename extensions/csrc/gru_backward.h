// Shared declarations of deepep::gru_cell_backward (CPU and CUDA kernels); formula in gru_backward.cpp.
#pragma once

#include <ATen/ATen.h>

#include <math.h>

#ifdef __CUDACC__
#define DEEPEP_HOST_DEVICE __host__ __device__
#else
#define DEEPEP_HOST_DEVICE
#endif

namespace deepep {

// Throws c10::Error naming the argument when a shape, dtype or device does not fit.
void check_gru_cell_backward_inputs(const at::Tensor& grad_output, const at::Tensor& carry, const at::Tensor& mask,
                                    const at::Tensor& input_gates, const at::Tensor& hidden_gates,
                                    const at::Tensor& hidden);

DEEPEP_HOST_DEVICE inline float gru_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
DEEPEP_HOST_DEVICE inline double gru_sigmoid(double x) { return 1.0 / (1.0 + exp(-x)); }
DEEPEP_HOST_DEVICE inline float gru_tanh(float x) { return tanhf(x); }
DEEPEP_HOST_DEVICE inline double gru_tanh(double x) { return tanh(x); }

template <typename scalar_t>
struct gru_gate_grads {
  scalar_t r_pre, z_pre, n_pre, n_pre_times_r, hidden;
};

// One element of the backward, the same expressions on CPU and CUDA.
template <typename scalar_t>
DEEPEP_HOST_DEVICE inline gru_gate_grads<scalar_t> gru_gate_backward(scalar_t grad_output, scalar_t carry,
                                                                     scalar_t mask, scalar_t gi_r, scalar_t gi_z,
                                                                     scalar_t gi_n, scalar_t gh_r, scalar_t gh_z,
                                                                     scalar_t gh_n, scalar_t h) {
  const scalar_t one = scalar_t(1);
  const scalar_t g = (grad_output + carry) * mask;
  const scalar_t r = gru_sigmoid(gi_r + gh_r);
  const scalar_t z = gru_sigmoid(gi_z + gh_z);
  const scalar_t n = gru_tanh(gi_n + r * gh_n);
  const scalar_t n_pre = g * (one - z) * (one - n * n);
  const scalar_t z_pre = g * (h - n) * z * (one - z);
  const scalar_t r_pre = n_pre * gh_n * r * (one - r);
  return {r_pre, z_pre, n_pre, n_pre * r, g * z};
}

}  // namespace deepep
