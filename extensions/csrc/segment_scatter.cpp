// deepep_lightning::segment_scatter_add: a deterministic scatter-add along one dimension.
//
//   segment_scatter_add(src, index, size, dim=0, base=None, alpha=1.0)
//     == (base.clone() if base is given else zeros(out_shape)).index_add_(dim, index, src, alpha=alpha)
//   src    [*outer, n, *inner]   (n = src.size(dim)), floating point
//   index  [n]                   int64 or int32, values in [0, size)
//   base   [*outer, size, *inner], src's dtype and device, or None (zeros)
//   out    [*outer, size, *inner]
//   plan   int32 [2 n + size + 1] from segment_sort_plan(index, size), or None (the op sorts index itself)
//
//   segment_sort_plan(index, size) -> int32 [2 n + size + 1], the sort of index that the CUDA kernel sums in:
//     [0, n)           the keys index[i] in ascending order (stable)
//     [n, 2 n)         the entry ids i in that order (equal keys keep entry order)
//     [2 n, 3 n + 1)   segment_start[r] = the first sorted position whose key is >= r, r in [0, size]
//   A function of index and size alone, so a caller that scatters along one index several times (a graph
//   network's layers, forward and backward) sorts it once and passes the plan (deepep_lightning/ops/
//   sort_plans.py). The CPU kernel checks a plan's shape and does not need it.
//
// It is the one scatter-add that the argmax-scatter backwards (max pooling, fractional / adaptive
// max pooling, embedding_bag mode "max") and the index_add_ / scatter_add_ / index_put_(accumulate)
// routes are written with (deepep_lightning/ops/scatter.py, max_pool.py). PyTorch's CUDA index_add_
// adds with float atomicAdd, whose order changes from run to run; the CUDA kernel here
// (cuda/segment_scatter.cu) sorts the indices stably and sums every output element in a fixed
// order, so it is bitwise reproducible. The CPU kernel is PyTorch's CPU index_add_, a sequential
// loop, deterministic already.
//
// The arguments are validated in Python before this op runs (an exception thrown inside the
// compiled library crashes torch 2.11 on the GPU image, DESIGN.md section 7); the checks here
// guard direct torch.ops callers.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace deepep_lightning {

std::vector<int64_t> segment_scatter_output_shape(const at::Tensor& src, const at::Tensor& index, int64_t size,
                                                  int64_t dim, const std::optional<at::Tensor>& base) {
  TORCH_CHECK(src.dim() >= 1, "segment_scatter_add: src must have at least 1 dimension, got shape ", src.sizes());
  TORCH_CHECK(dim >= 0 && dim < src.dim(), "segment_scatter_add: dim must be in [0, ", src.dim(), "), got ", dim);
  TORCH_CHECK(at::isFloatingType(src.scalar_type()), "segment_scatter_add: src must be floating point, got ",
              src.scalar_type());
  TORCH_CHECK(index.dim() == 1 && index.size(0) == src.size(dim),
              "segment_scatter_add: index must be 1-D of length src.size(dim) = ", src.size(dim), ", got shape ",
              index.sizes());
  TORCH_CHECK(index.scalar_type() == at::kLong || index.scalar_type() == at::kInt,
              "segment_scatter_add: index must be int64 or int32, got ", index.scalar_type());
  TORCH_CHECK(index.device() == src.device(), "segment_scatter_add: index must be on src's device ", src.device(),
              ", got ", index.device());
  TORCH_CHECK(size >= 0, "segment_scatter_add: size must be >= 0, got ", size);
  std::vector<int64_t> shape = src.sizes().vec();
  shape[dim] = size;
  if (base.has_value()) {
    TORCH_CHECK(base->sizes() == at::IntArrayRef(shape) && base->scalar_type() == src.scalar_type() &&
                    base->device() == src.device(),
                "segment_scatter_add: base must be ", at::IntArrayRef(shape), " ", src.scalar_type(), " on ",
                src.device(), ", got ", base->sizes(), " ", base->scalar_type(), " on ", base->device());
  }
  return shape;
}

void check_sort_plan(const std::optional<at::Tensor>& plan, const at::Tensor& index, int64_t size) {
  if (!plan.has_value()) return;
  TORCH_CHECK(plan->scalar_type() == at::kInt && plan->dim() == 1 && plan->is_contiguous() &&
                  plan->numel() == 2 * index.numel() + size + 1 && plan->device() == index.device(),
              "segment_scatter_add: plan must be the contiguous int32 [", 2 * index.numel() + size + 1,
              "] of segment_sort_plan(index, size) on ", index.device(), ", got ", plan->scalar_type(), " ",
              plan->sizes(), " on ", plan->device());
}

namespace {

at::Tensor segment_sort_plan_cpu(const at::Tensor& index, int64_t size) {
  TORCH_CHECK(index.dim() == 1 && (index.scalar_type() == at::kLong || index.scalar_type() == at::kInt),
              "segment_sort_plan: index must be 1-D int64 or int32, got ", index.scalar_type(), " ", index.sizes());
  TORCH_CHECK(size >= 0 && size < INT32_MAX && index.numel() < INT32_MAX,
              "segment_sort_plan: size and index.numel() must be below 2^31 - 1, got ", size, " and ", index.numel());
  const at::Tensor keys = index.to(at::kLong);
  TORCH_CHECK(index.numel() == 0 || (keys.min().item<int64_t>() >= 0 && keys.max().item<int64_t>() < size),
              "segment_sort_plan: index must lie in [0, ", size, ")");
  const auto [sorted, order] = keys.sort(/*stable=*/std::optional<bool>(true), /*dim=*/0, /*descending=*/false);
  const at::Tensor starts = at::searchsorted(sorted, at::arange(size + 1, keys.options()));
  return at::cat({sorted, order, starts}).to(at::kInt);
}

at::Tensor segment_scatter_add_cpu(const at::Tensor& src, const at::Tensor& index, int64_t size, int64_t dim,
                                   const std::optional<at::Tensor>& base, double alpha,
                                   const std::optional<at::Tensor>& plan) {
  const std::vector<int64_t> shape = segment_scatter_output_shape(src, index, size, dim, base);
  check_sort_plan(plan, index, size);
  at::Tensor out = base.has_value() ? base->clone(at::MemoryFormat::Contiguous) : at::zeros(shape, src.options());
  return out.index_add_(dim, index, src, alpha);
}

void segment_scatter_add_inplace_cpu(const at::Tensor& self, const at::Tensor& src, const at::Tensor& index,
                                     int64_t dim, double alpha, const std::optional<at::Tensor>& plan) {
  segment_scatter_output_shape(src, index, self.dim() > dim ? self.size(dim) : 0, dim, self);
  check_sort_plan(plan, index, self.size(dim));
  self.index_add_(dim, index, src, alpha);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(deepep_lightning, m) {
  m.def(
      "segment_scatter_add(Tensor src, Tensor index, int size, int dim=0, Tensor? base=None, float alpha=1.0, "
      "Tensor? plan=None) -> Tensor");
  // self.index_add_(dim, index, src, alpha=alpha), deterministic: the sums written into self (in place where
  // self is contiguous and src does not overlap it, on CUDA). No output: torch.compile functionalizes a custom
  // op's mutation only without an alias-annotated one.
  m.def(
      "segment_scatter_add_(Tensor(a!) self, Tensor src, Tensor index, int dim=0, float alpha=1.0, "
      "Tensor? plan=None) -> ()");
  m.def("segment_sort_plan(Tensor index, int size) -> Tensor");
}

TORCH_LIBRARY_IMPL(deepep_lightning, CPU, m) {
  m.impl("segment_scatter_add", &segment_scatter_add_cpu);
  m.impl("segment_scatter_add_", &segment_scatter_add_inplace_cpu);
  m.impl("segment_sort_plan", &segment_sort_plan_cpu);
}

}  // namespace deepep_lightning
