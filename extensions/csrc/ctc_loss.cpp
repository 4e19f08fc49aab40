// deepep_lightning::ctc_loss_backward: the gradient of CTC's per-sample negative log-likelihood with respect to
// log_probs, what aten::_ctc_loss_backward computes, with the lengths as tensors.
//
//   ctc_loss_backward(grad, log_probs, targets, input_lengths, target_lengths, neg_log_likelihood,
//                     log_alpha, blank, zero_infinity) -> grad_log_probs [T, N, C]
//   grad               [N]       d loss / d neg_log_likelihood per sample (reductions are applied above)
//   log_probs          [T, N, C] float32 / float64
//   targets            [N, S] padded or [sum(target_lengths)] concatenated, int32 / int64
//   input_lengths, target_lengths  [N] int64, on log_probs' device
//   neg_log_likelihood [N], log_alpha [N, T, 2 * max_target_length + 1]: aten::_ctc_loss's outputs
//
// PyTorch's CUDA kernel refuses deterministic mode ("ctc_loss_backward_gpu": its large-problem path
// adds the non-blank terms with atomicAdd). The CUDA kernel here (cuda/ctc_loss_backward.cu) sums in a
// fixed order; the CPU kernel is PyTorch's CPU backward, deterministic already. Arguments are validated
// in Python (deepep_lightning/ops/ctc_loss.py) before this op runs; the checks here guard direct callers.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <vector>

namespace deepep_lightning {

void check_ctc_loss_backward_args(const at::Tensor& grad, const at::Tensor& log_probs, const at::Tensor& targets,
                                  const at::Tensor& input_lengths, const at::Tensor& target_lengths,
                                  const at::Tensor& neg_log_likelihood, const at::Tensor& log_alpha) {
  TORCH_CHECK(log_probs.dim() == 3, "ctc_loss_backward: log_probs must be [T, N, C], got shape ", log_probs.sizes());
  TORCH_CHECK(log_probs.scalar_type() == at::kFloat || log_probs.scalar_type() == at::kDouble,
              "ctc_loss_backward: log_probs must be float32 or float64, got ", log_probs.scalar_type());
  const int64_t batch = log_probs.size(1);
  TORCH_CHECK(grad.numel() == batch && neg_log_likelihood.numel() == batch,
              "ctc_loss_backward: grad and neg_log_likelihood must have N = ", batch, " elements, got ",
              grad.sizes(), " and ", neg_log_likelihood.sizes());
  TORCH_CHECK(input_lengths.dim() == 1 && input_lengths.size(0) == batch && target_lengths.dim() == 1 &&
                  target_lengths.size(0) == batch,
              "ctc_loss_backward: input_lengths and target_lengths must be [N] = [", batch, "], got ",
              input_lengths.sizes(), " and ", target_lengths.sizes());
  TORCH_CHECK(input_lengths.scalar_type() == at::kLong && target_lengths.scalar_type() == at::kLong,
              "ctc_loss_backward: the lengths must be int64");
  TORCH_CHECK(targets.scalar_type() == at::kLong || targets.scalar_type() == at::kInt,
              "ctc_loss_backward: targets must be int64 or int32, got ", targets.scalar_type());
  TORCH_CHECK(targets.dim() == 1 || (targets.dim() == 2 && targets.size(0) == batch),
              "ctc_loss_backward: targets must be [N, S] or 1-D, got shape ", targets.sizes());
  TORCH_CHECK(log_alpha.dim() == 3 && log_alpha.size(0) == batch && log_alpha.size(1) == log_probs.size(0) &&
                  log_alpha.size(2) % 2 == 1,
              "ctc_loss_backward: log_alpha must be [N, T, 2 * max_target_length + 1], got ", log_alpha.sizes());
  TORCH_CHECK(grad.scalar_type() == log_probs.scalar_type() && neg_log_likelihood.scalar_type() == log_probs.scalar_type() &&
                  log_alpha.scalar_type() == log_probs.scalar_type(),
              "ctc_loss_backward: grad, neg_log_likelihood and log_alpha must have log_probs' dtype");
}

namespace {

std::vector<int64_t> host_lengths(const at::Tensor& lengths) {
  const at::Tensor host = lengths.to(at::kCPU, at::kLong).contiguous();
  return std::vector<int64_t>(host.data_ptr<int64_t>(), host.data_ptr<int64_t>() + host.numel());
}

at::Tensor ctc_loss_backward_cpu(const at::Tensor& grad, const at::Tensor& log_probs, const at::Tensor& targets,
                                 const at::Tensor& input_lengths, const at::Tensor& target_lengths,
                                 const at::Tensor& neg_log_likelihood, const at::Tensor& log_alpha, int64_t blank,
                                 bool zero_infinity) {
  check_ctc_loss_backward_args(grad, log_probs, targets, input_lengths, target_lengths, neg_log_likelihood,
                               log_alpha);
  return at::_ctc_loss_backward(grad.reshape({-1}), log_probs, targets, host_lengths(input_lengths),
                                host_lengths(target_lengths), neg_log_likelihood, log_alpha, blank, zero_infinity);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(deepep_lightning, m) {
  m.def(
      "ctc_loss_backward(Tensor grad, Tensor log_probs, Tensor targets, Tensor input_lengths, "
      "Tensor target_lengths, Tensor neg_log_likelihood, Tensor log_alpha, int blank, bool zero_infinity=False) "
      "-> Tensor");
}

TORCH_LIBRARY_IMPL(deepep_lightning, CPU, m) { m.impl("ctc_loss_backward", &ctc_loss_backward_cpu); }

}  // namespace deepep_lightning
