"""Deterministic CTC backward: ``torch.ops.deepep_lightning.ctc_loss_backward`` and the ``_ctc_loss_backward`` routes.

``F.ctc_loss`` on CUDA (outside cuDNN's narrow case) runs ``aten::_ctc_loss`` and, backward,
``aten::_ctc_loss_backward``, which PyTorch refuses in deterministic mode (``ctc_loss_backward_gpu does
not have a deterministic implementation``: for large problems it adds the non-blank terms with
``atomicAdd``). The CUDA kernel here (``extensions/csrc/cuda/ctc_loss_backward.cu``) computes beta and
the gradient from the forward's ``log_alpha`` with PyTorch's formulas, each value one thread's sum in a
fixed order: bitwise reproducible, and a sample's gradient independent of the rest of the batch.

Routed at the dispatcher's CUDA key (:mod:`deepep_lightning.ops._routes`) in deterministic mode, both
overloads (int-list lengths, as ``F.ctc_loss`` passes them, and ``.Tensor`` lengths, as traced graphs do),
float32/float64, padded 2-D or concatenated 1-D targets (int32/int64), both ``zero_infinity``; the
reductions (``"mean"``, ``"sum"``, ``"none"``) are applied above the op, which gets the per-sample
gradient. The ``.Tensor`` overload with lengths on the GPU needs no host sync (CUDA-graph capturable);
the int-list overload copies the lengths to the GPU, as PyTorch's kernel does.
"""

from collections.abc import Sequence

import torch
from torch import Tensor

from deepep_lightning.ops._guards import kernels_reason, register_fakes
from deepep_lightning.ops._routes import Route, register_route

__all__ = ["ctc_loss_backward", "ctc_loss_backward_reference"]

_DTYPES = (torch.float32, torch.float64)
_TARGET_DTYPES = (torch.int64, torch.int32)


def ctc_loss_backward_reference(
    grad: Tensor,
    log_probs: Tensor,
    targets: Tensor,
    input_lengths: Sequence[int],
    target_lengths: Sequence[int],
    neg_log_likelihood: Tensor,
    log_alpha: Tensor,
    blank: int,
    zero_infinity: bool = False,
) -> Tensor:
    """PyTorch's CPU ``_ctc_loss_backward`` on CPU copies (deterministic), returned on ``log_probs``' device."""
    return torch.ops.aten._ctc_loss_backward.default(
        grad.cpu(),
        log_probs.cpu(),
        targets.cpu(),
        [int(n) for n in input_lengths],
        [int(n) for n in target_lengths],
        neg_log_likelihood.cpu(),
        log_alpha.cpu(),
        blank,
        zero_infinity,
    ).to(log_probs.device)


def unsupported_reason(
    grad, log_probs, targets, input_lengths, target_lengths, neg_log_likelihood, log_alpha, blank
) -> str | None:
    """Why :func:`ctc_loss_backward` hands these arguments to PyTorch, or ``None`` when it covers them.

    ``input_lengths`` / ``target_lengths`` are int sequences or int tensors; only metadata is read.
    """
    tensors = (grad, log_probs, targets, neg_log_likelihood, log_alpha)
    if any(not isinstance(t, Tensor) for t in tensors):
        return "grad, log_probs, targets, neg_log_likelihood and log_alpha must be tensors"
    if torch.overrides.has_torch_function(tensors):
        return "tensor subclasses are left to PyTorch"
    if log_probs.dim() != 3 or log_probs.dtype not in _DTYPES:
        return (
            f"log_probs must be a 3-D float32/float64 [T, N, C] tensor, got {log_probs.dtype} {tuple(log_probs.shape)}"
        )
    steps, batch, classes = log_probs.shape
    if any(t.dtype != log_probs.dtype for t in (grad, neg_log_likelihood, log_alpha)):
        return "grad, neg_log_likelihood and log_alpha must have log_probs' dtype"
    if any(t.device != log_probs.device for t in tensors):
        return "all tensors must be on log_probs' device"
    if grad.numel() != batch or neg_log_likelihood.numel() != batch:
        return f"grad and neg_log_likelihood must have N = {batch} elements"
    if log_alpha.dim() != 3 or tuple(log_alpha.shape[:2]) != (batch, steps) or log_alpha.shape[2] % 2 != 1:
        return (
            f"log_alpha of shape {tuple(log_alpha.shape)} is not [N, T, 2 L + 1] for log_probs {tuple(log_probs.shape)}"
        )
    if targets.dtype not in _TARGET_DTYPES or targets.dim() not in (1, 2):
        return "targets must be int32/int64, [N, S] or concatenated 1-D"
    if targets.dim() == 2 and (targets.shape[0] != batch or targets.shape[1] < log_alpha.shape[2] // 2):
        return "padded targets must be [N, S] with S >= max target length"
    for name, lengths in (("input_lengths", input_lengths), ("target_lengths", target_lengths)):
        if isinstance(lengths, Tensor):
            if lengths.dim() != 1 or lengths.shape[0] != batch or lengths.dtype.is_floating_point:
                return f"{name} must be [N] integers"
        elif len(lengths) != batch:
            return f"{name} must have N = {batch} entries"
    if isinstance(blank, bool) or not isinstance(blank, int) or not 0 <= blank < classes:
        return f"blank {blank!r} is not a class in [0, {classes})"
    return kernels_reason(log_probs)


def _lengths_tensor(lengths, device: torch.device) -> Tensor:
    if isinstance(lengths, Tensor):
        return lengths.to(device=device, dtype=torch.int64)
    return torch.tensor([int(n) for n in lengths], dtype=torch.int64, device=device)


def ctc_loss_backward(
    grad: Tensor,
    log_probs: Tensor,
    targets: Tensor,
    input_lengths: Sequence[int] | Tensor,
    target_lengths: Sequence[int] | Tensor,
    neg_log_likelihood: Tensor,
    log_alpha: Tensor,
    blank: int,
    zero_infinity: bool = False,
) -> Tensor:
    """Deterministic ``aten::_ctc_loss_backward``: the gradient of the per-sample CTC loss w.r.t. ``log_probs``.

    Args:
        grad: ``[N]`` gradient of the per-sample negative log-likelihood (the reduction's, applied above).
        log_probs: ``[T, N, C]`` float32/float64 log-probabilities (the forward's input).
        targets: ``[N, S]`` padded or ``[sum(target_lengths)]`` concatenated int32/int64 labels.
        input_lengths: ``N`` ints or an ``[N]`` int tensor (on the GPU: no host sync).
        target_lengths: ``N`` ints or an ``[N]`` int tensor.
        neg_log_likelihood: ``[N]``, and ``log_alpha``: ``[N, T, 2 L + 1]``, ``aten::_ctc_loss``'s outputs.
        blank: the blank class.
        zero_infinity: zero the gradient of samples whose loss is infinite (default ``False``).

    Returns:
        ``[T, N, C]`` contiguous; zero for ``t >= input_lengths[n]``.

    Raises:
        ValueError: arguments that are not a CTC backward's (the message says which).

    Example::

        >>> lp = torch.randn(6, 2, 4, dtype=torch.float64).log_softmax(2)
        >>> tg = torch.tensor([[1, 2], [3, 3]])
        >>> nll, alpha = torch.ops.aten._ctc_loss(lp, tg, [6, 5], [2, 2], 0, False)
        >>> ctc_loss_backward(torch.ones(2, dtype=torch.float64), lp, tg, [6, 5], [2, 2], nll, alpha, 0).shape
        torch.Size([6, 2, 4])
    """
    reason = unsupported_reason(
        grad, log_probs, targets, input_lengths, target_lengths, neg_log_likelihood, log_alpha, blank
    )
    if reason is not None:
        raise ValueError(f"ctc_loss_backward: {reason}")
    device = log_probs.device
    return torch.ops.deepep_lightning.ctc_loss_backward.default(
        grad.reshape(-1),
        log_probs,
        targets,
        _lengths_tensor(input_lengths, device),
        _lengths_tensor(target_lengths, device),
        neg_log_likelihood.reshape(-1),
        log_alpha,
        blank,
        bool(zero_infinity),
    )


def _fake(
    grad, log_probs, targets, input_lengths, target_lengths, neg_log_likelihood, log_alpha, blank, zero_infinity=False
):
    torch._check(log_probs.dim() == 3, lambda: f"ctc_loss_backward: log_probs must be [T, N, C], got {log_probs.shape}")
    torch._check(
        log_alpha.dim() == 3 and log_alpha.shape[0] == log_probs.shape[1] and log_alpha.shape[1] == log_probs.shape[0],
        lambda: f"ctc_loss_backward: log_alpha must be [N, T, 2 L + 1], got {tuple(log_alpha.shape)}",
    )
    return torch.empty_like(log_probs, memory_format=torch.contiguous_format)


register_fakes({"deepep_lightning::ctc_loss_backward": _fake})


def _route_covers(
    grad, log_probs, targets, input_lengths, target_lengths, neg_log_likelihood, log_alpha, blank, zero_infinity=False
):
    if not isinstance(log_probs, Tensor) or not log_probs.is_cuda:
        return "only CUDA tensors are routed"
    return unsupported_reason(
        grad, log_probs, targets, input_lengths, target_lengths, neg_log_likelihood, log_alpha, blank
    )


def _route(
    grad, log_probs, targets, input_lengths, target_lengths, neg_log_likelihood, log_alpha, blank, zero_infinity=False
):
    return ctc_loss_backward(
        grad, log_probs, targets, input_lengths, target_lengths, neg_log_likelihood, log_alpha, blank, zero_infinity
    )


register_route(Route("_ctc_loss_backward", _route, _route_covers))
register_route(Route("_ctc_loss_backward.Tensor", _route, _route_covers))
