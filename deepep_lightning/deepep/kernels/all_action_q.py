"""Fused all-action value head ``q[n, a] = sum_h w[h] * tanh(z[n, h] + E[a, h]) + b``.

Python layer of ``torch.ops.deepep.all_action_q``: argument checks, the fake (meta) kernels that
make the op traceable by ``torch.compile``, and its autograd formula (a second fused op,
``deepep::all_action_q_backward``, gives dz, dE, dw and db in one pass without storing the
``[N, A, H]`` intermediate). Without a compiler the reference in :mod:`.reference` is used.
"""

import torch
from torch import Tensor

from deepep_lightning.deepep.kernels.reference import all_action_q_reference
from deepep_lightning.ops import kernels_reason, register_op_python_side, require_tensors

__all__ = ["all_action_q"]

_FLOAT_DTYPES = (torch.float32, torch.float64)
_OP = "all_action_q"


def _check_same_dtype_device(z: Tensor, other: Tensor, name: str) -> None:
    if other.dtype != z.dtype:
        raise TypeError(f"{_OP}: {name} must have z's dtype {z.dtype}, got {other.dtype!r}")
    if other.device != z.device:
        raise ValueError(f"{_OP}: {name} must be on z's device {z.device}, got {other.device!r}")


def _check_inputs(z: Tensor, action_embedding: Tensor, w: Tensor, b: Tensor, deterministic: bool) -> None:
    require_tensors(_OP, {"z": z, "action_embedding": action_embedding, "w": w, "b": b})
    if not isinstance(deterministic, bool):
        raise TypeError(f"{_OP}: deterministic must be a bool, got {deterministic!r}")
    if z.dim() != 2:
        raise ValueError(f"{_OP}: z must be 2-D [N, H], got shape {tuple(z.shape)}")
    if z.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{_OP}: z must be float32 or float64, got {z.dtype!r}. HINT: cast the inputs with .float().")
    if z.shape[1] < 1:
        raise ValueError(f"{_OP}: z must have H >= 1 columns, got shape {tuple(z.shape)}")
    if action_embedding.dim() != 2 or action_embedding.shape[0] < 1 or action_embedding.shape[1] != z.shape[1]:
        raise ValueError(
            f"{_OP}: action_embedding must be [A, {z.shape[1]}] with A >= 1 to match z of shape "
            f"{tuple(z.shape)}, got shape {tuple(action_embedding.shape)}"
        )
    if w.dim() != 1 or w.shape[0] != z.shape[1]:
        raise ValueError(
            f"{_OP}: w must be [{z.shape[1]}] to match z of shape {tuple(z.shape)}, got shape {tuple(w.shape)}"
        )
    if b.dim() > 1 or b.numel() != 1:
        raise ValueError(f"{_OP}: b must be 0-dim or [1], got shape {tuple(b.shape)}")
    for name, value in (("action_embedding", action_embedding), ("w", w), ("b", b)):
        _check_same_dtype_device(z, value, name)


def all_action_q(z: Tensor, action_embedding: Tensor, w: Tensor, b: Tensor, *, deterministic: bool = True) -> Tensor:
    """Q-values of every action at once, ``q[n, a] = sum_h w[h] * tanh(z[n, h] + E[a, h]) + b``.

    Uses the fused C++/CUDA kernels (never materialising ``[N, A, H]``) when the extension is
    available, otherwise the pure-PyTorch reference. Differentiable w.r.t. all four tensors
    (first order), traceable by ``torch.compile(fullgraph=True)``, CUDA-graph capturable.

    Args:
        z: per-row features ``[N, H]``, float32 or float64.
        action_embedding: one embedding per action ``[A, H]``, same dtype and device as ``z``.
        w: output weights ``[H]``.
        b: output bias, 0-dim or ``[1]``.
        deterministic: CUDA backward variant. ``True`` (default): fixed-order blocked reduction,
            bitwise reproducible. ``False``: float ``atomicAdd`` reduction, not reproducible in
            the last bits; raises under ``torch.use_deterministic_algorithms(True)`` (warns with
            ``warn_only=True``). Ignored on CPU, where the kernel is always deterministic.

    Returns:
        ``q`` of shape ``[N, A]``, dtype and device of ``z``.

    Raises:
        TypeError: a non-tensor argument, a dtype other than float32/float64, mixed dtypes.
        ValueError: wrong ranks or shapes (H mismatch, ``b`` not a scalar), mixed devices.

    Example::

        >>> z, e = torch.randn(4, 8), torch.randn(3, 8)
        >>> w, b = torch.randn(8), torch.zeros(1)
        >>> all_action_q(z, e, w, b).shape
        torch.Size([4, 3])
    """
    _check_inputs(z, action_embedding, w, b, deterministic)
    if kernels_reason(z) is None:
        return torch.ops.deepep.all_action_q.default(z, action_embedding, w, b, deterministic)
    return all_action_q_reference(z, action_embedding, w, b)


def _fake_forward(z: Tensor, action_embedding: Tensor, w: Tensor, b: Tensor, deterministic: bool = True) -> Tensor:
    torch._check(z.dim() == 2, lambda: f"{_OP}: z must be 2-D [N, H], got shape {tuple(z.shape)}")
    torch._check(action_embedding.dim() == 2, lambda: f"{_OP}: action_embedding must be 2-D [A, H]")
    torch._check(
        action_embedding.shape[1] == z.shape[1],
        lambda: (
            f"{_OP}: action_embedding must be [A, H] matching z {tuple(z.shape)}, got {tuple(action_embedding.shape)}"
        ),
    )
    torch._check(w.dim() == 1 and w.shape[0] == z.shape[1], lambda: f"{_OP}: w must be [H], got {tuple(w.shape)}")
    torch._check(b.numel() == 1, lambda: f"{_OP}: b must be 0-dim or [1], got {tuple(b.shape)}")
    return z.new_empty((z.shape[0], action_embedding.shape[0]))  # [N, A]


def _fake_backward(
    grad_q: Tensor, z: Tensor, action_embedding: Tensor, w: Tensor, deterministic: bool = True
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    torch._check(
        grad_q.dim() == 2 and grad_q.shape[0] == z.shape[0] and grad_q.shape[1] == action_embedding.shape[0],
        lambda: f"{_OP}_backward: grad_q must be [N, A], got {tuple(grad_q.shape)}",
    )
    # The kernels return contiguous gradients; so must the fake, stride for stride.
    return z.new_empty(z.shape), z.new_empty(action_embedding.shape), z.new_empty(w.shape), z.new_empty(())


def _setup_context(ctx, inputs, output) -> None:
    z, action_embedding, w, b = inputs[:4]
    ctx.deterministic = inputs[4] if len(inputs) > 4 else True
    ctx.bias_shape = b.shape
    ctx.save_for_backward(z, action_embedding, w)


def _backward(ctx, grad_q: Tensor):
    z, action_embedding, w = ctx.saved_tensors
    dz, d_embedding, dw, db = torch.ops.deepep.all_action_q_backward.default(
        grad_q, z, action_embedding, w, ctx.deterministic
    )
    return dz, d_embedding, dw, db.reshape(ctx.bias_shape), None


register_op_python_side("all_action_q", _fake_forward, _fake_backward, _backward, _setup_context, namespace="deepep")
