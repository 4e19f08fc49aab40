"""Slow targets of the DeepEP update: a Polyak-averaged critic and an adaptive entropy coefficient.

Both are in-place updates of tensors the step owns (no new tensors, no host reads, fixed shapes), so
they run inside the captured CUDA graph of the training step and are bitwise repeatable.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["adapt_entropy_coef_", "polyak_update_"]


@torch.no_grad()
def polyak_update_(target: Sequence[torch.Tensor], online: Sequence[torch.Tensor], tau: float) -> None:
    """``target ← target + τ·(online − target)`` for every pair, in place (``torch._foreach_lerp_``).

    The target critic that bootstraps the critic's λ-returns then follows the online critic with a lag
    of about ``1/τ`` steps: its targets stop moving with every update of the network they train, which
    is what lets the bootstrapped regression settle instead of chasing itself.

    Raises:
        ValueError: the two sequences differ in length, or ``tau`` is not in (0, 1].
    """
    if len(target) != len(online):
        raise ValueError(f"polyak_update_: {len(target)} target tensors for {len(online)} online tensors")
    if not 0.0 < tau <= 1.0:
        raise ValueError(f"polyak_update_: tau must be in (0, 1], got {tau!r}")
    torch._foreach_lerp_(list(target), list(online), tau)


@torch.no_grad()
def adapt_entropy_coef_(
    log_coef: torch.Tensor, entropy: torch.Tensor, target_entropy: float, rate: float, low: float, high: float
) -> None:
    """Dual ascent on ``log α``: ``log α += rate·(target_entropy − entropy)``, clamped to ``[log low, log high]``.

    Below its target entropy the policy gets a larger entropy bonus, above it a smaller one, down to
    ``low`` (the configured ``entropy_coef``). The bonus keeps the softmax away from saturation, where
    the all-action gradient ``π(Q − V)`` vanishes and a policy that has locked onto one action cannot
    move back. ``entropy`` is the rollout's mean policy entropy (a 0-d tensor, read without a sync).
    """
    log_coef.add_(target_entropy - entropy.detach(), alpha=rate)
    log_coef.clamp_(min=math.log(low) if low > 0 else -math.inf, max=math.log(high))
