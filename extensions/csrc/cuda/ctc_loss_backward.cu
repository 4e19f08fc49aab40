// Deterministic CUDA backward of CTC (schema and CPU kernel: ../ctc_loss.cpp).
//
// PyTorch's ctc_loss_backward_gpu calls alertNotDeterministic unconditionally: for "large" problems
// (2 T + 2.4 N + 0.2 C > 450, e.g. T 200, N 32, C 29) it subtracts the non-blank terms with atomicAdd.
// Here, with the formulas of PyTorch's kernels (LossCTC.cu: the beta recursion, eq. (10)-(11) of Graves
// et al., and the gradient of eq. (16)):
//   1. one block per sample computes its target offset (concatenated targets: the sum of the earlier
//      target lengths, an exact integer sum) and log_beta [T, 2 L + 1] backwards in t, one thread per
//      target position s (strided when 2 L + 1 exceeds the block), the row t + 1 in shared memory;
//   2. one thread per (t, n) log-adds alpha[t, s] + beta[t, s] over s = 0 .. 2 l_n in increasing s into
//      its own gradient row (the row is its scratch, as in PyTorch's small-problem kernel), then writes
//      (exp(lp) - exp(lcab + nll - lp)) * grad per class c; 0 for t >= input_length and, with
//      zero_infinity, for samples whose nll is infinite.
// Every value is one thread's sequential sum in a fixed order, so the result is bitwise reproducible and
// a sample's gradient does not depend on the rest of the batch. log_beta is only read where step 1 wrote
// it (t < input_length), so its scratch is not filled. All work is on the current stream; no host sync.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/EmptyTensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>

namespace deepep_lightning {

// Defined in ../ctc_loss.cpp.
void check_ctc_loss_backward_args(const at::Tensor& grad, const at::Tensor& log_probs, const at::Tensor& targets,
                                  const at::Tensor& input_lengths, const at::Tensor& target_lengths,
                                  const at::Tensor& neg_log_likelihood, const at::Tensor& log_alpha);

namespace {

constexpr int kMaxBetaThreads = 1024;
constexpr int kCollectThreads = 128;
constexpr size_t kMaxSharedBytes = 48 * 1024;

template <typename target_t>
__device__ __forceinline__ int64_t target_prime(const target_t* targets, int64_t offset, int64_t s, int64_t blank) {
  return (s % 2 == 0) ? blank : static_cast<int64_t>(targets[offset + s / 2]);
}

// kShared: row t + 1 of log_beta is read from shared memory (2 rows of 2 L + 1), else from log_beta.
template <typename scalar_t, typename target_t, bool kShared>
__global__ void ctc_beta_kernel(const int64_t max_input_length, const int64_t batch, const int64_t num_labels,
                                const int64_t max_target_length, const int64_t target_row_stride,
                                const bool concatenated, const int64_t blank,
                                const scalar_t* __restrict__ log_probs,     // [T, N, C]
                                const target_t* __restrict__ targets,       // [N, S] or [sum l]
                                const int64_t* __restrict__ input_lengths,  // [N]
                                const int64_t* __restrict__ target_lengths, // [N]
                                int64_t* __restrict__ target_offsets,       // [N] written here
                                scalar_t* __restrict__ log_beta) {          // [N, T, 2 L + 1]
  constexpr scalar_t neginf = -std::numeric_limits<scalar_t>::infinity();
  extern __shared__ unsigned char shared_bytes[];
  __shared__ unsigned long long offset_sum;
  const int64_t b = blockIdx.x;
  const int64_t width = 2 * max_target_length + 1;
  if (concatenated) {
    if (threadIdx.x == 0) offset_sum = 0;
    __syncthreads();
    unsigned long long partial = 0;
    for (int64_t i = threadIdx.x; i < b; i += blockDim.x) partial += static_cast<unsigned long long>(target_lengths[i]);
    if (partial != 0) atomicAdd(&offset_sum, partial);  // integers: exact in any order
    __syncthreads();
  }
  const int64_t offset = concatenated ? static_cast<int64_t>(offset_sum) : b * target_row_stride;
  if (threadIdx.x == 0) target_offsets[b] = offset;
  const int64_t input_length = input_lengths[b];
  const int64_t target_length = target_lengths[b];
  if (input_length <= 0) return;  // no timestep: the gradient kernel writes zeros, reads no beta
  const scalar_t* lp_b = log_probs + b * num_labels;  // + t * N * C + c
  const int64_t lp_t_stride = batch * num_labels;
  scalar_t* beta_b = log_beta + b * max_input_length * width;
  scalar_t* rows = reinterpret_cast<scalar_t*>(shared_bytes);  // [2, width] when kShared

  // Row t = input_length - 1.
  {
    const int64_t t = input_length - 1;
    for (int64_t s = threadIdx.x; s < width; s += blockDim.x) {
      scalar_t lb = neginf;
      if (s == 2 * target_length) {
        lb = lp_b[t * lp_t_stride + blank];
      } else if (s == 2 * target_length - 1) {
        lb = lp_b[t * lp_t_stride + target_prime(targets, offset, s, blank)];
      }
      beta_b[t * width + s] = lb;
      if (kShared) rows[(t & 1) * width + s] = lb;
    }
  }
  for (int64_t t = input_length - 2; t >= 0; --t) {
    __syncthreads();  // row t + 1 complete
    const scalar_t* next = kShared ? rows + ((t + 1) & 1) * width : beta_b + (t + 1) * width;
    for (int64_t s = threadIdx.x; s < width; s += blockDim.x) {
      scalar_t lb = neginf;
      if (s < 2 * target_length + 1) {
        const int64_t current = target_length > 0 ? target_prime(targets, offset, s, blank) : blank;
        const scalar_t lp = lp_b[t * lp_t_stride + current];
        const bool have_three = target_length > 0 && s < 2 * target_length - 1 &&
                                target_prime(targets, offset, s + 2, blank) != current;
        const scalar_t lb1 = next[s];
        const scalar_t lb2 = s < 2 * target_length ? next[s + 1] : neginf;
        const scalar_t lb3 = have_three ? next[s + 2] : neginf;
        scalar_t lbmax = lb1;
        if (lb2 > lbmax) lbmax = lb2;
        if (lb3 > lbmax) lbmax = lb3;
        if (lbmax == neginf) lbmax = 0;
        lb = std::log(std::exp(lb1 - lbmax) + std::exp(lb2 - lbmax) + std::exp(lb3 - lbmax)) + lbmax + lp;
      }
      beta_b[t * width + s] = lb;
      if (kShared) rows[(t & 1) * width + s] = lb;
    }
  }
}

// One thread per (t, n), n fastest.
template <typename scalar_t, typename target_t>
__global__ void ctc_grad_kernel(const int64_t max_input_length, const int64_t batch, const int64_t num_labels,
                                const int64_t max_target_length, const int64_t blank, const bool zero_infinity,
                                const scalar_t* __restrict__ grad_out,            // [N]
                                const scalar_t* __restrict__ log_probs,           // [T, N, C]
                                const target_t* __restrict__ targets,
                                const int64_t* __restrict__ input_lengths,        // [N]
                                const int64_t* __restrict__ target_lengths,       // [N]
                                const int64_t* __restrict__ target_offsets,       // [N]
                                const scalar_t* __restrict__ neg_log_likelihood,  // [N]
                                const scalar_t* __restrict__ log_alpha,           // [N, T, 2 L + 1]
                                const scalar_t* __restrict__ log_beta,            // [N, T, 2 L + 1]
                                scalar_t* __restrict__ grad) {                    // [T, N, C]
  constexpr scalar_t neginf = -std::numeric_limits<scalar_t>::infinity();
  const int64_t item = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (item >= max_input_length * batch) return;
  const int64_t t = item / batch;
  const int64_t b = item - t * batch;
  scalar_t* row = grad + item * num_labels;
  const scalar_t nll = neg_log_likelihood[b];
  if (t >= input_lengths[b] || (zero_infinity && nll == std::numeric_limits<scalar_t>::infinity())) {
    for (int64_t c = 0; c < num_labels; ++c) row[c] = 0;
    return;
  }
  for (int64_t c = 0; c < num_labels; ++c) row[c] = neginf;
  const int64_t width = 2 * max_target_length + 1;
  const int64_t target_length = target_lengths[b];
  const int64_t offset = target_offsets[b];
  const scalar_t* alpha_t = log_alpha + (b * max_input_length + t) * width;
  const scalar_t* beta_t = log_beta + (b * max_input_length + t) * width;
  for (int64_t s = 0; s < 2 * target_length + 1; ++s) {
    const int64_t c = target_prime(targets, offset, s, blank);
    const scalar_t log_alpha_beta = alpha_t[s] + beta_t[s];
    const scalar_t lcab = row[c];
    if (lcab == neginf) {
      row[c] = log_alpha_beta;
    } else {
      const scalar_t max = lcab > log_alpha_beta ? lcab : log_alpha_beta;
      row[c] = std::log(std::exp(lcab - max) + std::exp(log_alpha_beta - max)) + max;
    }
  }
  const scalar_t gr = grad_out[b];
  const scalar_t* lp_row = log_probs + item * num_labels;
  for (int64_t c = 0; c < num_labels; ++c) {
    const scalar_t lp = lp_row[c];
    row[c] = (std::exp(lp) - std::exp(row[c] + nll - lp)) * gr;
  }
}

at::Tensor empty_unfilled(at::IntArrayRef sizes, at::ScalarType dtype, at::Device device) {
  return at::Tensor(at::detail::empty_cuda(sizes, dtype, device, std::nullopt));
}

at::Tensor ctc_loss_backward_cuda(const at::Tensor& grad_out, const at::Tensor& log_probs, const at::Tensor& targets,
                                  const at::Tensor& input_lengths, const at::Tensor& target_lengths,
                                  const at::Tensor& neg_log_likelihood, const at::Tensor& log_alpha, int64_t blank,
                                  bool zero_infinity) {
  check_ctc_loss_backward_args(grad_out, log_probs, targets, input_lengths, target_lengths, neg_log_likelihood,
                               log_alpha);
  TORCH_CHECK(log_probs.is_cuda(), "ctc_loss_backward: log_probs must be a CUDA tensor, got ", log_probs.device());
  const c10::cuda::CUDAGuard device_guard(log_probs.device());
  const int64_t max_input_length = log_probs.size(0), batch = log_probs.size(1), num_labels = log_probs.size(2);
  const int64_t max_target_length = log_alpha.size(2) / 2;
  const int64_t width = 2 * max_target_length + 1;
  // Written in full by ctc_grad_kernel (every row of every (t, n)).
  at::Tensor grad = empty_unfilled(log_probs.sizes(), log_probs.scalar_type(), log_probs.device());
  if (grad.numel() == 0) return grad;
  const at::Tensor log_probs_c = log_probs.contiguous();
  const at::Tensor targets_c = targets.contiguous();
  const at::Tensor grad_out_c = grad_out.reshape({-1}).contiguous();
  const at::Tensor nll_c = neg_log_likelihood.reshape({-1}).contiguous();
  const at::Tensor alpha_c = log_alpha.contiguous();
  const at::Tensor input_lengths_c = input_lengths.contiguous();
  const at::Tensor target_lengths_c = target_lengths.contiguous();
  at::Tensor log_beta = empty_unfilled(alpha_c.sizes(), alpha_c.scalar_type(), alpha_c.device());
  at::Tensor target_offsets = empty_unfilled({batch}, at::kLong, log_probs.device());
  const bool concatenated = targets_c.dim() == 1;
  const int64_t target_row_stride = concatenated ? 0 : targets_c.size(1);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  int beta_threads = 32;
  while (beta_threads < kMaxBetaThreads && beta_threads < width) beta_threads *= 2;

  AT_DISPATCH_FLOATING_TYPES(log_probs_c.scalar_type(), "ctc_loss_backward_cuda", [&] {
    AT_DISPATCH_INDEX_TYPES(targets_c.scalar_type(), "ctc_loss_backward_cuda_targets", [&] {
      using target_t = index_t;
      const size_t shared_bytes = 2 * sizeof(scalar_t) * width;
      const bool use_shared = shared_bytes <= kMaxSharedBytes;
      const auto beta_kernel = use_shared ? ctc_beta_kernel<scalar_t, target_t, true>
                                          : ctc_beta_kernel<scalar_t, target_t, false>;
      beta_kernel<<<static_cast<unsigned int>(batch), beta_threads, use_shared ? shared_bytes : 0, stream>>>(
          max_input_length, batch, num_labels, max_target_length, target_row_stride, concatenated, blank,
          log_probs_c.data_ptr<scalar_t>(), targets_c.data_ptr<target_t>(), input_lengths_c.data_ptr<int64_t>(),
          target_lengths_c.data_ptr<int64_t>(), target_offsets.data_ptr<int64_t>(), log_beta.data_ptr<scalar_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      const int64_t items = max_input_length * batch;
      ctc_grad_kernel<scalar_t, target_t>
          <<<static_cast<unsigned int>((items + kCollectThreads - 1) / kCollectThreads), kCollectThreads, 0, stream>>>(
              max_input_length, batch, num_labels, max_target_length, blank, zero_infinity,
              grad_out_c.data_ptr<scalar_t>(), log_probs_c.data_ptr<scalar_t>(), targets_c.data_ptr<target_t>(),
              input_lengths_c.data_ptr<int64_t>(), target_lengths_c.data_ptr<int64_t>(),
              target_offsets.data_ptr<int64_t>(), nll_c.data_ptr<scalar_t>(), alpha_c.data_ptr<scalar_t>(),
              log_beta.data_ptr<scalar_t>(), grad.data_ptr<scalar_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return grad;
}

}  // namespace

TORCH_LIBRARY_IMPL(deepep_lightning, CUDA, m) { m.impl("ctc_loss_backward", &ctc_loss_backward_cuda); }

}  // namespace deepep_lightning
