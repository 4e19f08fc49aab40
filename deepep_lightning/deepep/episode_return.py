"""The epoch's mean return per finished episode, accumulated on the device without a host read.

``torchmetrics.MeanMetric(nan_strategy="disable")`` would be the obvious choice (``"disable"`` is the
only strategy that does not read ``isnan(...).any()`` on the host every update), but in torchmetrics
1.9 it replaces the weights with ones (Lightning-AI/torchmetrics#3434, open): the epoch value became
the plain mean of the per-step means, so a step that finished 2 episodes counted as much as one that
finished 200. This metric keeps the two sums itself.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torchmetrics import Metric

__all__ = ["EpisodeReturnMean", "RollingEpisodeReturn"]


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


class RollingEpisodeReturn(nn.Module):
    """Mean return of the last ``window`` finished episodes, kept on the device and updated without a host read.

    The ring of the last ``window`` returns and the count of finished episodes are buffers, so
    checkpoints and rollbacks carry them and a resumed run reports the same figure. An update is a
    fixed-shape computation (no data-dependent shapes, no scatter with repeated indices), so it can
    run inside a CUDA graph and is bitwise reproducible: episodes are taken in time-major order
    (``[T, B]`` flattened) and each ring slot receives at most one of them per update.

    Args:
        window: how many of the latest finished episodes the mean covers.

    Example::

        rolling = RollingEpisodeReturn(100)
        rolling.update(rollout.episode_returns, rollout.dones)
        self.log("train/episode_return_100", rolling.compute())  # NaN until an episode finished
    """

    ring: Tensor
    count: Tensor

    def __init__(self, window: int = 100) -> None:
        super().__init__()
        if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
            raise ValueError(f"`RollingEpisodeReturn(window=...)` must be a positive int, got {window!r}")
        self.window = window
        self.register_buffer("ring", torch.zeros(window, dtype=torch.float32))
        self.register_buffer("count", torch.zeros((), dtype=torch.int64))

    @torch.no_grad()
    def update(self, episode_returns: Tensor, dones: Tensor) -> None:
        """Add the episodes that finished in one rollout: ``episode_returns`` where ``dones`` (both ``[T, B]``)."""
        done = dones.reshape(-1).to(torch.int64)  # [N], time-major
        returns = episode_returns.reshape(-1).to(self.ring.dtype)  # [N]
        rank = torch.cumsum(done, 0)  # [N]: 1..n at the finished episodes
        finished = rank[-1] if rank.numel() else torch.zeros((), dtype=torch.int64, device=done.device)
        kept = (done > 0) & (rank > finished - self.window)  # only the last `window` of this rollout
        position = (self.count + rank - 1) % self.window  # [N]
        slots = torch.arange(self.window, device=done.device)
        match = kept.unsqueeze(0) & (position.unsqueeze(0) == slots.unsqueeze(1))  # [window, N], <= 1 per row
        written = match.any(dim=1)
        value = (match.to(returns.dtype) * returns.unsqueeze(0)).sum(dim=1)  # one non-zero term per row: exact
        self.ring.copy_(torch.where(written, value, self.ring))
        self.count.add_(finished)

    def compute(self) -> Tensor:
        """The mean over ``min(count, window)`` episodes, NaN before the first one (a device tensor)."""
        valid = torch.arange(self.window, device=self.ring.device) < self.count
        total = torch.where(valid, self.ring, torch.zeros_like(self.ring)).sum()
        episodes = valid.sum().to(self.ring.dtype)
        return torch.where(episodes > 0, total / episodes.clamp(min=1), torch.full_like(total, float("nan")))
