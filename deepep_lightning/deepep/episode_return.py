"""The epoch's mean return per finished episode, accumulated on the device without a host read.

``torchmetrics.MeanMetric(nan_strategy="disable")`` would be the obvious choice (``"disable"`` is the
only strategy that does not read ``isnan(...).any()`` on the host every update), but in torchmetrics
1.9 it replaces the weights with ones (Lightning-AI/torchmetrics#3434, open): the epoch value became
the plain mean of the per-step means, so a step that finished 2 episodes counted as much as one that
finished 200. This metric keeps the two sums itself.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torchmetrics import Metric

__all__ = ["EpisodeReturnMean"]


class EpisodeReturnMean(Metric):
    """Sum of finished episodes' returns / number of finished episodes (NaN while none finished).

    Example::

        metric = EpisodeReturnMean()
        metric.update(rollout.episode_returns.sum(), rollout.dones.sum())
        self.log("train/episode_return", metric, on_step=False, on_epoch=True)
    """

    full_state_update = False
    total: Tensor
    episodes: Tensor

    def __init__(self) -> None:
        super().__init__()
        self.add_state("total", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("episodes", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, return_sum: Tensor, episodes: Tensor) -> None:
        """Add one step's summed return of the episodes that finished in it, and how many finished."""
        self.total += return_sum.detach().to(self.total.dtype)
        self.episodes += episodes.detach().to(self.episodes.dtype)

    def compute(self) -> Tensor:
        return (self.total / self.episodes).float()
