"""The gradients of an unfinished accumulation window, as checkpoint state.

With ``Trainer(accumulate_grad_batches=N)`` the parameters' ``.grad`` hold the sum of the window's
backward passes until the optimizer steps. Lightning does not checkpoint them: a checkpoint taken
inside a window (a batch-interval or time-interval checkpoint, a preemption handler, a mid-epoch
validation) resumes with ``.grad`` empty, and the window's step then uses only the batches after
the restart. :func:`capture_gradients` stores them as CPU tensors (``weights_only``-loadable) and
:func:`restore_gradients` puts them back before the next batch, so that step sums the same batches
as in the uninterrupted run.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["capture_gradients", "restore_gradients", "window_gradients"]


def capture_gradients(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Copies of every parameter's ``.grad`` on CPU, by parameter name (parameters without one are left out).

    Example::

        saved = capture_gradients(model)  # inside an accumulation window
        restore_gradients(model, saved)   # after the resume, before the next backward
    """
    return {
        name: parameter.grad.detach().to("cpu", copy=True)
        for name, parameter in module.named_parameters()
        if parameter.grad is not None
    }


def window_gradients(trainer: Any, module: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """The open window's gradients for this process's checkpoint state, or None where they cannot be kept.

    Each rank accumulates its own gradients until the step. Lightning writes rank 0's callback states
    only, unless the strategy keeps every rank's (``per_rank_checkpoint_keys`` holding ``"callbacks"``,
    as :class:`~deepep_lightning.strategies.DeterministicDDPStrategy` does): with several processes
    and such a strategy, or with one process, the gradients are captured; otherwise None.
    """
    if trainer.world_size == 1 or "callbacks" in getattr(trainer.strategy, "per_rank_checkpoint_keys", ()):
        return capture_gradients(module)
    return None


def restore_gradients(module: torch.nn.Module, saved: dict[str, Any]) -> list[str]:
    """Set ``.grad`` of the parameters named in ``saved`` (on each parameter's device); returns names not found.

    Raises:
        ValueError: a saved gradient's shape differs from its parameter's.
    """
    parameters = dict(module.named_parameters())
    missing = [name for name in saved if name not in parameters]
    for name, gradient in saved.items():
        parameter = parameters.get(name)
        if parameter is None:
            continue
        if tuple(gradient.shape) != tuple(parameter.shape):
            raise ValueError(
                f"the checkpointed gradient of {name!r} has shape {tuple(gradient.shape)!r}, the parameter"
                f" {tuple(parameter.shape)!r}: the checkpoint was written by another model"
            )
        parameter.grad = gradient.to(device=parameter.device, dtype=parameter.dtype, copy=True)
    return missing
