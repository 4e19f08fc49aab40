// Ops whose CUDA backward PyTorch refuses under torch.use_deterministic_algorithms(True):
// schemas, shared argument checks and the CPU kernels.
//
// This file owns TORCH_LIBRARY(deepep_lightning, m), the plugin's namespace. The other refused-op files
// add their schemas with TORCH_LIBRARY_FRAGMENT(deepep_lightning, m); the DeepEP workload's kernels
// (deepep/) live in a namespace of their own, deepep.
//
//   deepep_lightning::grid_sample_bilinear2d            == F.grid_sample(mode="bilinear"), 4-D input
//   deepep_lightning::grid_sample_bilinear2d_backward   -> (grad_input, grad_grid)
//   deepep_lightning::upsample_bilinear2d               == F.interpolate(mode="bilinear", antialias=False)
//   deepep_lightning::upsample_bilinear2d_backward      -> grad_input
//
// The forwards are PyTorch's own kernels on every device (they are gather-only, hence already
// deterministic). PyTorch's CPU backwards are deterministic too, so the CPU kernels here call them;
// only the CUDA backwards are new (cuda/grid_sample_backward.cu, cuda/upsample_bilinear_backward.cu):
// they replace PyTorch's float atomicAdd scatter by a fixed-order gather.
//
// grid_sample_bilinear2d_backward returns a 0-element grad_input when input_requires_grad is
// false (the autograd kernel turns it into an undefined gradient): a schema output cannot be undefined.
//
// Autograd is registered here, in C++ (torch::autograd::Function at the Autograd key), not with
// torch.library.register_autograd from Python: the backward then runs without the Python layer,
// costs more host time per call than the upsample kernel itself on small shapes (measured in
// benchmarks/results/, summarised in BENCHMARKS.md). The fake (meta)
// kernels stay in Python (deepep_lightning/ops/grid_sample.py, interpolate.py).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

namespace deepep_lightning {

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

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The ops' device kernels, called from below the Autograd key.
at::Tensor call_grid_sample(const at::Tensor& input, const at::Tensor& grid, int64_t padding_mode,
                            bool align_corners) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("deepep_lightning::grid_sample_bilinear2d", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, bool)>();
  return op.call(input, grid, padding_mode, align_corners);
}

std::tuple<at::Tensor, at::Tensor> call_grid_sample_backward(const at::Tensor& grad_output, const at::Tensor& input,
                                                             const at::Tensor& grid, int64_t padding_mode,
                                                             bool align_corners, bool input_requires_grad) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("deepep_lightning::grid_sample_bilinear2d_backward", "")
          .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                                                    bool, bool)>();
  return op.call(grad_output, input, grid, padding_mode, align_corners, input_requires_grad);
}

at::Tensor call_upsample(const at::Tensor& input, at::IntArrayRef output_size, bool align_corners,
                         std::optional<double> scale_h, std::optional<double> scale_w) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("deepep_lightning::upsample_bilinear2d", "")
                             .typed<at::Tensor(const at::Tensor&, at::IntArrayRef, bool, std::optional<double>,
                                               std::optional<double>)>();
  return op.call(input, output_size, align_corners, scale_h, scale_w);
}

at::Tensor call_upsample_backward(const at::Tensor& grad_output, at::IntArrayRef input_size, bool align_corners,
                                  std::optional<double> scale_h, std::optional<double> scale_w) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("deepep_lightning::upsample_bilinear2d_backward", "")
                             .typed<at::Tensor(const at::Tensor&, at::IntArrayRef, bool, std::optional<double>,
                                               std::optional<double>)>();
  return op.call(grad_output, input_size, align_corners, scale_h, scale_w);
}

std::optional<double> optional_double(const c10::IValue& value) {
  return value.isNone() ? std::nullopt : std::optional<double>(value.toDouble());
}

}  // namespace

// Outside the anonymous namespace so that grad_fn.name() reads "...CppNode<deepep_lightning::GridSampleBilinear2d>".
class GridSampleBilinear2d : public torch::autograd::Function<GridSampleBilinear2d> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, const at::Tensor& grid,
                            int64_t padding_mode, bool align_corners) {
    ctx->saved_data["padding_mode"] = padding_mode;
    ctx->saved_data["align_corners"] = align_corners;
    ctx->save_for_backward({input, grid});
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    return call_grid_sample(input, grid, padding_mode, align_corners);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const variable_list saved = ctx->get_saved_variables();
    const bool input_requires_grad = ctx->needs_input_grad(0), grid_requires_grad = ctx->needs_input_grad(1);
    auto [grad_input, grad_grid] = call_grid_sample_backward(
        grad_outputs[0], saved[0], saved[1], ctx->saved_data["padding_mode"].toInt(),
        ctx->saved_data["align_corners"].toBool(), input_requires_grad);
    return {input_requires_grad ? grad_input : at::Tensor(), grid_requires_grad ? grad_grid : at::Tensor(),
            at::Tensor(), at::Tensor()};
  }
};

class UpsampleBilinear2d : public torch::autograd::Function<UpsampleBilinear2d> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, at::IntArrayRef output_size,
                            bool align_corners, std::optional<double> scale_h, std::optional<double> scale_w) {
    ctx->saved_data["input_size"] = input.sizes().vec();
    ctx->saved_data["align_corners"] = align_corners;
    ctx->saved_data["scale_h"] = scale_h;
    ctx->saved_data["scale_w"] = scale_w;
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    return call_upsample(input, output_size, align_corners, scale_h, scale_w);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const std::vector<int64_t> input_size = ctx->saved_data["input_size"].toIntVector();
    at::Tensor grad_input = call_upsample_backward(
        grad_outputs[0], input_size, ctx->saved_data["align_corners"].toBool(),
        optional_double(ctx->saved_data["scale_h"]), optional_double(ctx->saved_data["scale_w"]));
    return {grad_input, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor grid_sample_bilinear2d_autograd(const at::Tensor& input, const at::Tensor& grid, int64_t padding_mode,
                                           bool align_corners) {
  return GridSampleBilinear2d::apply(input, grid, padding_mode, align_corners);
}

at::Tensor upsample_bilinear2d_autograd(const at::Tensor& input, at::IntArrayRef output_size, bool align_corners,
                                        std::optional<double> scale_h, std::optional<double> scale_w) {
  return UpsampleBilinear2d::apply(input, output_size, align_corners, scale_h, scale_w);
}

TORCH_LIBRARY(deepep_lightning, m) {
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

TORCH_LIBRARY_IMPL(deepep_lightning, CPU, m) {
  m.impl("grid_sample_bilinear2d", &grid_sample_bilinear2d_forward);
  m.impl("grid_sample_bilinear2d_backward", &grid_sample_bilinear2d_backward_cpu);
  m.impl("upsample_bilinear2d", &upsample_bilinear2d_forward);
  m.impl("upsample_bilinear2d_backward", &upsample_bilinear2d_backward_cpu);
}

TORCH_LIBRARY_IMPL(deepep_lightning, Autograd, m) {
  m.impl("grid_sample_bilinear2d", &grid_sample_bilinear2d_autograd);
  m.impl("upsample_bilinear2d", &upsample_bilinear2d_autograd);
}

}  // namespace deepep_lightning
