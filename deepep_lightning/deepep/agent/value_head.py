"""All-action value head: Q(s, a) for every action in one call."""

from __future__ import annotations

import torch
from torch import nn

from deepep_lightning.deepep import kernels

__all__ = ["AllActionValueHead"]


class AllActionValueHead(nn.Module):
    """``Q(s, a) = w2ᵀ tanh(W1·x + E[a]) + b2`` for all actions at once, ``x = [obs; h]``.

    The second layer is exactly the workload's fused op ``deepep::all_action_q``, so the
    ``[N, A, H]`` intermediate never exists when ``fused=True``; ``fused=False`` runs the
    pure-PyTorch reference (same function, fp32 rounding apart).

    Args:
        in_features: size of ``x``.
        hidden_size: H.
        num_actions: A.
        fused: use the compiled op (needs the extension; see :mod:`deepep_lightning.deepep.kernels`).
        deterministic: the compiled op's CUDA backward variant (``False``: atomic, see
            :func:`deepep_lightning.deepep.kernels.all_action_q`).
    """

    def __init__(
        self, in_features: int, hidden_size: int, num_actions: int, fused: bool = False, deterministic: bool = True
    ) -> None:
        super().__init__()
        self.input_layer = nn.Linear(in_features, hidden_size)  # W1, and its bias
        # Random E (std 0.5, the scale of W1·x): action and state interact through tanh from the first
        # step. With E = 0 every unit's gradient w.r.t. E[a] starts identical across actions and the
        # critic sat on a plateau: the 4-step cue-recall task took ~1000 steps instead of ~200
        # (BENCHMARKS.md, "Learning").
        self.action_embedding = nn.Parameter(torch.randn(num_actions, hidden_size) * 0.5)  # E [A, H]
        self.output_weight = nn.Parameter(torch.randn(hidden_size) / hidden_size**0.5)  # w2 [H]
        self.output_bias = nn.Parameter(torch.zeros(1))  # b2
        self.fused = fused
        self.deterministic = deterministic

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [N, in] -> q [N, A]
        z = self.input_layer(x)  # [N, H]
        if self.fused:  # looked up at call time, so a test may wrap it
            return kernels.all_action_q(
                z, self.action_embedding, self.output_weight, self.output_bias, deterministic=self.deterministic
            )
        return kernels.all_action_q_reference(z, self.action_embedding, self.output_weight, self.output_bias)
