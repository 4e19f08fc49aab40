// Shared declarations of deepep::lambda_returns (CPU and CUDA kernels); formula in lambda_returns.cpp.
#pragma once

#include <ATen/ATen.h>
#include <c10/macros/Macros.h>

namespace deepep {

// Throws c10::Error naming the argument when a shape, dtype or device does not fit.
void check_lambda_returns_inputs(const at::Tensor& rewards, const at::Tensor& dones, const at::Tensor& values,
                                 const at::Tensor& bootstrap_value);

// One rounding per operation, never contracted into a fused multiply-add: the recursion's results are
// PyTorch's op-by-op results bit for bit (each of its elementwise kernels rounds once).
#ifdef __CUDA_ARCH__
__device__ inline float lr_mul(float a, float b) { return __fmul_rn(a, b); }
__device__ inline double lr_mul(double a, double b) { return __dmul_rn(a, b); }
__device__ inline float lr_add(float a, float b) { return __fadd_rn(a, b); }
__device__ inline double lr_add(double a, double b) { return __dadd_rn(a, b); }
#else
// The host build passes -ffp-contract=off (ops/_loader.py), so these stay one rounding each.
template <typename scalar_t>
inline scalar_t lr_mul(scalar_t a, scalar_t b) { return a * b; }
template <typename scalar_t>
inline scalar_t lr_add(scalar_t a, scalar_t b) { return a + b; }
#endif

// Column b of the [T, B] returns, from t = T - 1 down to 0, in the order of the reference's loop
// (deepep_lightning/deepep/kernels/lambda_returns.py):
//   running = r_t + (gamma * (1 - d_t)) * ((1 - lam) * v_{t+1} + lam * running),  v_T = bootstrap_value
// gamma, one_minus_lam and lam arrive already rounded to scalar_t, as PyTorch rounds a Python scalar
// to a float tensor's dtype before it multiplies.
template <typename scalar_t>
C10_HOST_DEVICE inline void lambda_returns_column(int64_t b, int64_t horizon, int64_t batch,
                                                  const scalar_t* __restrict__ rewards, const bool* __restrict__ dones,
                                                  const scalar_t* __restrict__ values,
                                                  const scalar_t* __restrict__ bootstrap_value, scalar_t gamma,
                                                  scalar_t one_minus_lam, scalar_t lam, scalar_t* __restrict__ returns) {
  scalar_t running = bootstrap_value[b];
#ifdef __CUDA_ARCH__
#pragma unroll 8  // the loads of eight timesteps in flight at once: they do not depend on `running`
#endif
  for (int64_t t = horizon - 1; t >= 0; --t) {
    const int64_t i = t * batch + b;
    const scalar_t next_value = t + 1 < horizon ? values[i + batch] : bootstrap_value[b];
    const scalar_t discount = lr_mul(gamma, dones[i] ? scalar_t(0) : scalar_t(1));
    const scalar_t blend = lr_add(lr_mul(one_minus_lam, next_value), lr_mul(lam, running));
    running = lr_add(rewards[i], lr_mul(discount, blend));
    returns[i] = running;
  }
}

}  // namespace deepep
