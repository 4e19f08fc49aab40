"""Per-step finiteness flags kept on the device, read by the host only at a check.

Writing a flag is a device op (``copy_``/``logical_and_`` into a preallocated
slot), so a training step adds no host synchronisation. The host reads all slots
written since the last check in **one** transfer (:func:`_read_to_host`), every
``check_every_n_steps`` steps. One slot per step (not one AND-ed bool) so a
check names the first bad step, not only the interval.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import torch
from torch import Tensor

__all__ = ["StepRecord", "StepFlags"]

_LOSS, _GRADS, _PARAMS = 0, 1, 2


def _read_to_host(packed: Tensor) -> Tensor:
    """The only place the flags cross to the host (tests count calls to prove there is no per-step read)."""
    return packed.to("cpu")


@dataclass(frozen=True)
class StepRecord:
    """What the host learns about one step at a check."""

    step: int
    loss_finite: bool
    grads_finite: bool
    params_finite: bool
    loss: Optional[float]  # None when the step produced no loss (skipped)
    grad_norm: float

    @property
    def finite(self) -> bool:
        return self.loss_finite and self.grads_finite and self.params_finite

    @property
    def reason(self) -> Optional[str]:
        if not self.loss_finite:
            return "nonfinite_loss"
        if not self.grads_finite:
            return "nonfinite_grad"
        if not self.params_finite:
            return "nonfinite_param"
        return None


def _finite_and_norm(tensors: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    """(all elements finite, total L2 norm) as device scalars, without a host read.

    Finiteness comes from the max-norm, which cannot overflow: a huge but finite gradient whose
    sum of squares exceeds float32 is not reported as non-finite (its L2 norm may log as inf).
    """
    tensors = list(tensors)
    max_abs = torch.stack([n.float() for n in torch._foreach_norm(tensors, ord=float("inf"))])
    l2 = torch.stack([n.float() for n in torch._foreach_norm(tensors)]).norm()
    return torch.isfinite(max_abs).all(), l2


class StepFlags:
    """A ring of per-step slots on ``device``: finite flags, loss value, gradient norm.

    Args:
        capacity: how many steps may be written between two reads (``check_every_n_steps``).
        device: where the slots live (the module's device).
    """

    def __init__(self, capacity: int, device: torch.device | str = "cpu") -> None:
        self.capacity = int(capacity)
        self.device = torch.device(device)
        self._ok = torch.ones(self.capacity, 3, dtype=torch.bool, device=self.device)
        self._loss = torch.zeros(self.capacity, dtype=torch.float32, device=self.device)
        self._loss_valid = torch.zeros(self.capacity, dtype=torch.bool, device=self.device)
        self._grad_sq = torch.zeros(self.capacity, dtype=torch.float32, device=self.device)
        self._steps: list[Optional[int]] = [None] * self.capacity

    def _slot(self, step: int) -> int:
        slot = step % self.capacity
        if self._steps[slot] != step:
            raise RuntimeError(f"step {step} was not begun (slot holds {self._steps[slot]}); call begin({step}) first")
        return slot

    def begin(self, step: int) -> None:
        """Reset the slot of ``step`` (all flags healthy, no loss yet)."""
        slot = step % self.capacity
        self._steps[slot] = step
        self._ok[slot].fill_(True)
        self._loss_valid[slot].fill_(False)
        self._grad_sq[slot].zero_()

    def record_loss(self, step: int, loss: Tensor) -> None:
        slot = self._slot(step)
        value = loss.detach().float().sum().to(self.device)
        self._loss[slot].copy_(value)
        self._loss_valid[slot].fill_(True)
        self._ok[slot, _LOSS].logical_and_(torch.isfinite(value))

    def record_grads(self, step: int, grads: Iterable[Tensor]) -> None:
        grads = [g for g in grads if g is not None]
        if not grads:
            return
        slot = self._slot(step)
        finite, total = _finite_and_norm(grads)
        self._ok[slot, _GRADS].logical_and_(finite.to(self.device))
        self._grad_sq[slot].add_((total * total).to(self.device))

    def record_params(self, step: int, params: Iterable[Tensor]) -> Optional[Tensor]:
        """Flag the parameters' finiteness at ``step``; return their total norm (a device tensor)."""
        params = [p.detach() for p in params]
        if not params:
            return None
        slot = self._slot(step)
        finite, total = _finite_and_norm(params)
        self._ok[slot, _PARAMS].logical_and_(finite.to(self.device))
        return total.to(self.device)

    def read(self, steps: Sequence[int], extra: Optional[Tensor] = None) -> tuple[list[StepRecord], Optional[Tensor]]:
        """Read the slots of ``steps`` (and an optional small ``extra`` tensor) in one host transfer."""
        if len(steps) > self.capacity:
            raise RuntimeError(f"cannot read {len(steps)} steps from a ring of {self.capacity}")
        slots = [self._slot(s) for s in steps]
        index = torch.tensor(slots, dtype=torch.long, device=self.device)
        parts = [
            self._ok.index_select(0, index).float().flatten(),
            self._loss.index_select(0, index),
            self._loss_valid.index_select(0, index).float(),
            self._grad_sq.index_select(0, index).sqrt(),
        ]
        n_extra = 0
        if extra is not None:
            extra = extra.detach().float().flatten().to(self.device)
            n_extra = extra.numel()
            parts.append(extra)
        host = _read_to_host(torch.cat(parts)).tolist()
        n = len(steps)
        ok, loss, valid, gnorm = host[: 3 * n], host[3 * n : 4 * n], host[4 * n : 5 * n], host[5 * n : 6 * n]
        records = [
            StepRecord(
                step=int(step),
                loss_finite=bool(ok[3 * i + _LOSS]),
                grads_finite=bool(ok[3 * i + _GRADS]),
                params_finite=bool(ok[3 * i + _PARAMS]),
                loss=float(loss[i]) if valid[i] else None,
                grad_norm=float(gnorm[i]),
            )
            for i, step in enumerate(steps)
        ]
        extra_host = torch.tensor(host[6 * n :]) if n_extra else None
        return records, extra_host
