// deepep::gru_cell_backward: one timestep of a GRU's backward through time, elementwise part.
//
// PyTorch's GRUCell, gates ordered [r, z, n]:
//   gi = W_ih f + b_ih, gh = W_hh h + b_hh                        (each [B, 3H], precomputed)
//   r = sigmoid(gi_r + gh_r), z = sigmoid(gi_z + gh_z), n = tanh(gi_n + r * gh_n)
//   h' = (1 - z) * n + z * h,  and the rollout stores m * h' (m = 0 where an episode ended)
//
// Given grad_output (dL/d(m h') from the loss) and carry (dL/d(m h') through the next timestep):
//   g       = (grad_output + carry) * m                                    [B, H]
//   dn_pre  = g (1 - z) (1 - n^2),  dz_pre = g (h - n) z (1 - z)
//   dr_pre  = dn_pre gh_n r (1 - r)
//   grad_input_gates  = [dr_pre, dz_pre, dn_pre]                           [B, 3H]
//   grad_hidden_gates = [dr_pre, dz_pre, dn_pre * r]                       [B, 3H]
//   grad_hidden       = g z  (dL/dh through the blend; the caller adds grad_hidden_gates @ W_hh)
// Every output element is a function of its own row and column only: no reductions, no atomics,
// bitwise reproducible. The arguments are validated in Python before this op runs (DESIGN.md
// section 7); the checks here guard direct torch.ops callers.
#include "gru_backward.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <tuple>

namespace deepep {

void check_gru_cell_backward_inputs(const at::Tensor& grad_output, const at::Tensor& carry, const at::Tensor& mask,
                                    const at::Tensor& input_gates, const at::Tensor& hidden_gates,
                                    const at::Tensor& hidden) {
  const char* op = "deepep::gru_cell_backward";
  TORCH_CHECK(hidden.dim() == 2, op, ": hidden must be 2-D [B, H], got shape ", hidden.sizes());
  TORCH_CHECK(hidden.scalar_type() == at::kFloat || hidden.scalar_type() == at::kDouble, op,
              ": hidden must be float32 or float64, got ", hidden.scalar_type());
  const int64_t batch = hidden.size(0);
  const int64_t size = hidden.size(1);
  TORCH_CHECK(grad_output.sizes() == hidden.sizes(), op, ": grad_output must be ", hidden.sizes(), ", got ",
              grad_output.sizes());
  TORCH_CHECK(carry.sizes() == hidden.sizes(), op, ": carry must be ", hidden.sizes(), ", got ", carry.sizes());
  TORCH_CHECK(mask.dim() == 1 && mask.size(0) == batch, op, ": mask must be [", batch, "], got ", mask.sizes());
  TORCH_CHECK(input_gates.dim() == 2 && input_gates.size(0) == batch && input_gates.size(1) == 3 * size, op,
              ": input_gates must be [", batch, ", ", 3 * size, "], got ", input_gates.sizes());
  TORCH_CHECK(hidden_gates.dim() == 2 && hidden_gates.size(0) == batch && hidden_gates.size(1) == 3 * size, op,
              ": hidden_gates must be [", batch, ", ", 3 * size, "], got ", hidden_gates.sizes());
  for (const at::Tensor* other : {&grad_output, &carry, &mask, &input_gates, &hidden_gates}) {
    TORCH_CHECK(other->scalar_type() == hidden.scalar_type() && other->device() == hidden.device(), op,
                ": every tensor must have hidden's dtype ", hidden.scalar_type(), " and device ", hidden.device(),
                ", got ", other->scalar_type(), " on ", other->device());
  }
}

namespace {

// Rows per parallel_for task; the result of a row never depends on it.
constexpr int64_t kRowGrain = 8;

std::tuple<at::Tensor, at::Tensor, at::Tensor> gru_cell_backward_cpu(const at::Tensor& grad_output,
                                                                     const at::Tensor& carry, const at::Tensor& mask,
                                                                     const at::Tensor& input_gates,
                                                                     const at::Tensor& hidden_gates,
                                                                     const at::Tensor& hidden) {
  check_gru_cell_backward_inputs(grad_output, carry, mask, input_gates, hidden_gates, hidden);
  const at::Tensor go_c = grad_output.contiguous(), carry_c = carry.contiguous(), mask_c = mask.contiguous();
  const at::Tensor gi_c = input_gates.contiguous(), gh_c = hidden_gates.contiguous(), h_c = hidden.contiguous();
  const int64_t batch = h_c.size(0);
  const int64_t size = h_c.size(1);
  at::Tensor grad_gi = at::empty_like(gi_c);  // [B, 3H]
  at::Tensor grad_gh = at::empty_like(gh_c);  // [B, 3H]
  at::Tensor grad_h = at::empty_like(h_c);    // [B, H]
  AT_DISPATCH_FLOATING_TYPES(h_c.scalar_type(), "gru_cell_backward_cpu", [&] {
    const scalar_t* go = go_c.data_ptr<scalar_t>();
    const scalar_t* cy = carry_c.data_ptr<scalar_t>();
    const scalar_t* m = mask_c.data_ptr<scalar_t>();
    const scalar_t* gi = gi_c.data_ptr<scalar_t>();
    const scalar_t* gh = gh_c.data_ptr<scalar_t>();
    const scalar_t* h = h_c.data_ptr<scalar_t>();
    scalar_t* dgi = grad_gi.data_ptr<scalar_t>();
    scalar_t* dgh = grad_gh.data_ptr<scalar_t>();
    scalar_t* dh = grad_h.data_ptr<scalar_t>();
    at::parallel_for(0, batch, kRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        for (int64_t j = 0; j < size; ++j) {
          gru_element_backward<scalar_t>(b, j, size, go, cy, m, gi, gh, h, dgi, dgh, dh);
        }
      }
    });
  });
  return std::make_tuple(grad_gi, grad_gh, grad_h);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(deepep, m) {
  m.def(
      "gru_cell_backward(Tensor grad_output, Tensor carry, Tensor mask, Tensor input_gates, Tensor hidden_gates, "
      "Tensor hidden) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(deepep, CPU, m) { m.impl("gru_cell_backward", &gru_cell_backward_cpu); }

}  // namespace deepep
