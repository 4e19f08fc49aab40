// deepep_lightning::nll_loss2d_forward: the forward of aten::nll_loss2d_forward (4-D F.nll_loss /
// F.cross_entropy) whose CUDA kernel is refused under torch.use_deterministic_algorithms(True) for
// reduction "mean"/"sum" (PyTorch adds per-block partial sums into the output with atomicAdd).
//
//   deepep_lightning::nll_loss2d_forward(self [N, C, H, W], target [N, H, W] int64, weight [C]?, reduction,
//                              ignore_index) -> (output, total_weight)
//
// Same schema and results as aten's. The CPU kernel is PyTorch's (already deterministic); the CUDA
// kernel (cuda/nll_loss2d_forward.cu) is a fixed-order two-pass block reduction. Arguments are
// validated in Python (deepep_lightning/ops/nll_loss2d.py) before this op runs; the checks here
// guard direct callers.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

namespace deepep_lightning {

void check_nll_loss2d_args(const at::Tensor& self, const at::Tensor& target, const std::optional<at::Tensor>& weight,
                           int64_t reduction) {
  TORCH_CHECK(self.dim() == 4, "nll_loss2d_forward: self must be 4-D [N, C, H, W], got shape ", self.sizes());
  TORCH_CHECK(target.dim() == 3 && target.size(0) == self.size(0) && target.size(1) == self.size(2) &&
                  target.size(2) == self.size(3),
              "nll_loss2d_forward: target must be [N, H, W] matching self ", self.sizes(), ", got ", target.sizes());
  TORCH_CHECK(target.scalar_type() == at::kLong, "nll_loss2d_forward: target must be int64, got ",
              target.scalar_type());
  TORCH_CHECK(at::isFloatingType(self.scalar_type()), "nll_loss2d_forward: self must be floating point, got ",
              self.scalar_type());
  TORCH_CHECK(reduction >= 0 && reduction <= 2, "nll_loss2d_forward: reduction must be 0 (none), 1 (mean) or 2 (sum), got ",
              reduction);
  if (weight.has_value() && weight->defined()) {
    TORCH_CHECK(weight->dim() == 1 && weight->numel() == self.size(1) && weight->scalar_type() == self.scalar_type(),
                "nll_loss2d_forward: weight must be [C] = [", self.size(1), "] of self's dtype, got ", weight->sizes(),
                " ", weight->scalar_type());
  }
}

namespace {

std::tuple<at::Tensor, at::Tensor> nll_loss2d_forward_cpu(const at::Tensor& self, const at::Tensor& target,
                                                          const std::optional<at::Tensor>& weight, int64_t reduction,
                                                          int64_t ignore_index) {
  check_nll_loss2d_args(self, target, weight, reduction);
  return at::nll_loss2d_forward(self, target, weight, reduction, ignore_index);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(deepep_lightning, m) {
  m.def(
      "nll_loss2d_forward(Tensor self, Tensor target, Tensor? weight, int reduction, int ignore_index) -> "
      "(Tensor output, Tensor total_weight)");
}

TORCH_LIBRARY_IMPL(deepep_lightning, CPU, m) { m.impl("nll_loss2d_forward", &nll_loss2d_forward_cpu); }

}  // namespace deepep_lightning
