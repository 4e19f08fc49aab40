"""Pure-PyTorch reference of the fused ops: the fallback without a compiler and the test oracle.

The reference materialises the ``[N, A, H]`` intermediate the fused kernels avoid; it is the
obviously-correct formulation, autograd supplies its backward.
"""

import torch
from torch import Tensor

__all__ = ["all_action_q_reference"]


def all_action_q_reference(z: Tensor, action_embedding: Tensor, w: Tensor, b: Tensor) -> Tensor:
    """All-action value head, ``q[n, a] = sum_h w[h] * tanh(z[n, h] + E[a, h]) + b``.

    Args:
        z: per-row features ``[N, H]`` (e.g. ``Linear([obs; h])``).
        action_embedding: one embedding per action ``[A, H]``.
        w: output weights ``[H]``.
        b: output bias, 0-dim or ``[1]``.

    Returns:
        ``q`` of shape ``[N, A]``, differentiable w.r.t. all four inputs.

    Example::

        >>> z, e, w, b = torch.randn(4, 8), torch.randn(3, 8), torch.randn(8), torch.randn(1)
        >>> all_action_q_reference(z, e, w, b).shape
        torch.Size([4, 3])
    """
    hidden_per_action = torch.tanh(z.unsqueeze(1) + action_embedding.unsqueeze(0))  # [N, A, H]
    return (hidden_per_action * w).sum(dim=-1) + b.reshape(())  # [N, A]
