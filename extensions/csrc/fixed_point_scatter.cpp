// deepep_lightning::fixed_point_scatter_add (fixed_point_scatter.h): the schema, the host driver and the CPU
// loops (which run the header's per-thread functions in order, so CPU tests check the CUDA math).
//
//   fixed_point_scatter_add(src, index, size, dim=0, base=None, alpha=1.0)
//     == (base.clone() if base is given else zeros(out_shape)).index_add_(dim, index, src, alpha=alpha)
//        with each output element's added sum exact in fixed point, rounded once
//   src float32/float16/bfloat16; index [src.size(dim)] int64/int32 in [0, size); base src's shape with size
//   at dim, src's dtype and device.
//
// float64 is refused by name: a 64-bit fixed-point sum holds about 46 bits below the largest term, fewer than
// float64 (segment_scatter_add sums it in a fixed order). Arguments are validated in Python before this op
// runs; the checks here guard direct torch.ops callers.
#include "fixed_point_scatter.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>
#include <optional>
#include <vector>

namespace deepep_lightning {

// Defined in segment_scatter.cpp.
std::vector<int64_t> segment_scatter_output_shape(const at::Tensor& src, const at::Tensor& index, int64_t size,
                                                  int64_t dim, const std::optional<at::Tensor>& base);

namespace fixed_point_scatter {

namespace {

template <typename index_t>
void accumulate_rows(const at::Tensor& src, const index_t* index, const Layout& layout, const Rows& rows, int s,
                     int64_t* sums, uint32_t* flags) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, src.scalar_type(), "fixed_point_scatter_add_cpu", [&] {
    const scalar_t* data = src.const_data_ptr<scalar_t>();
    const int64_t words = words_per_row(layout);
    for (int64_t t = 0; t < layout.outer * layout.entries * layout.inner; ++t) {
      const int64_t row = chunk_row(t, static_cast<int64_t>(index[entry_of(t, layout)]), layout, rows);
      if (row < 0) continue;
      const int64_t column = t % layout.inner;
      const double term = static_cast<double>(data[t]) * layout.alpha;
      if (std::isfinite(term)) {
        sums[row * layout.inner + column] += fixed_point::quantize(term, s);  // bounded: never wraps
      } else {
        flags[row * words + (column >> 2)] |= fixed_point::flag_of(term) << fixed_point::flag_shift(column);
      }
    }
  });
}

int scale_of(const at::Tensor& max_bits, const Layout& layout) {
  // M = largest |src| * |alpha|, as float (its rounding down is covered by the headroom of fixed_point_sum.h)
  return fixed_point::scale_exponent(
      static_cast<float>(fixed_point::max_finite_abs_of(max_bits) * std::fabs(layout.alpha)), layout.terms_bits);
}

void accumulate_cpu(const at::Tensor& src, const at::Tensor& index, const Layout& layout, const Rows& rows,
                    const at::Tensor& max_bits, at::Tensor& sums, at::Tensor& flags) {
  const int s = scale_of(max_bits, layout);
  auto* flag_data = reinterpret_cast<uint32_t*>(flags.data_ptr<int32_t>());
  if (index.scalar_type() == at::kLong) {
    accumulate_rows(src, index.const_data_ptr<int64_t>(), layout, rows, s, sums.data_ptr<int64_t>(), flag_data);
  } else {
    accumulate_rows(src, index.const_data_ptr<int32_t>(), layout, rows, s, sums.data_ptr<int64_t>(), flag_data);
  }
}

void finish_cpu(const Layout& layout, const Rows& rows, const at::Tensor& max_bits, at::Tensor& sums,
                at::Tensor& flags, at::Tensor& out) {
  const int s = scale_of(max_bits, layout);
  const int64_t* sum_data = sums.const_data_ptr<int64_t>();
  const auto* flag_data = reinterpret_cast<const uint32_t*>(flags.const_data_ptr<int32_t>());
  const int64_t words = words_per_row(layout);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "fixed_point_scatter_add_cpu", [&] {
    scalar_t* out_data = out.data_ptr<scalar_t>();
    for (int64_t row = 0; row < layout.outer * rows.count; ++row) {
      const int64_t o = row / rows.count;
      scalar_t* destination = out_data + (o * layout.size + rows.first + row % rows.count) * layout.inner;
      for (int64_t c = 0; c < layout.inner; ++c) {
        const uint32_t flag = (flag_data[row * words + (c >> 2)] >> fixed_point::flag_shift(c)) & 0xff;
        const float base = static_cast<float>(destination[c]);
        destination[c] = static_cast<scalar_t>(finished(base, sum_data[row * layout.inner + c], flag, s));
      }
    }
  });
  sums.zero_();
  flags.zero_();
}

const Launches kCpuLaunches{&fixed_point::max_finite_abs_cpu, &accumulate_cpu, &finish_cpu};

at::Tensor fixed_point_scatter_add_cpu(const at::Tensor& src, const at::Tensor& index, int64_t size, int64_t dim,
                                       const std::optional<at::Tensor>& base, double alpha) {
  TORCH_CHECK(src.is_cpu(), "fixed_point_scatter_add_cpu: src must be a CPU tensor, got ", src.device());
  return scatter_add_with(kCpuLaunches, src, index, size, dim, base, alpha);
}

}  // namespace

at::Tensor scatter_add_with(const Launches& launches, const at::Tensor& src, const at::Tensor& index, int64_t size,
                            int64_t dim, const std::optional<at::Tensor>& base, double alpha) {
  const std::vector<int64_t> shape = segment_scatter_output_shape(src, index, size, dim, base);
  TORCH_CHECK(src.scalar_type() == at::kFloat || src.scalar_type() == at::kHalf || src.scalar_type() == at::kBFloat16,
              "fixed_point_scatter_add: src must be float32, float16 or bfloat16, got ", src.scalar_type());
  at::Tensor out = base.has_value() ? base->clone(at::MemoryFormat::Contiguous) : at::zeros(shape, src.options());
  const int64_t outer = std::accumulate(shape.begin(), shape.begin() + dim, int64_t{1}, std::multiplies<>());
  const int64_t inner = std::accumulate(shape.begin() + dim + 1, shape.end(), int64_t{1}, std::multiplies<>());
  const int64_t entries = src.size(dim);
  if (out.numel() == 0 || entries == 0 || inner == 0 || outer == 0) return out;
  const Layout layout{outer, entries, size, inner, alpha, fixed_point::term_bits(entries)};
  const at::Tensor src_c = src.contiguous();
  const at::Tensor index_c = index.contiguous();
  at::Tensor max_bits = at::zeros({1}, at::TensorOptions().dtype(at::kInt).device(src.device()));
  launches.max_abs(src_c, max_bits);
  const int64_t rows_per_chunk =
      fixed_point::rows_per_chunk(size, outer * inner, out.numel() * static_cast<int64_t>(out.element_size()));
  at::Tensor sums = at::zeros({outer * rows_per_chunk, inner}, at::TensorOptions().dtype(at::kLong).device(src.device()));
  at::Tensor flags =
      at::zeros({outer * rows_per_chunk, words_per_row(layout)}, at::TensorOptions().dtype(at::kInt).device(src.device()));
  for (int64_t first = 0; first < size; first += rows_per_chunk) {
    const Rows rows{first, std::min(rows_per_chunk, size - first)};
    launches.accumulate(src_c, index_c, layout, rows, max_bits, sums, flags);
    launches.finish(layout, rows, max_bits, sums, flags, out);
  }
  return out;
}

TORCH_LIBRARY_FRAGMENT(deepep_lightning, m) {
  m.def(
      "fixed_point_scatter_add(Tensor src, Tensor index, int size, int dim=0, Tensor? base=None, float alpha=1.0) "
      "-> Tensor");
}

TORCH_LIBRARY_IMPL(deepep_lightning, CPU, m) { m.impl("fixed_point_scatter_add", &fixed_point_scatter_add_cpu); }

}  // namespace fixed_point_scatter

}  // namespace deepep_lightning
