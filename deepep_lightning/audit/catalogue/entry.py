"""What an L1 catalogue entry is, and the fixed random inputs its builder makes.

Kept apart from the entries so that the families of entries (:mod:`~deepep_lightning.audit.catalogue.indexed`,
:mod:`~deepep_lightning.audit.catalogue.spatial`, :mod:`~deepep_lightning.audit.catalogue.dense`) share one
definition of the entry and one way to draw inputs, and :mod:`~deepep_lightning.audit.catalogue` assembles them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["BINS", "CatalogueEntry", "grad_of", "indices", "output_and_grad", "randn"]

#: Destination size of the accumulating ops: ``"large"`` puts 8M values into these bins, as the GPU probes do.
BINS = 1000


@dataclasses.dataclass(frozen=True)
class CatalogueEntry:
    """One L1 op: ``build(device, size, generator)`` → a zero-argument callable returning tensors.

    Attributes:
        name: the table's row label.
        build: makes the fixed random inputs once and returns the callable.
        note: the table's ``what`` column.
        cuda_only: ``n/a`` on CPU.
        needs_extension: needs the deepep_lightning extension (not built on a bare CPU test run).
        routed: the ``aten`` ops of the computation that ``patch_refused_ops`` routes (empty: none).
    """

    name: str
    build: Callable[[torch.device, int, torch.Generator], Callable[[], Any]]
    note: str
    cuda_only: bool = False
    needs_extension: bool = False
    routed: tuple[str, ...] = ()


def randn(gen: torch.Generator, device: torch.device, *shape: int, requires_grad: bool = False) -> torch.Tensor:
    """Standard normal values of ``shape``, drawn on the CPU from ``gen`` (the same on every device), on ``device``."""
    return torch.randn(*shape, generator=gen).to(device).requires_grad_(requires_grad)


def indices(gen: torch.Generator, device: torch.device, n: int, high: int = BINS) -> torch.Tensor:
    """``n`` indices in ``[0, high)`` drawn on the CPU from ``gen``: with ``n > high`` many repeat."""
    return torch.randint(0, high, (n,), generator=gen).to(device)


def grad_of(
    forward: Callable[[], torch.Tensor], inputs: list[torch.Tensor], grad_out: torch.Tensor
) -> Callable[[], Any]:
    """Backward only: the gradients of ``forward()`` with respect to ``inputs`` for the fixed ``grad_out``."""

    def run():
        out = forward()
        return torch.autograd.grad(out, inputs, grad_out)

    return run


def output_and_grad(
    forward: Callable[[], torch.Tensor], inputs: list[torch.Tensor], grad_out: torch.Tensor
) -> Callable[[], Any]:
    """Forward and backward: the output (a loss whose forward accumulates, e.g. nll_loss2d) and the grads."""

    def run():
        out = forward()
        return (out.detach(), *torch.autograd.grad(out, inputs, grad_out))

    return run
