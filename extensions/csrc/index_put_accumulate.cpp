// deepep_lightning::index_put_accumulate_: self[indices] += values, deterministic, in one op.
//
//   index_put_accumulate_(self, indices, values) == self.index_put_(indices, values, accumulate=True)
//   self     [*lead, *inner], floating point, k = len(indices) leading dimensions indexed
//   indices  k int64/int32 tensors that broadcast together to index_shape, values in [-size, size) of their
//            dimension (negative ones count from the end, as in PyTorch)
//   values   broadcastable to index_shape + inner, self's dtype
//
// It is the deterministic `_index_put_impl_(accumulate=True)` route's whole work (deepep_lightning/ops/
// scatter.py), in one op because a host-bound step (an MoE's per-expert gathers) pays the route's host time in
// full: built in Python, the row index (a wrap, a bounds check and a multiply-add per index tensor) and the copy
// back into self take about 25 op calls, ~190 us of host time per call. The CUDA kernel (cuda/segment_scatter.cu)
// computes the row of every entry in one launch and sums straight into self; the CPU kernel is PyTorch's
// sequential index_add_ on the same rows, deterministic already.
//
// The arguments are validated in Python before the route calls this op; the checks here guard direct callers.
#include "index_put_accumulate.h"

#include <ATen/ExpandUtils.h>
#include <torch/library.h>

namespace deepep_lightning {

IndexPutShape index_put_shape(const at::Tensor& self, at::TensorList indices, const at::Tensor& values) {
  const auto k = static_cast<int64_t>(indices.size());
  TORCH_CHECK(k >= 1 && k <= self.dim() && k <= kMaxIndexTensors, "index_put_accumulate_: indices must hold 1 to ",
              std::min<int64_t>(self.dim(), kMaxIndexTensors), " tensors for self of shape ", self.sizes(), ", got ",
              k);
  TORCH_CHECK(at::isFloatingType(self.scalar_type()), "index_put_accumulate_: self must be floating point, got ",
              self.scalar_type());
  TORCH_CHECK(values.scalar_type() == self.scalar_type() && values.device() == self.device(),
              "index_put_accumulate_: values must be ", self.scalar_type(), " on ", self.device(), ", got ",
              values.scalar_type(), " on ", values.device());
  IndexPutShape shape;
  for (int64_t j = 0; j < k; ++j) {
    const at::Tensor& index = indices[j];
    TORCH_CHECK(index.scalar_type() == at::kLong || index.scalar_type() == at::kInt,
                "index_put_accumulate_: indices[", j, "] must be int64 or int32, got ", index.scalar_type());
    TORCH_CHECK(index.device() == self.device(), "index_put_accumulate_: indices[", j, "] must be on ",
                self.device(), ", got ", index.device());
    shape.index_shape = j == 0 ? index.sizes().vec() : at::infer_size(shape.index_shape, index.sizes());
    shape.rows *= self.size(j);
  }
  TORCH_CHECK(static_cast<int64_t>(shape.index_shape.size()) <= kMaxIndexDims,
              "index_put_accumulate_: the indices broadcast to ", at::IntArrayRef(shape.index_shape), ", more than ",
              kMaxIndexDims, " dimensions");
  for (const int64_t extent : shape.index_shape) shape.entries *= extent;
  shape.inner = self.sizes().slice(k).vec();
  std::vector<int64_t> target = shape.index_shape;
  target.insert(target.end(), shape.inner.begin(), shape.inner.end());
  TORCH_CHECK(at::infer_size(target, values.sizes()) == target, "index_put_accumulate_: values of shape ",
              values.sizes(), " do not broadcast to the indexed shape ", at::IntArrayRef(target));
  return shape;
}

at::Tensor index_put_rows(const IndexPutShape& shape, const at::Tensor& values) {
  std::vector<int64_t> target = shape.index_shape;
  target.insert(target.end(), shape.inner.begin(), shape.inner.end());
  std::vector<int64_t> rows = {shape.entries};
  rows.insert(rows.end(), shape.inner.begin(), shape.inner.end());
  return values.expand(target).reshape(rows);
}

namespace {

void index_put_accumulate_cpu_(const at::Tensor& self, at::TensorList indices, const at::Tensor& values) {
  const IndexPutShape shape = index_put_shape(self, indices, values);
  if (shape.entries == 0 || self.numel() == 0) return;
  at::Tensor flat;
  for (size_t j = 0; j < indices.size(); ++j) {
    const int64_t extent = self.size(static_cast<int64_t>(j));
    const at::Tensor index = indices[j].to(at::kLong).expand(shape.index_shape).reshape({shape.entries});
    TORCH_CHECK(index.ge(-extent).logical_and(index.lt(extent)).all().item<bool>(),
                "index_put_accumulate_: index out of range: indices[", j, "] has a value outside [", -extent, ", ",
                extent, ")");
    const at::Tensor wrapped = at::where(index.lt(0), index + extent, index);
    flat = flat.defined() ? flat * extent + wrapped : wrapped;
  }
  std::vector<int64_t> row_view = {shape.rows};
  row_view.insert(row_view.end(), shape.inner.begin(), shape.inner.end());
  const at::Tensor rows = index_put_rows(shape, values);
  if (self.is_contiguous()) {
    self.view(row_view).index_add_(0, flat, rows);
  } else {
    at::Tensor sum = self.contiguous();
    sum.view(row_view).index_add_(0, flat, rows);
    self.copy_(sum);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(deepep_lightning, m) {
  // No alias-annotated output: torch.compile functionalizes a custom op's mutation only without one.
  m.def("index_put_accumulate_(Tensor(a!) self, Tensor[] indices, Tensor values) -> ()");
}

TORCH_LIBRARY_IMPL(deepep_lightning, CPU, m) { m.impl("index_put_accumulate_", &index_put_accumulate_cpu_); }

}  // namespace deepep_lightning
