"""Deterministic ``nll_loss2d`` forward (4-D ``F.cross_entropy`` / ``F.nll_loss``) routed at the dispatcher.

PyTorch's CUDA ``nll_loss2d_forward`` adds block sums into the loss with float ``atomicAdd`` for
``reduction="mean"``/``"sum"`` and is refused under ``torch.use_deterministic_algorithms(True)``
(``nll_loss2d_forward_out_cuda_template does not have a deterministic implementation``).
``F.cross_entropy`` reaches it inside C++ (``aten::cross_entropy_loss`` -> ``nll_loss_nd``, which also
reshapes 3-D and 5-D+ inputs to 4-D), so the route sits on ``aten::nll_loss2d_forward`` itself.

* covered: ``self`` ``[N, C, H, W]`` float16/bfloat16/float32/float64 (any strides, channels-last
  included, empty batch included), ``target`` ``[N, H, W]`` int64, optional ``weight`` ``[C]`` of
  ``self``'s dtype, ``reduction`` mean or sum, any ``ignore_index``. CUDA: a fixed-order two-pass block
  reduction (``extensions/csrc/cuda/nll_loss2d_forward.cu``); CPU: PyTorch's kernel.
* ``reduction="none"`` is not refused (one thread per pixel, no reduction) and stays PyTorch's;
  everything else goes to PyTorch's kernel: its result and its own errors.
* ``nll_loss2d_backward`` writes one gradient element per pixel without atomics; PyTorch does not
  refuse it and it is not routed.
"""

import torch
from torch import Tensor

from deepep_lightning.ops._guards import FLOAT_DTYPES, kernels_reason, register_fakes
from deepep_lightning.ops._routes import Route, register_route

__all__ = ["nll_loss2d_forward", "nll_loss2d_unsupported_reason"]

_OP = "nll_loss2d_forward"
_DTYPES = FLOAT_DTYPES
_REDUCTIONS = {1: "mean", 2: "sum"}


def nll_loss2d_unsupported_reason(
    self: Tensor, target: Tensor, weight: Tensor | None, reduction: int, ignore_index: int
) -> str | None:
    """Why the deterministic ``nll_loss2d_forward`` would hand these arguments to PyTorch, or ``None``."""
    if not isinstance(self, Tensor) or not isinstance(target, Tensor):
        return "self and target must be torch.Tensor"
    if reduction not in _REDUCTIONS:
        return f"reduction={reduction!r} is not refused by PyTorch (only mean=1 and sum=2 are routed)"
    if self.dim() != 4 or self.dtype not in _DTYPES:
        return f"self must be 4-D and one of {list(_DTYPES)}, got {self.dim()}-D {self.dtype}"
    if self.shape[1] == 0:
        return "self has no classes: left to PyTorch to validate"
    if target.dtype != torch.int64 or target.dim() != 3:
        return f"target must be 3-D int64, got {target.dim()}-D {target.dtype}"
    if tuple(target.shape) != (self.shape[0], self.shape[2], self.shape[3]):
        return f"target shape {tuple(target.shape)} does not match self {tuple(self.shape)}"
    if target.device != self.device:
        return "self and target are on different devices"
    if weight is not None and (
        not isinstance(weight, Tensor)
        or weight.dim() != 1
        or weight.numel() != self.shape[1]
        or weight.dtype != self.dtype
        or weight.device != self.device
    ):
        return "weight must be [C] of self's dtype and device"
    if not isinstance(ignore_index, int):
        return f"ignore_index={ignore_index!r} is not an int"
    return kernels_reason(self)


def nll_loss2d_forward(
    self: Tensor, target: Tensor, weight: Tensor | None, reduction: int, ignore_index: int
) -> tuple[Tensor, Tensor]:
    """``aten::nll_loss2d_forward`` (same arguments and results), deterministic for covered arguments.

    Args:
        self: log-probabilities ``[N, C, H, W]``.
        target: class indices ``[N, H, W]`` (int64); pixels equal to ``ignore_index`` are skipped.
        weight: optional per-class weights ``[C]``.
        reduction: 1 (mean over the summed weights of the non-ignored pixels) or 2 (sum).
        ignore_index: target value that contributes nothing.

    Returns:
        ``(output, total_weight)``, both 0-dim; mean with every pixel ignored is ``nan`` as in PyTorch.

    Raises:
        RuntimeError: PyTorch's own errors for uncovered arguments (they go to ``aten``).

    Example::

        >>> logp = torch.randn(2, 3, 4, 4).log_softmax(1)
        >>> target = torch.randint(0, 3, (2, 4, 4))
        >>> loss, total = nll_loss2d_forward(logp, target, None, 1, -100)
        >>> torch.allclose(loss, torch.nn.functional.nll_loss(logp, target))
        True
    """
    if nll_loss2d_unsupported_reason(self, target, weight, reduction, ignore_index) is not None:
        return torch.ops.aten.nll_loss2d_forward.default(self, target, weight, reduction, ignore_index)
    return torch.ops.deepep_lightning.nll_loss2d_forward.default(self, target, weight, reduction, ignore_index)


def _fake(self: Tensor, target: Tensor, weight: Tensor | None, reduction: int, ignore_index: int):
    torch._check(self.dim() == 4, lambda: f"{_OP}: self must be 4-D, got shape {tuple(self.shape)}")
    torch._check(
        target.dim() == 3 and tuple(target.shape) == (self.shape[0], self.shape[2], self.shape[3]),
        lambda: f"{_OP}: target must be [N, H, W] matching {tuple(self.shape)}, got {tuple(target.shape)}",
    )
    output = self.new_empty(()) if reduction != 0 else self.new_empty(tuple(target.shape))
    return output, self.new_empty(())


register_fakes({f"deepep_lightning::{_OP}": _fake})


def _route(self: Tensor, target: Tensor, weight: Tensor | None, reduction: int, ignore_index: int):
    return torch.ops.deepep_lightning.nll_loss2d_forward.default(self, target, weight, reduction, ignore_index)


register_route(Route("nll_loss2d_forward", _route, nll_loss2d_unsupported_reason))
