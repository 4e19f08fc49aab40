"""One timestep of a GRU cell's backward through time, elementwise part: ``deepep::gru_cell_backward``.

With the gate pre-activations of a whole rollout computed by two batched GEMMs
(``gi = F W_ihᵀ + b_ih``, ``gh = H W_hhᵀ + b_hh``, gates ordered ``[r, z, n]`` as in
:class:`torch.nn.GRUCell`), what is left of a timestep's backward is this op (one kernel: every gate
derivative from the incoming gradients) and one ``addmm`` (the gradient into ``h`` through ``W_hh``).
So BPTT costs two kernels per timestep. The math, for ``h' = (1 − z)·n + z·h`` stored as ``m·h'``::

    g       = (grad_output + carry) · m
    dn_pre  = g (1 − z)(1 − n²),   dz_pre = g (h − n) z (1 − z),   dr_pre = dn_pre · gh_n · r (1 − r)
    grad_input_gates  = [dr_pre, dz_pre, dn_pre]
    grad_hidden_gates = [dr_pre, dz_pre, dn_pre · r]
    grad_hidden       = g · z

Python layer: argument checks (before the compiled op runs: a bad input is named, never reaches the kernel),
the fake kernel for tracing, the pure-PyTorch reference (the fallback without the extension and the tests'
oracle). The op is itself a backward, so it has no autograd formula.
"""

from __future__ import annotations

import torch
from torch import Tensor

from deepep_lightning.ops import kernels_reason, on_extension_loaded, require_tensors

__all__ = [
    "check_gru_cell_backward_inputs",
    "gru_cell_backward",
    "gru_cell_backward_reference",
    "gru_cell_backward_unchecked",
]

_OP = "gru_cell_backward"
_FLOAT_DTYPES = (torch.float32, torch.float64)


def check_gru_cell_backward_inputs(
    grad_output: Tensor, carry: Tensor, mask: Tensor, input_gates: Tensor, hidden_gates: Tensor, hidden: Tensor
) -> None:
    """Raise naming the argument when a shape, dtype or device does not fit (see :func:`gru_cell_backward`)."""
    named = {
        "grad_output": grad_output,
        "carry": carry,
        "mask": mask,
        "input_gates": input_gates,
        "hidden_gates": hidden_gates,
        "hidden": hidden,
    }
    require_tensors(_OP, named)
    if hidden.dim() != 2:
        raise ValueError(f"{_OP}: hidden must be 2-D [B, H], got shape {tuple(hidden.shape)}")
    if hidden.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{_OP}: hidden must be float32 or float64, got {hidden.dtype!r}")
    batch, size = hidden.shape
    expected = {
        "grad_output": (batch, size),
        "carry": (batch, size),
        "mask": (batch,),
        "input_gates": (batch, 3 * size),
        "hidden_gates": (batch, 3 * size),
    }
    for name, shape in expected.items():
        value = named[name]
        if tuple(value.shape) != shape:
            raise ValueError(
                f"{_OP}: {name} must have shape {shape} for hidden {tuple(hidden.shape)}, got {tuple(value.shape)}"
            )
        if value.dtype != hidden.dtype:
            raise TypeError(f"{_OP}: {name} must have hidden's dtype {hidden.dtype}, got {value.dtype!r}")
        if value.device != hidden.device:
            raise ValueError(f"{_OP}: {name} must be on hidden's device {hidden.device}, got {value.device!r}")


def gru_cell_backward_reference(
    grad_output: Tensor, carry: Tensor, mask: Tensor, input_gates: Tensor, hidden_gates: Tensor, hidden: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """The pure-PyTorch form of :func:`gru_cell_backward` (same arguments, same results to rounding)."""
    g = (grad_output + carry) * mask.unsqueeze(-1)  # [B, H]
    gi_r, gi_z, gi_n = input_gates.chunk(3, dim=-1)
    gh_r, gh_z, gh_n = hidden_gates.chunk(3, dim=-1)
    r = torch.sigmoid(gi_r + gh_r)
    z = torch.sigmoid(gi_z + gh_z)
    n = torch.tanh(gi_n + r * gh_n)
    n_pre = g * (1 - z) * (1 - n * n)
    z_pre = g * (hidden - n) * z * (1 - z)
    r_pre = n_pre * gh_n * r * (1 - r)
    return torch.cat((r_pre, z_pre, n_pre), dim=-1), torch.cat((r_pre, z_pre, n_pre * r), dim=-1), g * z


def gru_cell_backward_unchecked(
    grad_output: Tensor, carry: Tensor, mask: Tensor, input_gates: Tensor, hidden_gates: Tensor, hidden: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`gru_cell_backward` without the checks, for a loop that checked its (fixed) shapes once."""
    if kernels_reason(hidden) is None:
        return torch.ops.deepep.gru_cell_backward.default(grad_output, carry, mask, input_gates, hidden_gates, hidden)
    return gru_cell_backward_reference(grad_output, carry, mask, input_gates, hidden_gates, hidden)


def gru_cell_backward(
    grad_output: Tensor, carry: Tensor, mask: Tensor, input_gates: Tensor, hidden_gates: Tensor, hidden: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Gate gradients of one GRU timestep from the gradients into its masked output.

    Runs the compiled kernel (one launch, no reduction, bitwise reproducible) when the extension is
    available for the tensors' device, otherwise :func:`gru_cell_backward_reference`.

    Args:
        grad_output: ``[B, H]`` gradient of the loss w.r.t. the stored state ``m·h'`` from outside the
            recurrence (the value head).
        carry: ``[B, H]`` gradient w.r.t. the same state through the next timestep.
        mask: ``[B]`` ``m``, 1 where the episode goes on, 0 where it ended (the state was reset).
        input_gates: ``[B, 3H]`` ``gi = W_ih f + b_ih``, gates ``[r, z, n]``.
        hidden_gates: ``[B, 3H]`` ``gh = W_hh h + b_hh``.
        hidden: ``[B, H]`` the state ``h`` the timestep read, float32 or float64; every tensor has its
            dtype and device.

    Returns:
        ``(grad_input_gates [B, 3H], grad_hidden_gates [B, 3H], grad_hidden [B, H])``: the gradients
        w.r.t. ``gi`` and ``gh``, and w.r.t. ``h`` through the blend ``z·h`` alone (the caller adds
        ``grad_hidden_gates @ W_hh``).

    Raises:
        TypeError: a non-tensor, a dtype other than float32/float64, mixed dtypes.
        ValueError: a shape that does not fit ``hidden``'s ``[B, H]``, mixed devices.

    Example::

        >>> b, h = 4, 3
        >>> grads = gru_cell_backward(torch.randn(b, h), torch.zeros(b, h), torch.ones(b),
        ...                           torch.randn(b, 3 * h), torch.randn(b, 3 * h), torch.randn(b, h))
        >>> [tuple(g.shape) for g in grads]
        [(4, 9), (4, 9), (4, 3)]
    """
    check_gru_cell_backward_inputs(grad_output, carry, mask, input_gates, hidden_gates, hidden)
    return gru_cell_backward_unchecked(grad_output, carry, mask, input_gates, hidden_gates, hidden)


def _fake(
    grad_output: Tensor, carry: Tensor, mask: Tensor, input_gates: Tensor, hidden_gates: Tensor, hidden: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    torch._check(hidden.dim() == 2, lambda: f"{_OP}: hidden must be 2-D [B, H], got shape {tuple(hidden.shape)}")
    torch._check(
        input_gates.shape == hidden_gates.shape and input_gates.shape[1] == 3 * hidden.shape[1],
        lambda: f"{_OP}: input_gates and hidden_gates must be [B, 3H], got {tuple(input_gates.shape)}",
    )
    torch._check(mask.dim() == 1 and mask.shape[0] == hidden.shape[0], lambda: f"{_OP}: mask must be [B]")
    # The kernels return contiguous tensors; so does the fake, stride for stride.
    return (
        input_gates.new_empty(input_gates.shape),
        hidden_gates.new_empty(hidden_gates.shape),
        hidden.new_empty(hidden.shape),
    )


def _register() -> None:
    torch.library.register_fake(f"deepep::{_OP}")(_fake)


on_extension_loaded(_register)
