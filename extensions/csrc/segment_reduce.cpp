// deepep::segment_reduce: the product, maximum or minimum of the rows of `values` that share a key.
//
//   segment_reduce(values [n, inner], order [n], starts [size], counts [size], reduce) -> [size, inner]
//
// `order` lists the entries in key order (a stable sort of the keys: entry order kept within a key) and
// row r's entries are order[starts[r] .. starts[r] + counts[r]). out[r, j] combines values[order[k], j]
// over those k from left to right, so every output element is reduced by one thread in one fixed order:
// no atomics, bitwise reproducible, and the order (entry order) is that of PyTorch's sequential CPU
// kernels. Products are plain products in the values' dtype (zeros, signs, integer wrap-around as
// PyTorch's); maxima and minima propagate NaN. A row without entries is 1 ("prod") or 0.
// The Python layer (deepep_lightning/ops/segments.py) sorts the keys and validates before this op runs
// (DESIGN.md section 7); the checks here guard direct torch.ops callers.
#include "segment_reduce.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

namespace deepep {

SegmentReduction check_segment_reduce_inputs(const at::Tensor& values, const at::Tensor& order,
                                             const at::Tensor& starts, const at::Tensor& counts,
                                             c10::string_view reduce) {
  const char* op = "deepep::segment_reduce";
  SegmentReduction reduction = SegmentReduction::kProd;
  if (reduce == "amax") {
    reduction = SegmentReduction::kMax;
  } else if (reduce == "amin") {
    reduction = SegmentReduction::kMin;
  } else {
    TORCH_CHECK(reduce == "prod", op, ": reduce must be 'prod', 'amax' or 'amin', got '", reduce, "'");
  }
  TORCH_CHECK(values.dim() == 2, op, ": values must be 2-D [n, inner], got shape ", values.sizes());
  TORCH_CHECK(order.dim() == 1 && order.size(0) == values.size(0), op, ": order must be [", values.size(0),
              "], got ", order.sizes());
  TORCH_CHECK(starts.dim() == 1 && counts.sizes() == starts.sizes(), op,
              ": starts and counts must be 1-D of one length, got ", starts.sizes(), " and ", counts.sizes());
  for (const at::Tensor* index : {&order, &starts, &counts}) {
    TORCH_CHECK(index->scalar_type() == at::kLong && index->device() == values.device(), op,
                ": order, starts and counts must be int64 on values' device ", values.device(), ", got ",
                index->scalar_type(), " on ", index->device());
  }
  return reduction;
}

namespace {

// Rows per parallel_for task; the result of a row never depends on it.
constexpr int64_t kRowGrain = 64;

at::Tensor segment_reduce_cpu(const at::Tensor& values, const at::Tensor& order, const at::Tensor& starts,
                              const at::Tensor& counts, c10::string_view reduce) {
  const SegmentReduction reduction = check_segment_reduce_inputs(values, order, starts, counts, reduce);
  const at::Tensor values_c = values.contiguous(), order_c = order.contiguous();
  const at::Tensor starts_c = starts.contiguous(), counts_c = counts.contiguous();
  const int64_t size = starts_c.size(0);
  const int64_t inner = values_c.size(1);
  at::Tensor out = at::empty({size, inner}, values_c.options());
  AT_DISPATCH_ALL_TYPES_AND2(at::kHalf, at::kBFloat16, values_c.scalar_type(), "segment_reduce_cpu", [&] {
    const scalar_t* v = values_c.data_ptr<scalar_t>();
    const int64_t* o = order_c.data_ptr<int64_t>();
    const int64_t* s = starts_c.data_ptr<int64_t>();
    const int64_t* c = counts_c.data_ptr<int64_t>();
    scalar_t* result = out.data_ptr<scalar_t>();
    at::parallel_for(0, size, kRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row) {
        for (int64_t column = 0; column < inner; ++column) {
          segment_reduce_element<scalar_t>(row, column, inner, v, o, s, c, reduction, result);
        }
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(deepep, m) {
  m.def("segment_reduce(Tensor values, Tensor order, Tensor starts, Tensor counts, str reduce) -> Tensor");
}

TORCH_LIBRARY_IMPL(deepep, CPU, m) { m.impl("segment_reduce", &segment_reduce_cpu); }

}  // namespace deepep
