// Shared declarations of deepep::gru_cell_backward (CPU and CUDA kernels); formula in gru_backward.cpp.
#pragma once

#include <ATen/ATen.h>
#include <c10/macros/Macros.h>

#include <math.h>

namespace deepep {

// Throws c10::Error naming the argument when a shape, dtype or device does not fit.
void check_gru_cell_backward_inputs(const at::Tensor& grad_output, const at::Tensor& carry, const at::Tensor& mask,
                                    const at::Tensor& input_gates, const at::Tensor& hidden_gates,
                                    const at::Tensor& hidden);

C10_HOST_DEVICE inline float gru_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
C10_HOST_DEVICE inline double gru_sigmoid(double x) { return 1.0 / (1.0 + exp(-x)); }
C10_HOST_DEVICE inline float gru_tanh(float x) { return tanhf(x); }
C10_HOST_DEVICE inline double gru_tanh(double x) { return tanh(x); }

// One element (row b, unit j) of the [B, H] state, the same code on CPU and CUDA: reads the unit's six gate
// pre-activations, h, the two incoming gradients and the row's mask; writes its three columns of
// grad_input_gates and grad_hidden_gates and its element of grad_hidden (the formula: gru_backward.cpp).
template <typename scalar_t>
C10_HOST_DEVICE inline void gru_element_backward(
    int64_t b, int64_t j, int64_t size, const scalar_t* __restrict__ grad_output, const scalar_t* __restrict__ carry,
    const scalar_t* __restrict__ mask, const scalar_t* __restrict__ input_gates,
    const scalar_t* __restrict__ hidden_gates, const scalar_t* __restrict__ hidden,
    scalar_t* __restrict__ grad_input_gates, scalar_t* __restrict__ grad_hidden_gates,
    scalar_t* __restrict__ grad_hidden) {
  const int64_t i = b * size + j;          // [B, H]
  const int64_t g3 = b * 3 * size + j;     // column j of gate r in [B, 3H]; z and n follow at +H, +2H
  const scalar_t one = scalar_t(1);
  const scalar_t g = (grad_output[i] + carry[i]) * mask[b];
  const scalar_t gh_n = hidden_gates[g3 + 2 * size];
  const scalar_t r = gru_sigmoid(input_gates[g3] + hidden_gates[g3]);
  const scalar_t z = gru_sigmoid(input_gates[g3 + size] + hidden_gates[g3 + size]);
  const scalar_t n = gru_tanh(input_gates[g3 + 2 * size] + r * gh_n);
  const scalar_t n_pre = g * (one - z) * (one - n * n);
  const scalar_t z_pre = g * (hidden[i] - n) * z * (one - z);
  const scalar_t r_pre = n_pre * gh_n * r * (one - r);
  grad_input_gates[g3] = r_pre;
  grad_input_gates[g3 + size] = z_pre;
  grad_input_gates[g3 + 2 * size] = n_pre;
  grad_hidden_gates[g3] = r_pre;
  grad_hidden_gates[g3 + size] = z_pre;
  grad_hidden_gates[g3 + 2 * size] = n_pre * r;
  grad_hidden[i] = g * z;
}

}  // namespace deepep
