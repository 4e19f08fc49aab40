// deepep_lightning::avg_pool3d_backward: the backward of aten::avg_pool3d (F.avg_pool3d, nn.AvgPool3d), whose
// CUDA kernel is refused under torch.use_deterministic_algorithms(True) (it scatters with atomicAdd).
// Same schema as aten's, with kernel_size / stride / padding already expanded to 3 entries.
// The CPU kernel is PyTorch's; the CUDA kernel (cuda/avg_pool3d_backward.cu) gathers. Arguments are
// validated in Python (deepep_lightning/ops/avg_pool3d.py); the checks here guard direct callers.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>

namespace deepep_lightning {

void check_avg_pool3d_backward_args(const at::Tensor& grad_output, const at::Tensor& self, at::IntArrayRef kernel_size,
                                    at::IntArrayRef stride, at::IntArrayRef padding) {
  TORCH_CHECK(self.dim() == 4 || self.dim() == 5, "avg_pool3d_backward: self must be 4-D or 5-D, got shape ",
              self.sizes());
  TORCH_CHECK(grad_output.dim() == self.dim() && grad_output.scalar_type() == self.scalar_type(),
              "avg_pool3d_backward: grad_output must have self's rank and dtype, got ", grad_output.sizes(), " ",
              grad_output.scalar_type());
  TORCH_CHECK(kernel_size.size() == 3 && stride.size() == 3 && padding.size() == 3,
              "avg_pool3d_backward: kernel_size, stride and padding must have 3 entries, got ", kernel_size, ", ",
              stride, ", ", padding);
  for (int i = 0; i < 3; ++i) {
    TORCH_CHECK(kernel_size[i] > 0 && stride[i] > 0 && padding[i] >= 0 && padding[i] <= kernel_size[i] / 2,
                "avg_pool3d_backward: need kernel_size > 0, stride > 0, 0 <= padding <= kernel_size / 2, got ",
                kernel_size, ", ", stride, ", ", padding);
  }
}

namespace {

at::Tensor avg_pool3d_backward_cpu(const at::Tensor& grad_output, const at::Tensor& self, at::IntArrayRef kernel_size,
                                   at::IntArrayRef stride, at::IntArrayRef padding, bool ceil_mode,
                                   bool count_include_pad, std::optional<int64_t> divisor_override) {
  check_avg_pool3d_backward_args(grad_output, self, kernel_size, stride, padding);
  return at::avg_pool3d_backward(grad_output, self, kernel_size, stride, padding, ceil_mode, count_include_pad,
                                 divisor_override);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(deepep_lightning, m) {
  m.def(
      "avg_pool3d_backward(Tensor grad_output, Tensor self, int[3] kernel_size, int[3] stride, int[3] padding, "
      "bool ceil_mode, bool count_include_pad, int? divisor_override) -> Tensor");
}

TORCH_LIBRARY_IMPL(deepep_lightning, CPU, m) { m.impl("avg_pool3d_backward", &avg_pool3d_backward_cpu); }

}  // namespace deepep_lightning
