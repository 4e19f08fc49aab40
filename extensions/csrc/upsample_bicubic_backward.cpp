// deepep_lightning::upsample_bicubic2d_backward: the backward of aten::upsample_bicubic2d (F.interpolate(mode="bicubic"),
// 4-D input, antialias=False), whose CUDA kernel is refused under torch.use_deterministic_algorithms(True)
// (it scatters 16 taps per output with atomicAdd).
//
//   deepep_lightning::upsample_bicubic2d_backward(grad_output [N, C, OH, OW], int[4] input_size, bool align_corners,
//                                       float? scale_h, float? scale_w) -> grad_input [N, C, H, W]
//
// The CPU kernel is PyTorch's (already deterministic); the CUDA kernel (cuda/upsample_bicubic_backward.cu)
// gathers. Arguments are validated in Python (deepep_lightning/ops/interpolate.py) before this op runs; the
// checks guard direct callers.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>

namespace deepep_lightning {

void check_upsample_bicubic_args(const at::Tensor& grad_output, at::IntArrayRef input_size) {
  TORCH_CHECK(input_size.size() == 4, "upsample_bicubic2d_backward: input_size must have 4 entries "
              "[N, C, H_in, W_in], got ", input_size);
  TORCH_CHECK(grad_output.dim() == 4 && grad_output.size(0) == input_size[0] && grad_output.size(1) == input_size[1],
              "upsample_bicubic2d_backward: grad_output must be [", input_size[0], ", ", input_size[1],
              ", H_out, W_out], got shape ", grad_output.sizes());
  TORCH_CHECK(input_size[2] > 0 && input_size[3] > 0, "upsample_bicubic2d_backward: input_size must have "
              "non-empty H_in, W_in, got ", input_size);
  TORCH_CHECK(at::isFloatingType(grad_output.scalar_type()),
              "upsample_bicubic2d_backward: grad_output must be floating point, got ", grad_output.scalar_type());
}

namespace {

at::Tensor upsample_bicubic2d_backward_cpu(const at::Tensor& grad_output, at::IntArrayRef input_size,
                                           bool align_corners, std::optional<double> scale_h,
                                           std::optional<double> scale_w) {
  check_upsample_bicubic_args(grad_output, input_size);
  return at::upsample_bicubic2d_backward(grad_output, grad_output.sizes().slice(2), input_size, align_corners,
                                         scale_h, scale_w);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(deepep_lightning, m) {
  m.def("upsample_bicubic2d_backward(Tensor grad_output, int[4] input_size, bool align_corners, float? scale_h, "
        "float? scale_w) -> Tensor");
}

TORCH_LIBRARY_IMPL(deepep_lightning, CPU, m) { m.impl("upsample_bicubic2d_backward", &upsample_bicubic2d_backward_cpu); }

}  // namespace deepep_lightning
