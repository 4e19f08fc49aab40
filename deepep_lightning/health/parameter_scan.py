"""The epoch-end scan of every parameter: its largest magnitude, read to the host in one transfer.

Per-step checks test the parameters through the flags table without a host sync; once per epoch
:class:`~deepep_lightning.health.health_callback.NumericalHealthCallback` also names the parameter
that went non-finite or grew past ``param_max_abs``, which needs each one's ``max |w|`` on the host:
one stacked tensor, one ``.cpu()``. A sharded parameter (``DTensor``) is scanned on this rank's shard.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch

from deepep_lightning._sharded import local

__all__ = ["parameter_max_abs"]


def parameter_max_abs(pl_module: pl.LightningModule) -> dict[str, float]:
    """``max |w|`` of every parameter by name, in ``named_parameters`` order (0.0 for an empty one)."""
    params = {n: local(p.detach()) for n, p in pl_module.named_parameters()}
    if not params:
        return {}
    maxes = torch.stack(
        [t.abs().max().float() if t.numel() else t.new_zeros((), dtype=torch.float32) for t in params.values()]
    )
    host = maxes.cpu().tolist()  # once per epoch: a sync is fine here
    return dict(zip(params, host))
