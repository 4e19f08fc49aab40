// Fused all-action value head: schema of the `deepep` namespace and the CPU kernels.
//
//   q[n, a] = sum_h w[h] * tanh(z[n, h] + E[a, h]) + b       z [N, H], E [A, H], w [H] -> q [N, A]
//
// The [N, A, H] intermediate is never materialised: tanh is recomputed in the backward.
// Every floating-point sum runs in a fixed order that depends only on the shapes, so the CPU
// kernels are bitwise reproducible whatever the number of threads; `deterministic` only selects
// between the two CUDA backward variants and is accepted (and ignored) here.
//
// This file owns TORCH_LIBRARY(deepep, m), the DeepEP workload's namespace. Its other ops add their schemas from
// their own files with TORCH_LIBRARY_FRAGMENT(deepep, m).
#include "all_action_q.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>
#include <vector>

namespace deepep {

namespace {

// Rows per parallel_for task in the forward; the result of a row never depends on it.
constexpr int64_t kForwardRowGrain = 16;
// Backward chunking: at most kCpuTargetChunks partial sums, each over >= kCpuMinRows rows.
constexpr int64_t kCpuTargetChunks = 256;
constexpr int64_t kCpuMinRows = 64;

}  // namespace

at::Tensor all_action_q_cpu(const at::Tensor& z, const at::Tensor& action_embedding,
                            const at::Tensor& w, const at::Tensor& b, bool deterministic) {
  (void)deterministic;  // the CPU kernel is deterministic either way
  check_forward_inputs(z, action_embedding, w, b);
  TORCH_INTERNAL_ASSERT(z.device().is_cpu());
  const at::Tensor z_c = z.contiguous();
  const at::Tensor e_c = action_embedding.contiguous();
  const at::Tensor w_c = w.contiguous();
  const at::Tensor b_c = b.contiguous();
  const int64_t num_rows = z_c.size(0);
  const int64_t hidden = z_c.size(1);
  const int64_t num_actions = e_c.size(0);
  at::Tensor q = at::empty({num_rows, num_actions}, z_c.options());  // [N, A]
  if (num_rows == 0) return q;

  AT_DISPATCH_FLOATING_TYPES(z_c.scalar_type(), "all_action_q_cpu", [&] {
    const scalar_t* z_ptr = z_c.data_ptr<scalar_t>();
    const scalar_t* e_ptr = e_c.data_ptr<scalar_t>();
    const scalar_t* w_ptr = w_c.data_ptr<scalar_t>();
    const scalar_t bias = b_c.data_ptr<scalar_t>()[0];
    scalar_t* q_ptr = q.data_ptr<scalar_t>();
    at::parallel_for(0, num_rows, kForwardRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n) {
        const scalar_t* z_row = z_ptr + n * hidden;
        for (int64_t a = 0; a < num_actions; ++a) {
          const scalar_t* e_row = e_ptr + a * hidden;
          scalar_t acc = 0;
          for (int64_t h = 0; h < hidden; ++h) {
            acc += w_ptr[h] * std::tanh(z_row[h] + e_row[h]);
          }
          q_ptr[n * num_actions + a] = acc + bias;
        }
      }
    });
  });
  return q;
}

// Returns (dz [N, H], d_action_embedding [A, H], dw [H], db []) for upstream grad_q [N, A].
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> all_action_q_backward_cpu(
    const at::Tensor& grad_q, const at::Tensor& z, const at::Tensor& action_embedding,
    const at::Tensor& w, bool deterministic) {
  (void)deterministic;  // the CPU kernel is deterministic either way
  check_backward_inputs(grad_q, z, action_embedding, w);
  TORCH_INTERNAL_ASSERT(z.device().is_cpu());
  const at::Tensor g_c = grad_q.contiguous();
  const at::Tensor z_c = z.contiguous();
  const at::Tensor e_c = action_embedding.contiguous();
  const at::Tensor w_c = w.contiguous();
  const int64_t num_rows = z_c.size(0);
  const int64_t hidden = z_c.size(1);
  const int64_t num_actions = e_c.size(0);

  // Partial sums of one chunk of rows, one row of `partials` per chunk:
  //   [0, A*H) dE, [A*H, (A+1)*H) dw, (A+1)*H db.
  const int64_t chunk_rows = rows_per_chunk(num_rows, kCpuTargetChunks, kCpuMinRows);
  const int64_t num_chunks = ceil_div(num_rows, chunk_rows);
  const int64_t dw_offset = num_actions * hidden;
  const int64_t db_offset = dw_offset + hidden;
  const int64_t num_columns = db_offset + 1;

  at::Tensor dz = at::empty_like(z_c);                                     // [N, H]
  at::Tensor partials = at::zeros({num_chunks, num_columns}, z_c.options());  // [C, (A+1)H+1]
  at::Tensor d_embedding = at::empty_like(e_c);                            // [A, H]
  at::Tensor dw = at::empty_like(w_c);                                     // [H]
  at::Tensor db = at::empty({}, z_c.options());                            // []

  AT_DISPATCH_FLOATING_TYPES(z_c.scalar_type(), "all_action_q_backward_cpu", [&] {
    const scalar_t* g_ptr = g_c.data_ptr<scalar_t>();
    const scalar_t* z_ptr = z_c.data_ptr<scalar_t>();
    const scalar_t* e_ptr = e_c.data_ptr<scalar_t>();
    const scalar_t* w_ptr = w_c.data_ptr<scalar_t>();
    scalar_t* dz_ptr = dz.data_ptr<scalar_t>();
    scalar_t* part_ptr = partials.data_ptr<scalar_t>();

    // Phase 1: each chunk writes dz for its rows and its own partial row (no sharing).
    at::parallel_for(0, num_chunks, 1, [&](int64_t chunk_begin, int64_t chunk_end) {
      for (int64_t chunk = chunk_begin; chunk < chunk_end; ++chunk) {
        scalar_t* part = part_ptr + chunk * num_columns;
        const int64_t row_end = std::min(num_rows, (chunk + 1) * chunk_rows);
        for (int64_t n = chunk * chunk_rows; n < row_end; ++n) {
          const scalar_t* z_row = z_ptr + n * hidden;
          scalar_t* dz_row = dz_ptr + n * hidden;
          std::fill(dz_row, dz_row + hidden, scalar_t(0));
          for (int64_t a = 0; a < num_actions; ++a) {
            const scalar_t g = g_ptr[n * num_actions + a];
            const scalar_t* e_row = e_ptr + a * hidden;
            scalar_t* de_part = part + a * hidden;
            scalar_t* dw_part = part + dw_offset;
            for (int64_t h = 0; h < hidden; ++h) {
              const scalar_t t = std::tanh(z_row[h] + e_row[h]);
              const scalar_t s = g * w_ptr[h] * (scalar_t(1) - t * t);
              dz_row[h] += s;
              de_part[h] += s;
              dw_part[h] += g * t;
            }
            part[db_offset] += g;
          }
        }
      }
    });

    // Phase 2: reduce the chunk partials column by column, chunks in increasing order.
    scalar_t* de_ptr = d_embedding.data_ptr<scalar_t>();
    scalar_t* dw_ptr = dw.data_ptr<scalar_t>();
    scalar_t* db_ptr = db.data_ptr<scalar_t>();
    at::parallel_for(0, num_columns, 64, [&](int64_t col_begin, int64_t col_end) {
      for (int64_t col = col_begin; col < col_end; ++col) {
        scalar_t total = 0;
        for (int64_t chunk = 0; chunk < num_chunks; ++chunk) {
          total += part_ptr[chunk * num_columns + col];
        }
        if (col < dw_offset) {
          de_ptr[col] = total;
        } else if (col < db_offset) {
          dw_ptr[col - dw_offset] = total;
        } else {
          db_ptr[0] = total;
        }
      }
    });
  });
  return std::make_tuple(dz, d_embedding, dw, db);
}

TORCH_LIBRARY(deepep, m) {
  m.def(
      "all_action_q(Tensor z, Tensor action_embedding, Tensor w, Tensor b, "
      "bool deterministic=True) -> Tensor");
  m.def(
      "all_action_q_backward(Tensor grad_q, Tensor z, Tensor action_embedding, Tensor w, "
      "bool deterministic=True) -> (Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(deepep, CPU, m) {
  m.impl("all_action_q", &all_action_q_cpu);
  m.impl("all_action_q_backward", &all_action_q_backward_cpu);
}

}  // namespace deepep
