// deepep_lightning::adaptive_avg_pool2d_backward / adaptive_avg_pool3d_backward: the backwards of
// aten::_adaptive_avg_pool2d / _adaptive_avg_pool3d (F.adaptive_avg_pool2d/3d, F.interpolate(mode="area")),
// whose CUDA kernels are refused under torch.use_deterministic_algorithms(True) (they scatter with
// float atomicAdd when windows overlap).
//
//   deepep_lightning::adaptive_avg_pool2d_backward(grad_output [.., OH, OW], self [.., H, W]) -> grad_input
//   deepep_lightning::adaptive_avg_pool3d_backward(grad_output [.., OD, OH, OW], self [.., D, H, W]) -> grad_input
//
// The CPU kernels are PyTorch's (already deterministic); the CUDA kernel
// (cuda/adaptive_avg_pool_backward.cu) gathers. Arguments are validated in Python
// (deepep_lightning/ops/adaptive_avg_pool.py) before these ops run; the checks guard direct callers.
#include <ATen/ATen.h>
#include <torch/library.h>

namespace deepep_lightning {

void check_adaptive_avg_pool_backward_args(const at::Tensor& grad_output, const at::Tensor& self, int64_t spatial) {
  TORCH_CHECK(self.dim() == spatial + 1 || self.dim() == spatial + 2, "adaptive_avg_pool", spatial,
              "d_backward: self must be ", spatial + 1, "-D or ", spatial + 2, "-D, got shape ", self.sizes());
  TORCH_CHECK(grad_output.dim() == self.dim() && grad_output.scalar_type() == self.scalar_type() &&
                  grad_output.sizes().slice(0, self.dim() - spatial) == self.sizes().slice(0, self.dim() - spatial),
              "adaptive_avg_pool", spatial, "d_backward: grad_output must match self ", self.sizes(),
              " in its leading dims and dtype, got ", grad_output.sizes(), " ", grad_output.scalar_type());
  TORCH_CHECK(at::isFloatingType(self.scalar_type()), "adaptive_avg_pool", spatial,
              "d_backward: self must be floating point, got ", self.scalar_type());
}

namespace {

at::Tensor adaptive_avg_pool2d_backward_cpu(const at::Tensor& grad_output, const at::Tensor& self) {
  check_adaptive_avg_pool_backward_args(grad_output, self, 2);
  return at::_adaptive_avg_pool2d_backward(grad_output, self);
}

at::Tensor adaptive_avg_pool3d_backward_cpu(const at::Tensor& grad_output, const at::Tensor& self) {
  check_adaptive_avg_pool_backward_args(grad_output, self, 3);
  return at::_adaptive_avg_pool3d_backward(grad_output, self);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(deepep_lightning, m) {
  m.def("adaptive_avg_pool2d_backward(Tensor grad_output, Tensor self) -> Tensor");
  m.def("adaptive_avg_pool3d_backward(Tensor grad_output, Tensor self) -> Tensor");
}

TORCH_LIBRARY_IMPL(deepep_lightning, CPU, m) {
  m.impl("adaptive_avg_pool2d_backward", &adaptive_avg_pool2d_backward_cpu);
  m.impl("adaptive_avg_pool3d_backward", &adaptive_avg_pool3d_backward_cpu);
}

}  // namespace deepep_lightning
