// deepep_lightning::argmax_window_backward and deepep_lightning::max_unpool_forward: the direct (sort-free) kernels of the
// max-pooling backwards and of max_unpool (deepep_lightning/ops/max_pool.py routes them).
//
//   argmax_window_backward(grad_output, indices, input_size, kernel_size, stride, padding, dilation)
//     grad_output, indices  [planes..., *out_size]  (indices int64: flat positions in each input plane)
//     input_size            the 2 or 3 spatial input sizes
//     kernel_size, stride, padding, dilation: a max pooling's windows (one int per spatial dim), or all
//       empty for an adaptive max pooling (window o of n outputs over m inputs: [floor(o m / n), ceil((o + 1) m / n)))
//     -> grad_input [planes..., *input_size], contiguous:
//        grad_input[p, i] = sum over the output cells j whose window holds i and indices[p, j] == i of grad_output[p, j]
//   max_unpool_forward(self, indices, output_size)
//     self, indices [planes..., *in_size]; output_size the 2 or 3 spatial output sizes
//     -> out [planes..., *output_size], contiguous: out[p, indices[p, j]] = self[p, j]; with duplicate
//        indices the largest j wins (PyTorch's CPU loop order); never-written cells are 0.
//
// PyTorch's CUDA kernels scatter with float atomicAdd (or racing stores, for max_unpool) and refuse
// deterministic mode. The CUDA kernels (cuda/max_pool_backward.cu) sum each cell's terms in a fixed order
// instead, one of two ways (max_pool_windows.h): where at most kMaxScatterPasses passes of pairwise
// disjoint windows cover all windows (a kernel-3 stride-2 pooling takes 4 passes in 2-D, 8 in 3-D; for
// float16/bfloat16 only a single pass, so no partial sum is rounded to the narrow type), each pass scatters
// its windows' gradients with plain adds, the passes in a fixed order (a non-overlapping pooling is one
// pass); otherwise one thread per input cell gathers, in ascending order, from the few
// windows that can hold it. max_unpool takes an integer atomicMax of the position per output cell (integer
// max is order-free) and then gathers. The CPU kernels run the same passes or gather and a sequential
// max_unpool. Only windows that can hold a cell count it, so indices must be the forward's (an index
// outside its window is not counted).
//
// Arguments are validated in Python before these ops run (DESIGN.md section 7); the checks here guard
// direct torch.ops callers.
#include <ATen/ATen.h>
#include <ATen/AccumulateType.h>
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <climits>
#include <vector>

#include "max_pool_windows.h"

namespace deepep_lightning {

int64_t argmax_planes(const at::Tensor& tensor, int64_t spatial_dims, const char* op) {
  TORCH_CHECK(spatial_dims == 2 || spatial_dims == 3, op, ": 2 or 3 spatial sizes expected, got ", spatial_dims);
  TORCH_CHECK(tensor.dim() > spatial_dims, op, ": a tensor of more than ", spatial_dims, " dims expected, got shape ",
              tensor.sizes());
  int64_t planes = 1;
  for (int64_t d = 0; d < tensor.dim() - spatial_dims; ++d) planes *= tensor.size(d);
  return planes;
}

std::vector<int64_t> argmax_window_check(const at::Tensor& grad_output, const at::Tensor& indices,
                                         at::IntArrayRef input_size, at::IntArrayRef kernel_size,
                                         at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation) {
  const int64_t dims = static_cast<int64_t>(input_size.size());
  argmax_planes(grad_output, dims, "argmax_window_backward");
  TORCH_CHECK(grad_output.sizes() == indices.sizes(), "argmax_window_backward: indices must have grad_output's shape ",
              grad_output.sizes(), ", got ", indices.sizes());
  TORCH_CHECK(indices.scalar_type() == at::kLong, "argmax_window_backward: indices must be int64, got ",
              indices.scalar_type());
  TORCH_CHECK(at::isFloatingType(grad_output.scalar_type()),
              "argmax_window_backward: grad_output must be floating point, got ", grad_output.scalar_type());
  const bool adaptive = kernel_size.empty();
  TORCH_CHECK(adaptive ? stride.empty() && padding.empty() && dilation.empty()
                       : static_cast<int64_t>(kernel_size.size()) == dims &&
                             static_cast<int64_t>(stride.size()) == dims &&
                             static_cast<int64_t>(padding.size()) == dims &&
                             static_cast<int64_t>(dilation.size()) == dims,
              "argmax_window_backward: kernel_size, stride, padding and dilation must all be empty (adaptive) or have ",
              dims, " entries, got ", kernel_size, ", ", stride, ", ", padding, ", ", dilation);
  for (int64_t d = 0; d < dims; ++d) {
    TORCH_CHECK(input_size[d] > 0, "argmax_window_backward: input_size must be positive, got ", input_size);
    if (!adaptive) {
      TORCH_CHECK(kernel_size[d] > 0 && stride[d] > 0 && dilation[d] > 0 && padding[d] >= 0,
                  "argmax_window_backward: kernel_size, stride, dilation must be positive and padding >= 0, got ",
                  kernel_size, ", ", stride, ", ", padding, ", ", dilation);
    }
  }
  std::vector<int64_t> shape(grad_output.sizes().begin(), grad_output.sizes().end() - dims);
  shape.insert(shape.end(), input_size.begin(), input_size.end());
  return shape;
}

std::vector<int64_t> max_unpool_check(const at::Tensor& self, const at::Tensor& indices, at::IntArrayRef output_size) {
  const int64_t dims = static_cast<int64_t>(output_size.size());
  argmax_planes(self, dims, "max_unpool_forward");
  TORCH_CHECK(self.sizes() == indices.sizes(), "max_unpool_forward: indices must have self's shape ", self.sizes(),
              ", got ", indices.sizes());
  TORCH_CHECK(indices.scalar_type() == at::kLong, "max_unpool_forward: indices must be int64, got ",
              indices.scalar_type());
  for (const int64_t size : output_size) {
    TORCH_CHECK(size > 0, "max_unpool_forward: output_size must be positive, got ", output_size);
  }
  std::vector<int64_t> shape(self.sizes().begin(), self.sizes().end() - dims);
  shape.insert(shape.end(), output_size.begin(), output_size.end());
  return shape;
}

PoolWindows pool_windows(const at::Tensor& grad_output, at::IntArrayRef input_size, at::IntArrayRef kernel_size,
                         at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation) {
  const int dims = static_cast<int>(input_size.size());
  const int offset = 3 - dims;  // a 2-D pooling is a 3-D one of depth 1
  PoolWindows w{};
  w.adaptive = kernel_size.empty();
  for (int d = 0; d < 3; ++d) {
    w.in[d] = w.out[d] = w.kernel[d] = w.stride[d] = w.dilation[d] = 1;
    w.padding[d] = 0;
  }
  for (int d = 0; d < dims; ++d) {
    const int64_t out_size = grad_output.size(grad_output.dim() - dims + d);
    TORCH_CHECK(input_size[d] < INT_MAX && out_size < INT_MAX,
                "argmax_window_backward: spatial sizes must be below 2^31 - 1, got ", input_size);
    w.in[offset + d] = static_cast<int>(input_size[d]);
    w.out[offset + d] = static_cast<int>(out_size);
    if (!w.adaptive) {
      w.kernel[offset + d] = static_cast<int>(kernel_size[d]);
      w.stride[offset + d] = static_cast<int>(stride[d]);
      w.padding[offset + d] = static_cast<int>(padding[d]);
      w.dilation[offset + d] = static_cast<int>(dilation[d]);
    }
  }
  return w;
}

namespace {

at::Tensor argmax_window_backward_cpu(const at::Tensor& grad_output, const at::Tensor& indices,
                                      at::IntArrayRef input_size, at::IntArrayRef kernel_size, at::IntArrayRef stride,
                                      at::IntArrayRef padding, at::IntArrayRef dilation) {
  const std::vector<int64_t> shape =
      argmax_window_check(grad_output, indices, input_size, kernel_size, stride, padding, dilation);
  at::Tensor grad_input = at::zeros(shape, grad_output.options());
  if (grad_output.numel() == 0 || grad_input.numel() == 0) return grad_input;
  const PoolWindows w = pool_windows(grad_output, input_size, kernel_size, stride, padding, dilation);
  const at::Tensor grad_c = grad_output.contiguous();
  const at::Tensor indices_c = indices.contiguous();
  int classes[3];
  const int passes = pool_scatter_passes(w, classes);
  const int64_t planes = grad_input.numel() / (static_cast<int64_t>(w.in[0]) * w.in[1] * w.in[2]);
  // The same passes or gather as the CUDA kernel (max_pool_windows.h), one window or cell after the other.
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad_c.scalar_type(), "argmax_window_backward_cpu", [&] {
    using acc_t = at::acc_type<scalar_t, true>;  // the CUDA kernel's accumulate type: float for float
    const scalar_t* grad_data = grad_c.data_ptr<scalar_t>();
    const int64_t* index_data = indices_c.data_ptr<int64_t>();
    scalar_t* out = grad_input.data_ptr<scalar_t>();
    if (pool_scatter_in_passes(passes, sizeof(scalar_t) < sizeof(float))) {
      for (int pass = 0; pass < passes; ++pass) {
        const ScatterPass p = scatter_pass(w, classes, pass);
        const int64_t windows = planes * p.count[0] * p.count[1] * p.count[2];
        for (int64_t item = 0; item < windows; ++item) {
          pool_scatter_one<scalar_t, acc_t>(w, p, item, grad_data, index_data, out);
        }
      }
      return;
    }
    for (int64_t item = 0; item < grad_input.numel(); ++item) {
      out[item] = pool_gather_one<scalar_t, acc_t>(w, item, grad_data, index_data);
    }
  });
  return grad_input;
}

at::Tensor max_unpool_forward_cpu(const at::Tensor& self, const at::Tensor& indices, at::IntArrayRef output_size) {
  const std::vector<int64_t> shape = max_unpool_check(self, indices, output_size);
  const int64_t planes = argmax_planes(self, static_cast<int64_t>(output_size.size()), "max_unpool_forward");
  at::Tensor out = at::zeros(shape, self.options());
  if (self.numel() == 0) return out;
  const at::Tensor flat_indices = indices.reshape({planes, -1});
  const at::Tensor positions = at::arange(flat_indices.size(1), indices.options()).expand_as(flat_indices);
  at::Tensor winner = at::full({planes, out.numel() / planes}, -1, indices.options());
  winner.scatter_reduce_(1, flat_indices, positions, "amax");
  const at::Tensor written = winner.ge(0);
  const at::Tensor values = self.reshape({planes, -1}).gather(1, winner.clamp_min(0));
  return out.view({planes, -1}).copy_(at::where(written, values, at::zeros({}, self.options()))).view(shape);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(deepep_lightning, m) {
  m.def(
      "argmax_window_backward(Tensor grad_output, Tensor indices, int[] input_size, int[] kernel_size, int[] stride, "
      "int[] padding, int[] dilation) -> Tensor");
  m.def("max_unpool_forward(Tensor self, Tensor indices, int[] output_size) -> Tensor");
}

TORCH_LIBRARY_IMPL(deepep_lightning, CPU, m) {
  m.impl("argmax_window_backward", &argmax_window_backward_cpu);
  m.impl("max_unpool_forward", &max_unpool_forward_cpu);
}

}  // namespace deepep_lightning
