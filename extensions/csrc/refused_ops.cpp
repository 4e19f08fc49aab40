// Ops whose CUDA backward PyTorch refuses under torch.use_deterministic_algorithms(True):
// schemas, shared argument checks and the CPU kernels.
//
//   deepep::grid_sample_bilinear2d            == F.grid_sample(mode="bilinear"), 4-D input
//   deepep::grid_sample_bilinear2d_backward   -> (grad_input, grad_grid)
//   deepep::upsample_bilinear2d               == F.interpolate(mode="bilinear", antialias=False)
//   deepep::upsample_bilinear2d_backward      -> grad_input
//
// The forwards are PyTorch's own kernels on every device (they are gather-only, hence already
// deterministic). PyTorch's CPU backwards are deterministic too, so the CPU kernels here call them;
// only the CUDA backwards are new (cuda/grid_sample_backward.cu, cuda/upsample_bilinear_backward.cu):
// they replace PyTorch's float atomicAdd scatter by a fixed-order gather.
//
// grid_sample_bilinear2d_backward returns a 0-element grad_input when input_requires_grad is
// false (the Python layer turns it into None): a schema output cannot be undefined.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

namespace deepep {

void check_grid_sample_args(const at::Tensor& input, const at::Tensor& grid, int64_t padding_mode) {
  TORCH_CHECK(padding_mode >= 0 && padding_mode <= 2,
              "grid_sample_bilinear2d: padding_mode must be 0 (zeros), 1 (border) or 2 (reflection), "
              "got ", padding_mode);
  TORCH_CHECK(input.dim() == 4, "grid_sample_bilinear2d: input must be 4-D [N, C, H_in, W_in], got ",
              input.dim(), "-D of shape ", input.sizes());
  TORCH_CHECK(grid.dim() == 4 && grid.size(3) == 2 && grid.size(0) == input.size(0),
              "grid_sample_bilinear2d: grid must be [N, H_out, W_out, 2] with N = ", input.size(0),
              ", got shape ", grid.sizes());
  TORCH_CHECK(at::isFloatingType(input.scalar_type()) && grid.scalar_type() == input.scalar_type(),
              "grid_sample_bilinear2d: input and grid must have one floating dtype, got ",
              input.scalar_type(), " and ", grid.scalar_type());
  TORCH_CHECK(grid.device() == input.device(), "grid_sample_bilinear2d: grid must be on input's device ",
              input.device(), ", got ", grid.device());
}

void check_upsample_args(const at::Tensor& grad_output, at::IntArrayRef input_size) {
  TORCH_CHECK(input_size.size() == 4, "upsample_bilinear2d_backward: input_size must have 4 entries "
              "[N, C, H_in, W_in], got ", input_size);
  TORCH_CHECK(grad_output.dim() == 4 && grad_output.size(0) == input_size[0] &&
                  grad_output.size(1) == input_size[1],
              "upsample_bilinear2d_backward: grad_output must be [", input_size[0], ", ", input_size[1],
              ", H_out, W_out], got shape ", grad_output.sizes());
  TORCH_CHECK(at::isFloatingType(grad_output.scalar_type()),
              "upsample_bilinear2d_backward: grad_output must be floating point, got ",
              grad_output.scalar_type());
}

// Forward on every device: what F.grid_sample calls (torch.grid_sampler picks cuDNN or
// grid_sampler_2d as PyTorch does), so the output is bit for bit F.grid_sample's.
at::Tensor grid_sample_bilinear2d_forward(const at::Tensor& input, const at::Tensor& grid,
                                          int64_t padding_mode, bool align_corners) {
  check_grid_sample_args(input, grid, padding_mode);
  return at::grid_sampler(input, grid, /*interpolation_mode=*/0, padding_mode, align_corners);
}

at::Tensor upsample_bilinear2d_forward(const at::Tensor& input, at::IntArrayRef output_size,
                                       bool align_corners, std::optional<double> scale_h,
                                       std::optional<double> scale_w) {
  TORCH_CHECK(input.dim() == 4, "upsample_bilinear2d: input must be 4-D [N, C, H, W], got ",
              input.dim(), "-D of shape ", input.sizes());
  TORCH_CHECK(output_size.size() == 2, "upsample_bilinear2d: output_size must have 2 entries, got ",
              output_size);
  return at::upsample_bilinear2d(input, output_size, align_corners, scale_h, scale_w);
}

namespace {

std::tuple<at::Tensor, at::Tensor> grid_sample_bilinear2d_backward_cpu(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& grid,
    int64_t padding_mode, bool align_corners, bool input_requires_grad) {
  check_grid_sample_args(input, grid, padding_mode);
  // PyTorch's CPU backward: every grad_input element is accumulated by one thread in a fixed order.
  auto grads = at::grid_sampler_2d_backward(grad_output, input, grid, /*interpolation_mode=*/0,
                                            padding_mode, align_corners,
                                            {input_requires_grad, true});
  at::Tensor grad_input = std::get<0>(grads);
  if (!grad_input.defined()) grad_input = at::empty({0}, input.options());
  return {grad_input, std::get<1>(grads)};
}

at::Tensor upsample_bilinear2d_backward_cpu(const at::Tensor& grad_output, at::IntArrayRef input_size,
                                            bool align_corners, std::optional<double> scale_h,
                                            std::optional<double> scale_w) {
  check_upsample_args(grad_output, input_size);
  return at::upsample_bilinear2d_backward(grad_output, grad_output.sizes().slice(2), input_size,
                                          align_corners, scale_h, scale_w);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(deepep, m) {
  m.def("grid_sample_bilinear2d(Tensor input, Tensor grid, int padding_mode, bool align_corners) -> Tensor");
  m.def(
      "grid_sample_bilinear2d_backward(Tensor grad_output, Tensor input, Tensor grid, int padding_mode, "
      "bool align_corners, bool input_requires_grad) -> (Tensor, Tensor)");
  m.def(
      "upsample_bilinear2d(Tensor input, int[2] output_size, bool align_corners, float? scale_h, "
      "float? scale_w) -> Tensor");
  m.def(
      "upsample_bilinear2d_backward(Tensor grad_output, int[4] input_size, bool align_corners, "
      "float? scale_h, float? scale_w) -> Tensor");
}

TORCH_LIBRARY_IMPL(deepep, CPU, m) {
  m.impl("grid_sample_bilinear2d", &grid_sample_bilinear2d_forward);
  m.impl("grid_sample_bilinear2d_backward", &grid_sample_bilinear2d_backward_cpu);
  m.impl("upsample_bilinear2d", &upsample_bilinear2d_forward);
  m.impl("upsample_bilinear2d_backward", &upsample_bilinear2d_backward_cpu);
}

}  // namespace deepep
