// deepep_lightning::reflection_pad_backward / replication_pad_backward: the backwards of aten::reflection_pad{1,2,3}d
// and aten::replication_pad{1,2,3}d, whose CUDA kernels are refused under
// torch.use_deterministic_algorithms(True) (they scatter the padded border with atomicAdd).
//
//   deepep_lightning::<mode>_pad_backward(grad_output, self, int[] padding) -> grad_input
//
// padding as aten's: 2, 4 or 6 entries (left, right[, top, bottom[, front, back]]), last dim first; the
// spatial rank is len(padding) / 2. The CPU kernels are PyTorch's; the CUDA kernel (cuda/pad_backward.cu)
// gathers. Arguments are validated in Python (deepep_lightning/ops/pad.py); the checks guard direct callers.
#include <ATen/ATen.h>
#include <torch/library.h>

namespace deepep_lightning {

void check_pad_backward_args(const at::Tensor& grad_output, const at::Tensor& self, at::IntArrayRef padding,
                             bool reflect) {
  const int64_t spatial = static_cast<int64_t>(padding.size()) / 2;
  TORCH_CHECK(padding.size() == 2 || padding.size() == 4 || padding.size() == 6,
              "pad_backward: padding must have 2, 4 or 6 entries, got ", padding);
  TORCH_CHECK(self.dim() == spatial + 1 || self.dim() == spatial + 2, "pad_backward: self must be ", spatial + 1,
              "-D or ", spatial + 2, "-D for ", padding.size(), " padding entries, got shape ", self.sizes());
  TORCH_CHECK(grad_output.dim() == self.dim() && grad_output.scalar_type() == self.scalar_type(),
              "pad_backward: grad_output must have self's rank and dtype, got ", grad_output.sizes());
  for (int64_t i = 0; i < spatial; ++i) {
    const int64_t in = self.size(self.dim() - 1 - i), left = padding[2 * i], right = padding[2 * i + 1];
    TORCH_CHECK(left >= 0 && right >= 0 && grad_output.size(self.dim() - 1 - i) == in + left + right,
                "pad_backward: padding must be non-negative and grad_output must be self padded by it, got padding ",
                padding, ", self ", self.sizes(), ", grad_output ", grad_output.sizes());
    TORCH_CHECK(!reflect || (left < in && right < in), "pad_backward: reflection padding must be below the input size, "
                "got padding ", padding, " for self ", self.sizes());
  }
}

namespace {

at::Tensor reflection_pad_backward_cpu(const at::Tensor& grad_output, const at::Tensor& self, at::IntArrayRef padding) {
  check_pad_backward_args(grad_output, self, padding, true);
  switch (padding.size()) {
    case 2: return at::reflection_pad1d_backward(grad_output, self, padding);
    case 4: return at::reflection_pad2d_backward(grad_output, self, padding);
    default: return at::reflection_pad3d_backward(grad_output, self, padding);
  }
}

at::Tensor replication_pad_backward_cpu(const at::Tensor& grad_output, const at::Tensor& self, at::IntArrayRef padding) {
  check_pad_backward_args(grad_output, self, padding, false);
  switch (padding.size()) {
    case 2: return at::replication_pad1d_backward(grad_output, self, padding);
    case 4: return at::replication_pad2d_backward(grad_output, self, padding);
    default: return at::replication_pad3d_backward(grad_output, self, padding);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(deepep_lightning, m) {
  m.def("reflection_pad_backward(Tensor grad_output, Tensor self, int[] padding) -> Tensor");
  m.def("replication_pad_backward(Tensor grad_output, Tensor self, int[] padding) -> Tensor");
}

TORCH_LIBRARY_IMPL(deepep_lightning, CPU, m) {
  m.impl("reflection_pad_backward", &reflection_pad_backward_cpu);
  m.impl("replication_pad_backward", &replication_pad_backward_cpu);
}

}  // namespace deepep_lightning
