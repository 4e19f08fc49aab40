// Deterministic CUDA forward of aten::nll_loss2d_forward for reduction "mean" and "sum".
//
// PyTorch's kernel reduces each block's pixels and adds the block sums into the output with float
// atomicAdd, so the order of the additions depends on block scheduling (refused under
// torch.use_deterministic_algorithms(True)). Here the same reduction is done in two passes:
//   1. partial_kernel: block b sums the pixels p = b * kThreads + t + k * (blocks * kThreads),
//      k = 0, 1, ... (loss -w[target] * self[n, target, h, w] and weight w[target], ignored pixels
//      skipped), each thread in increasing k, then a fixed shared-memory tree over the block's
//      threads; block b writes its two partial sums to slot b;
//   2. final_kernel: one block sums the slots with the same fixed tree and writes output (sum, or
//      sum / total_weight for mean) and total_weight.
// Why deterministic: the block count is a function of the pixel count alone (not of the device), so
// every partial sum has a fixed set of terms in a fixed order, whatever the scheduling.
// Sums are in accscalar_t (float for float/half/bfloat16, double for double). self and target are
// read through their strides (channels-last or sliced inputs need no copy). An out-of-range target
// trips a device assert, as PyTorch's kernel does. All work is on the current stream, no sync.
#include <ATen/ATen.h>
#include <ATen/AccumulateType.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/EmptyTensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/macros/Macros.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <tuple>

namespace deepep_lightning {

// Defined in ../nll_loss2d.cpp.
void check_nll_loss2d_args(const at::Tensor& self, const at::Tensor& target, const std::optional<at::Tensor>& weight,
                           int64_t reduction);

namespace {

constexpr int kThreads = 512;          // threads per block, both passes
constexpr int64_t kPixelsPerBlock = 8192;  // pass-1 work per block before the block count saturates
constexpr int64_t kMaxBlocks = kThreads;   // pass 2 reduces one slot per thread

struct Strides {
  int64_t self_n, self_c, self_h, self_w;
  int64_t target_n, target_h, target_w;
};

template <typename accscalar_t>
__device__ __forceinline__ void block_tree_sum(accscalar_t* loss, accscalar_t* weight) {
  // Fixed pairing: thread t adds t + s for s = kThreads / 2, ..., 1.
  for (int stride = kThreads / 2; stride > 0; stride /= 2) {
    __syncthreads();
    if (threadIdx.x < stride) {
      loss[threadIdx.x] += loss[threadIdx.x + stride];
      weight[threadIdx.x] += weight[threadIdx.x + stride];
    }
  }
  __syncthreads();
}

template <typename scalar_t, typename accscalar_t>
__global__ void __launch_bounds__(kThreads)
    nll_loss2d_partial_kernel(const scalar_t* __restrict__ self, const int64_t* __restrict__ target,
                              const scalar_t* __restrict__ weight, int64_t pixels, int64_t height, int64_t width,
                              int64_t classes, int64_t ignore_index, Strides strides,
                              accscalar_t* __restrict__ partial_loss, accscalar_t* __restrict__ partial_weight) {
  __shared__ accscalar_t loss_sums[kThreads];
  __shared__ accscalar_t weight_sums[kThreads];
  accscalar_t loss = 0, total = 0;
  const int64_t step = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t p = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; p < pixels; p += step) {
    const int64_t w = p % width;
    const int64_t h = (p / width) % height;
    const int64_t n = p / (width * height);
    const int64_t t = target[n * strides.target_n + h * strides.target_h + w * strides.target_w];
    if (t == ignore_index) continue;
    CUDA_KERNEL_ASSERT(t >= 0 && t < classes);
    const accscalar_t class_weight = weight != nullptr ? static_cast<accscalar_t>(weight[t]) : accscalar_t(1);
    loss -= class_weight *
            static_cast<accscalar_t>(self[n * strides.self_n + t * strides.self_c + h * strides.self_h +
                                          w * strides.self_w]);
    total += class_weight;
  }
  loss_sums[threadIdx.x] = loss;
  weight_sums[threadIdx.x] = total;
  block_tree_sum(loss_sums, weight_sums);
  if (threadIdx.x == 0) {
    partial_loss[blockIdx.x] = loss_sums[0];
    partial_weight[blockIdx.x] = weight_sums[0];
  }
}

template <typename scalar_t, typename accscalar_t>
__global__ void __launch_bounds__(kThreads)
    nll_loss2d_final_kernel(const accscalar_t* __restrict__ partial_loss, const accscalar_t* __restrict__ partial_weight,
                            int blocks, bool mean, scalar_t* __restrict__ output, scalar_t* __restrict__ total_weight) {
  __shared__ accscalar_t loss_sums[kThreads];
  __shared__ accscalar_t weight_sums[kThreads];
  const bool live = static_cast<int>(threadIdx.x) < blocks;
  loss_sums[threadIdx.x] = live ? partial_loss[threadIdx.x] : accscalar_t(0);
  weight_sums[threadIdx.x] = live ? partial_weight[threadIdx.x] : accscalar_t(0);
  block_tree_sum(loss_sums, weight_sums);
  if (threadIdx.x == 0) {
    // mean with every pixel ignored is 0 / 0 = nan, as in PyTorch.
    *output = static_cast<scalar_t>(mean ? loss_sums[0] / weight_sums[0] : loss_sums[0]);
    *total_weight = static_cast<scalar_t>(weight_sums[0]);
  }
}

std::tuple<at::Tensor, at::Tensor> nll_loss2d_forward_cuda(const at::Tensor& self, const at::Tensor& target,
                                                           const std::optional<at::Tensor>& weight_opt,
                                                           int64_t reduction, int64_t ignore_index) {
  check_nll_loss2d_args(self, target, weight_opt, reduction);
  TORCH_CHECK(reduction != 0, "nll_loss2d_forward: the deepep_lightning CUDA kernel reduces (mean or sum); reduction 0 "
              "(none) is PyTorch's own kernel, already deterministic");
  TORCH_CHECK(self.is_cuda() && target.device() == self.device(),
              "nll_loss2d_forward: self and target must be on one CUDA device, got ", self.device(), " and ",
              target.device());
  const c10::cuda::CUDAGuard device_guard(self.device());
  const bool has_weight = weight_opt.has_value() && weight_opt->defined();
  const at::Tensor weight = has_weight ? weight_opt->contiguous() : at::Tensor();
  const int64_t pixels = self.size(0) * self.size(2) * self.size(3);
  const int blocks = static_cast<int>(
      std::clamp<int64_t>((pixels + kPixelsPerBlock - 1) / kPixelsPerBlock, 1, kMaxBlocks));
  // Written in full by the kernels: no deterministic-mode fill needed.
  at::Tensor output = at::Tensor(at::detail::empty_cuda({}, self.scalar_type(), self.device(), std::nullopt));
  at::Tensor total_weight = at::Tensor(at::detail::empty_cuda({}, self.scalar_type(), self.device(), std::nullopt));
  const Strides strides{self.stride(0),   self.stride(1),   self.stride(2),  self.stride(3),
                        target.stride(0), target.stride(1), target.stride(2)};
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, self.scalar_type(), "nll_loss2d_forward_cuda", [&] {
    using accscalar_t = at::acc_type<scalar_t, /*is_cuda=*/true>;
    const auto acc_type = c10::CppTypeToScalarType<accscalar_t>::value;
    at::Tensor partials = at::Tensor(at::detail::empty_cuda({2, blocks}, acc_type, self.device(), std::nullopt));
    accscalar_t* partial_loss = partials.data_ptr<accscalar_t>();
    accscalar_t* partial_weight = partial_loss + blocks;
    nll_loss2d_partial_kernel<scalar_t, accscalar_t><<<blocks, kThreads, 0, stream>>>(
        self.const_data_ptr<scalar_t>(), target.const_data_ptr<int64_t>(),
        has_weight ? weight.const_data_ptr<scalar_t>() : nullptr, pixels, self.size(2), self.size(3), self.size(1),
        ignore_index, strides, partial_loss, partial_weight);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    nll_loss2d_final_kernel<scalar_t, accscalar_t><<<1, kThreads, 0, stream>>>(
        partial_loss, partial_weight, blocks, reduction == 1, output.data_ptr<scalar_t>(),
        total_weight.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {output, total_weight};
}

}  // namespace

TORCH_LIBRARY_IMPL(deepep_lightning, CUDA, m) { m.impl("nll_loss2d_forward", &nll_loss2d_forward_cuda); }

}  // namespace deepep_lightning
