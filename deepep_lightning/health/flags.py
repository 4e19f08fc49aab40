"""Per-step health values kept on the device, read by the host only at a check.

Each optimizer step owns one row of a small device table: the loss, the gradients' largest
absolute element and L2 norm, and (at a check) the parameters' largest absolute element.
Recording is a device write into the preallocated row (no host synchronisation); opening a step
is host bookkeeping only. The host reads every row written since the last check in **one**
transfer (:func:`_read_to_host`), every ``check_every_n_steps`` steps, and decides finiteness
there from the values: a NaN or Inf anywhere in a tensor makes its largest absolute element
non-finite, and a max-norm cannot overflow, so a huge but finite gradient whose sum of squares
exceeds float32 is not reported as non-finite (its L2 norm may read as inf). One row per step
(not one AND-ed flag) so a check names the first bad step, not only the interval.

Sharded parameters (``DTensor``: FSDP2, tensor parallel) are checked on the local shard each rank
owns, with no collective; an empty shard (a tensor smaller than the mesh) is left out. The ranks'
verdicts are combined at the check (:func:`~deepep_lightning.health.verdict.agree_across_ranks`), so a
NaN in one rank's shard rolls back every rank. The norms of sharded tensors are those of the local
shards.

A step costs one kernel for the loss and one for a precomputed gradient norm (the CUDA-graph
path hands one over); opening a step costs none.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from deepep_lightning._enums import StrEnum
from deepep_lightning._sharded import local

__all__ = ["HealthReason", "StepFlags", "StepRecord"]


class HealthReason(StrEnum):
    """Why a check failed (the ``reason`` of verdicts and health events)."""

    NONFINITE_LOSS = "nonfinite_loss"
    NONFINITE_GRAD = "nonfinite_grad"
    NONFINITE_PARAM = "nonfinite_param"
    LOSS_SPIKE = "loss_spike"
    OTHER_RANK = "other_rank"  # under DDP: another rank failed first


# columns of the device table
_LOSS, _GRAD_MAX, _GRAD_L2, _PARAM_MAX = 0, 1, 2, 3
_COLUMNS = 4


def _read_to_host(packed: Tensor) -> Tensor:
    """The only place the values cross to the host (tests count calls to prove there is no per-step read)."""
    return packed.to("cpu")


@dataclass(frozen=True)
class StepRecord:
    """What the host learns about one step at a check."""

    step: int
    loss_finite: bool
    grads_finite: bool
    params_finite: bool
    loss: float | None  # None when the step produced no loss (skipped)
    grad_norm: float

    @property
    def finite(self) -> bool:
        return self.loss_finite and self.grads_finite and self.params_finite

    @property
    def reason(self) -> HealthReason | None:
        if not self.loss_finite:
            return HealthReason.NONFINITE_LOSS
        if not self.grads_finite:
            return HealthReason.NONFINITE_GRAD
        if not self.params_finite:
            return HealthReason.NONFINITE_PARAM
        return None


def _local_nonempty(tensors: Iterable[Tensor | None]) -> list[Tensor]:
    """Detached local shards of ``tensors``, without ``None`` and empty ones (they hold no value to check)."""
    shards = (local(t.detach()) for t in tensors if t is not None)
    return [t for t in shards if t.numel()]


def _max_abs_and_norm(tensors: list[Tensor]) -> Tensor:
    """[largest absolute element, total L2 norm] of ``tensors`` as one float32 device tensor, no host read."""
    max_abs = torch.stack([n.float() for n in torch._foreach_norm(tensors, ord=float("inf"))]).max()
    l2 = torch.stack([n.float() for n in torch._foreach_norm(tensors)]).norm()
    return torch.stack([max_abs, l2])


class StepFlags:
    """A ring of per-step rows on ``device``: loss, gradient max-abs and norm, parameter max-abs.

    Args:
        capacity: how many steps may be written between two reads (``check_every_n_steps``).
        device: where the rows live (the module's device).
    """

    def __init__(self, capacity: int, device: torch.device | str = "cpu") -> None:
        self.capacity = int(capacity)
        self.device = torch.device(device)
        self._rows = torch.zeros(self.capacity, _COLUMNS, dtype=torch.float32, device=self.device)
        self._steps: list[int | None] = [None] * self.capacity
        # which columns of each row the current step wrote (host bookkeeping: unwritten columns hold
        # an older step's values and are ignored at the read)
        self._written: list[set[int]] = [set() for _ in range(self.capacity)]

    def _slot(self, step: int) -> int:
        slot = step % self.capacity
        if self._steps[slot] != step:
            raise RuntimeError(f"step {step} was not begun (slot holds {self._steps[slot]}); call begin({step}) first")
        return slot

    def begin(self, step: int) -> None:
        """Open the row of ``step``: nothing recorded yet (healthy, no loss). Host only, no kernel."""
        slot = step % self.capacity
        self._steps[slot] = step
        self._written[slot].clear()

    def record_loss(self, step: int, loss: Tensor) -> None:
        slot = self._slot(step)
        value = loss.detach()
        value = value.reshape(()) if value.numel() == 1 else value.float().sum()
        self._rows[slot, _LOSS].copy_(value)
        self._written[slot].add(_LOSS)

    def record_grads(self, step: int, grads: Iterable[Tensor]) -> None:
        """Record the gradients of ``step`` (several calls in one step combine)."""
        grads = _local_nonempty(grads)
        if grads:
            self._write_grads(step, _max_abs_and_norm(grads))

    def record_grad_norm(self, step: int, norm: Tensor) -> None:
        """Record a precomputed total gradient norm (one element) in place of the gradients: one kernel."""
        self._write_grads(step, norm.detach().reshape(1).expand(2))  # a norm (>= 0) is its own max-abs

    def _write_grads(self, step: int, values: Tensor) -> None:
        slot = self._slot(step)
        row = self._rows[slot, _GRAD_MAX : _GRAD_L2 + 1]
        if _GRAD_MAX in self._written[slot]:  # a second record in the same step (several optimizers)
            values = torch.stack([torch.maximum(row[0], values[0]), torch.hypot(row[1], values[1])])
        row.copy_(values)
        self._written[slot].update((_GRAD_MAX, _GRAD_L2))

    def record_params(self, step: int, params: Iterable[Tensor]) -> Tensor | None:
        """Record the parameters' largest absolute element at ``step``; return their total norm (a device tensor)."""
        params = _local_nonempty(params)
        if not params:
            return None
        slot = self._slot(step)
        values = _max_abs_and_norm(params)
        self._rows[slot, _PARAM_MAX].copy_(values[0])
        self._written[slot].add(_PARAM_MAX)
        return values[1]

    def read(self, steps: Sequence[int], extra: Tensor | None = None) -> tuple[list[StepRecord], Tensor | None]:
        """Read the rows of ``steps`` (and an optional small ``extra`` tensor) in one host transfer."""
        if len(steps) > self.capacity:
            raise RuntimeError(f"cannot read {len(steps)} steps from a ring of {self.capacity}")
        slots = [self._slot(s) for s in steps]
        index = torch.tensor(slots, dtype=torch.long, device=self.device)
        parts = [self._rows.index_select(0, index).flatten()]
        n_extra = 0
        if extra is not None:
            extra = extra.detach().float().flatten().to(self.device)
            n_extra = extra.numel()
            parts.append(extra)
        host = _read_to_host(torch.cat(parts)).tolist()
        records = []
        for i, (step, slot) in enumerate(zip(steps, slots)):
            row, written = host[_COLUMNS * i : _COLUMNS * (i + 1)], self._written[slot]
            loss = row[_LOSS] if _LOSS in written else None
            records.append(
                StepRecord(
                    step=int(step),
                    loss_finite=loss is None or math.isfinite(loss),
                    grads_finite=_GRAD_MAX not in written or math.isfinite(row[_GRAD_MAX]),
                    params_finite=_PARAM_MAX not in written or math.isfinite(row[_PARAM_MAX]),
                    loss=loss,
                    grad_norm=row[_GRAD_L2] if _GRAD_L2 in written else 0.0,
                )
            )
        extra_host = torch.tensor(host[_COLUMNS * len(steps) :]) if n_extra else None
        return records, extra_host
