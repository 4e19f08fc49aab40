// deepep::lambda_returns: the λ-returns of a [T, B] rollout as one pass per column.
//
//   G_t = r_t + γ(1 − d_t)[(1 − λ) V_{t+1} + λ G_{t+1}],   V_T = G_T = bootstrap_value     (returns [T, B])
//
// The reference loop (deepep_lightning/deepep/kernels/lambda_returns.py) runs six elementwise kernels per
// timestep; here a column is one thread's sequential recursion, with the reference's operations in its
// order and one rounding each (lambda_returns.h), so the returns are the reference's bit for bit on
// either device. Columns are independent: no reduction, no atomic. The arguments are validated in
// Python before this op runs (DESIGN.md section 7); the checks here guard direct torch.ops callers.
#include "lambda_returns.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

namespace deepep {

void check_lambda_returns_inputs(const at::Tensor& rewards, const at::Tensor& dones, const at::Tensor& values,
                                 const at::Tensor& bootstrap_value) {
  const char* op = "deepep::lambda_returns";
  TORCH_CHECK(rewards.dim() == 2, op, ": rewards must be 2-D [T, B], got shape ", rewards.sizes());
  TORCH_CHECK(rewards.scalar_type() == at::kFloat || rewards.scalar_type() == at::kDouble, op,
              ": rewards must be float32 or float64, got ", rewards.scalar_type());
  TORCH_CHECK(dones.sizes() == rewards.sizes() && dones.scalar_type() == at::kBool, op,
              ": dones must be a bool tensor of shape ", rewards.sizes(), ", got ", dones.scalar_type(), " ",
              dones.sizes());
  TORCH_CHECK(values.sizes() == rewards.sizes() && values.scalar_type() == rewards.scalar_type(), op,
              ": values must be ", rewards.scalar_type(), " of shape ", rewards.sizes(), ", got ", values.scalar_type(),
              " ", values.sizes());
  TORCH_CHECK(bootstrap_value.dim() == 1 && bootstrap_value.size(0) == rewards.size(1) &&
                  bootstrap_value.scalar_type() == rewards.scalar_type(),
              op, ": bootstrap_value must be ", rewards.scalar_type(), " of shape [", rewards.size(1), "], got ",
              bootstrap_value.scalar_type(), " ", bootstrap_value.sizes());
  for (const at::Tensor* other : {&dones, &values, &bootstrap_value}) {
    TORCH_CHECK(other->device() == rewards.device(), op, ": every tensor must be on rewards' device ",
                rewards.device(), ", got ", other->device());
  }
}

namespace {

// Columns per parallel_for task; a column's result never depends on it.
constexpr int64_t kColumnGrain = 64;

at::Tensor lambda_returns_cpu(const at::Tensor& rewards, const at::Tensor& dones, const at::Tensor& values,
                              const at::Tensor& bootstrap_value, double gamma, double lam) {
  check_lambda_returns_inputs(rewards, dones, values, bootstrap_value);
  const at::Tensor r_c = rewards.contiguous(), d_c = dones.contiguous(), v_c = values.contiguous();
  const at::Tensor b_c = bootstrap_value.contiguous();
  const int64_t horizon = r_c.size(0);
  const int64_t batch = r_c.size(1);
  at::Tensor returns = at::empty_like(r_c);
  AT_DISPATCH_FLOATING_TYPES(r_c.scalar_type(), "lambda_returns_cpu", [&] {
    const scalar_t* r = r_c.data_ptr<scalar_t>();
    const bool* d = d_c.data_ptr<bool>();
    const scalar_t* v = v_c.data_ptr<scalar_t>();
    const scalar_t* bootstrap = b_c.data_ptr<scalar_t>();
    scalar_t* out = returns.data_ptr<scalar_t>();
    const auto g = static_cast<scalar_t>(gamma), one_minus = static_cast<scalar_t>(1.0 - lam);
    const auto l = static_cast<scalar_t>(lam);
    at::parallel_for(0, batch, kColumnGrain, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        lambda_returns_column<scalar_t>(b, horizon, batch, r, d, v, bootstrap, g, one_minus, l, out);
      }
    });
  });
  return returns;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(deepep, m) {
  m.def("lambda_returns(Tensor rewards, Tensor dones, Tensor values, Tensor bootstrap_value, float gamma, "
        "float lam) -> Tensor");
}

TORCH_LIBRARY_IMPL(deepep, CPU, m) { m.impl("lambda_returns", &lambda_returns_cpu); }

}  // namespace deepep
