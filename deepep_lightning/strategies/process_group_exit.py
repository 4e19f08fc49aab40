"""Destroy the default process group at interpreter exit, while Python is still whole.

Lightning registers this clean-up for NCCL only. A gloo group that is still alive when the
interpreter finalizes can abort a process whose run has already finished: gloo's worker threads hold
work objects whose tensors need the GIL to be freed, and ``std::terminate`` ends the process with
SIGABRT ("terminate called without an active exception", exit code -6; PyTorch issue 190489). A job
scheduler then reports a finished fit as a crash. :class:`~deepep_lightning.strategies.DeterministicDDPStrategy`
registers :func:`destroy_process_group_at_exit` for every backend when it starts the group; for NCCL
it does what Lightning's own handler does.
"""

from __future__ import annotations

import atexit

import torch.distributed as dist

__all__ = ["destroy_process_group_at_exit"]


def destroy_process_group_at_exit() -> None:
    """Register (once per process) an ``atexit`` handler that destroys the default process group.

    ``atexit`` runs handlers while the interpreter is still alive, in reverse order of registration;
    the handler does nothing if the group is already destroyed or was never started.
    """
    atexit.unregister(_destroy_default_group)  # idempotent across fit, validate and test
    atexit.register(_destroy_default_group)


def _destroy_default_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
