// deepep_lightning::segment_reduce: the product, maximum, minimum or mean of the rows of `values` that share a key.
//
//   segment_reduce(values [n, inner], keys [n], size, reduce, base [size, inner]?, include_base)
//       -> (out [size, inner], counts [size] int64)
//
// The op sorts the keys stably (entry order kept within a key), finds each row's segment of the sorted
// entries by binary search, and reduces: out[r, j] combines values[e, j] over the entries e with key r,
// from left to right in entry order, starting from base[r, j] with `base` and `include_base`
// (index_reduce's include_self), so every output element is reduced by one thread in one fixed order:
// no atomics, bitwise reproducible, and the order is that of PyTorch's sequential CPU kernels. A row
// without entries is base[r, j], or 1 ("prod") / 0 without `base`. A mean divides the sum by the entry count
// (plus one for the base): see segment_mean for its types.
// Products are plain products in the values' dtype (zeros, signs, integer wrap-around as PyTorch's); maxima
// and minima propagate NaN. A key outside [0, size) is an error (CPU: c10::Error; CUDA: a device assert).
// One op call for what would otherwise be a sort, two binary searches, a range check and the combine with
// `base` as separate PyTorch ops: the sort, one bounds launch and one reduce launch on CUDA.
// The Python layer (deepep_lightning/ops/segments.py) validates before this op runs (DESIGN.md section 7);
// the checks here guard direct torch.ops callers.
#include "segment_reduce.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

namespace deepep_lightning {

SegmentReduction check_segment_reduce_inputs(const at::Tensor& values, const at::Tensor& keys, int64_t size,
                                             c10::string_view reduce, const std::optional<at::Tensor>& base) {
  const char* op = "deepep_lightning::segment_reduce";
  SegmentReduction reduction = SegmentReduction::kProd;
  if (reduce == "amax") {
    reduction = SegmentReduction::kMax;
  } else if (reduce == "amin") {
    reduction = SegmentReduction::kMin;
  } else if (reduce == "mean") {
    reduction = SegmentReduction::kMean;
  } else {
    TORCH_CHECK(reduce == "prod", op, ": reduce must be 'prod', 'amax', 'amin' or 'mean', got '", reduce, "'");
  }
  TORCH_CHECK(values.dim() == 2, op, ": values must be 2-D [n, inner], got shape ", values.sizes());
  TORCH_CHECK(keys.dim() == 1 && keys.size(0) == values.size(0), op, ": keys must be [", values.size(0), "], got ",
              keys.sizes());
  TORCH_CHECK((keys.scalar_type() == at::kLong || keys.scalar_type() == at::kInt) && keys.device() == values.device(),
              op, ": keys must be int64 or int32 on values' device ", values.device(), ", got ", keys.scalar_type(),
              " on ", keys.device());
  TORCH_CHECK(size >= 0, op, ": size must be >= 0, got ", size);
  if (base.has_value()) {
    TORCH_CHECK(base->dim() == 2 && base->size(0) == size && base->size(1) == values.size(1), op,
                ": base must be [", size, ", ", values.size(1), "], got ", base->sizes());
    TORCH_CHECK(base->scalar_type() == values.scalar_type() && base->device() == values.device(), op,
                ": base must have values' dtype ", values.scalar_type(), " and device ", values.device(), ", got ",
                base->scalar_type(), " on ", base->device());
  }
  return reduction;
}

std::tuple<at::Tensor, at::Tensor> sort_segment_keys(const at::Tensor& keys) {
  const std::tuple<at::Tensor, at::Tensor> sorted =
      at::sort(keys.to(at::kLong), /*stable=*/true, /*dim=*/0, /*descending=*/false);
  return {std::get<0>(sorted).contiguous(), std::get<1>(sorted).contiguous()};
}

namespace {

// Rows per parallel_for task; the result of a row never depends on it.
constexpr int64_t kRowGrain = 64;

std::tuple<at::Tensor, at::Tensor> segment_reduce_cpu(const at::Tensor& values, const at::Tensor& keys,
                                                      int64_t size, c10::string_view reduce,
                                                      const std::optional<at::Tensor>& base, bool include_base) {
  const SegmentReduction reduction = check_segment_reduce_inputs(values, keys, size, reduce, base);
  const at::Tensor values_c = values.contiguous();
  const at::Tensor base_c = base.has_value() ? base->contiguous() : at::Tensor();
  at::Tensor sorted_keys, order;
  std::tie(sorted_keys, order) = sort_segment_keys(keys);
  const int64_t n = sorted_keys.size(0);
  const int64_t* sorted = sorted_keys.data_ptr<int64_t>();
  TORCH_CHECK(n == 0 || (sorted[0] >= 0 && sorted[n - 1] < size), "deepep_lightning::segment_reduce: index out of range [0, ",
              size, ")");
  at::Tensor starts = at::empty({size}, keys.options().dtype(at::kLong));
  at::Tensor counts = at::empty({size}, keys.options().dtype(at::kLong));
  int64_t* s = starts.data_ptr<int64_t>();
  int64_t* c = counts.data_ptr<int64_t>();
  at::parallel_for(0, size, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) segment_bounds_element(row, n, sorted, s, c);
  });
  const int64_t inner = values_c.size(1);
  at::Tensor out = at::empty({size, inner}, values_c.options());
  AT_DISPATCH_ALL_TYPES_AND2(at::kHalf, at::kBFloat16, values_c.scalar_type(), "segment_reduce_cpu", [&] {
    const scalar_t* v = values_c.data_ptr<scalar_t>();
    const int64_t* o = order.data_ptr<int64_t>();
    const scalar_t* b = base_c.defined() ? base_c.data_ptr<scalar_t>() : nullptr;
    scalar_t* result = out.data_ptr<scalar_t>();
    at::parallel_for(0, size, kRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row) {
        for (int64_t column = 0; column < inner; ++column) {
          segment_reduce_element<scalar_t>(row, column, inner, v, o, s, c, b, include_base, reduction, result);
        }
      }
    });
  });
  return {out, counts};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(deepep_lightning, m) {
  m.def(
      "segment_reduce(Tensor values, Tensor keys, int size, str reduce, Tensor? base=None, bool include_base=True)"
      " -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(deepep_lightning, CPU, m) { m.impl("segment_reduce", &segment_reduce_cpu); }

}  // namespace deepep_lightning
