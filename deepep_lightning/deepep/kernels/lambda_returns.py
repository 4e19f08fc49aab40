"""λ-returns of a ``[T, B]`` rollout: ``deepep::lambda_returns`` and its pure-PyTorch reference.

The recursion ``G_t = r_t + γ(1 − d_t)[(1 − λ) V_{t+1} + λ G_{t+1}]`` runs backwards over the
timesteps. Op by op it costs six elementwise kernels per timestep (1,536 launches at T=256, the
largest share of a DeepEP train step's kernels once the rollout is one launch); the compiled op runs
each column's recursion in one thread, one launch in all. It does the reference's operations in the
reference's order with one rounding each, so its returns are the reference's **bit for bit** on CPU
and CUDA, float32 and float64 (the tests check it), and a run's numbers do not depend on which path
computed its targets.

Python layer: argument checks (before the compiled op runs: a bad input is named, never reaches the kernel),
the fake kernel for tracing, the reference (the fallback without the extension, for other dtypes and for inputs
that need gradients: the op has no autograd formula, the targets of the loss are computed without one).
"""

from __future__ import annotations

import torch
from torch import Tensor

from deepep_lightning.ops import kernels_reason, on_extension_loaded, require_tensors
from deepep_lightning.validation import number

__all__ = ["check_lambda_returns_inputs", "lambda_returns", "lambda_returns_reference"]

_OP = "lambda_returns"
_FLOAT_DTYPES = (torch.float32, torch.float64)


def check_lambda_returns_inputs(
    rewards: Tensor, dones: Tensor, values: Tensor, bootstrap_value: Tensor, gamma: float, lam: float
) -> None:
    """Raise naming the argument when a shape, dtype, device or coefficient does not fit (:func:`lambda_returns`)."""
    named = {"rewards": rewards, "dones": dones, "values": values, "bootstrap_value": bootstrap_value}
    require_tensors(_OP, named)
    if rewards.dim() != 2:
        raise ValueError(f"{_OP}: rewards must be 2-D [T, B], got shape {tuple(rewards.shape)}")
    if not rewards.is_floating_point():
        raise TypeError(f"{_OP}: rewards must be a floating-point tensor, got {rewards.dtype!r}")
    if dones.dtype != torch.bool:
        raise TypeError(f"{_OP}: dones must be a bool tensor (true terminals), got {dones.dtype!r}")
    if values.dtype != rewards.dtype or bootstrap_value.dtype != rewards.dtype:
        wrong = "values" if values.dtype != rewards.dtype else "bootstrap_value"
        raise TypeError(f"{_OP}: {wrong} must have rewards' dtype {rewards.dtype}, got {named[wrong].dtype!r}")
    expected = {"dones": tuple(rewards.shape), "values": tuple(rewards.shape), "bootstrap_value": (rewards.shape[1],)}
    for name, shape in expected.items():
        value = named[name]
        if tuple(value.shape) != shape:
            raise ValueError(
                f"{_OP}: {name} must have shape {shape} for rewards {tuple(rewards.shape)}, got {tuple(value.shape)}"
            )
        if value.device != rewards.device:
            raise ValueError(f"{_OP}: {name} must be on rewards' device {rewards.device}, got {value.device!r}")
    for name, coefficient in (("gamma", gamma), ("lam", lam)):
        number(_OP, name, coefficient, minimum=0, maximum=1, error=ValueError)


def lambda_returns_reference(
    rewards: Tensor, dones: Tensor, values: Tensor, bootstrap_value: Tensor, gamma: float, lam: float
) -> Tensor:
    """The pure-PyTorch form of :func:`lambda_returns` (same arguments, the same bits), differentiable."""
    not_done = (~dones).to(rewards.dtype)
    next_values = torch.cat((values[1:], bootstrap_value.unsqueeze(0)), dim=0)  # [T, B]
    returns = torch.empty_like(rewards)
    running = bootstrap_value
    for t in range(rewards.shape[0] - 1, -1, -1):
        running = rewards[t] + gamma * not_done[t] * ((1.0 - lam) * next_values[t] + lam * running)
        returns[t] = running
    return returns


def _compiled_kernel_for(rewards: Tensor, values: Tensor, bootstrap_value: Tensor) -> bool:
    if rewards.dtype not in _FLOAT_DTYPES:
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in (rewards, values, bootstrap_value)):
        return False  # no autograd formula: the reference keeps the graph
    return kernels_reason(rewards) is None


def lambda_returns(
    rewards: Tensor, dones: Tensor, values: Tensor, bootstrap_value: Tensor, gamma: float, lam: float
) -> Tensor:
    """λ-returns ``G_t = r_t + γ(1 − d_t)[(1 − λ) V(s_{t+1}) + λ G_{t+1}]``, ``[T, B]``.

    ``dones`` are true terminals only (pass time-limit truncations as not done). ``values[t]`` is V(s_t)
    (for the expected-value critic, ``Σ_a π(a|s_t) Q(s_t, a)``), and the recursion starts from
    ``G_T = V(s_T) = bootstrap_value``. ``λ = 1`` gives Monte-Carlo returns bootstrapped at the rollout
    end, ``λ = 0`` one-step expected-SARSA targets.

    Runs ``deepep::lambda_returns`` (one launch, bitwise the reference) when the extension is available
    for the tensors' device and dtype and no input needs a gradient, otherwise
    :func:`lambda_returns_reference`.

    Args:
        rewards: ``[T, B]`` float rewards.
        dones: ``[T, B]`` bool, true where the episode terminated at step t.
        values: ``[T, B]`` ``V(s_t)``, rewards' dtype and device.
        bootstrap_value: ``[B]`` ``V(s_T)``.
        gamma: discount in ``[0, 1]``.
        lam: λ in ``[0, 1]``.

    Returns:
        ``[T, B]`` returns, rewards' dtype and device.

    Raises:
        TypeError: a non-tensor, non-bool ``dones``, mixed float dtypes.
        ValueError: a shape that does not fit ``rewards``' ``[T, B]``, mixed devices, a coefficient
            outside ``[0, 1]``.

    Example::

        >>> rewards = torch.ones(3, 2)
        >>> dones = torch.tensor([[False, False], [False, True], [False, False]])
        >>> lambda_returns(rewards, dones, torch.zeros(3, 2), torch.zeros(2), gamma=0.5, lam=1.0)
        tensor([[1.7500, 1.5000],
                [1.5000, 1.0000],
                [1.0000, 1.0000]])
    """
    check_lambda_returns_inputs(rewards, dones, values, bootstrap_value, gamma, lam)
    if _compiled_kernel_for(rewards, values, bootstrap_value):
        op = torch.ops.deepep.lambda_returns.default
        return op(rewards, dones, values, bootstrap_value, float(gamma), float(lam))
    return lambda_returns_reference(rewards, dones, values, bootstrap_value, gamma, lam)


def _fake(rewards: Tensor, dones: Tensor, values: Tensor, bootstrap_value: Tensor, gamma: float, lam: float) -> Tensor:
    torch._check(rewards.dim() == 2, lambda: f"{_OP}: rewards must be 2-D [T, B], got shape {tuple(rewards.shape)}")
    torch._check(dones.shape == rewards.shape and values.shape == rewards.shape, lambda: f"{_OP}: [T, B] inputs")
    torch._check(bootstrap_value.shape == rewards.shape[1:], lambda: f"{_OP}: bootstrap_value must be [B]")
    return rewards.new_empty(rewards.shape)  # the kernels return a contiguous tensor; so does the fake


def _register() -> None:
    torch.library.register_fake(f"deepep::{_OP}")(_fake)


on_extension_loaded(_register)
