"""The per-step reseed of ``DeterministicDDPStrategy``: the generator states of ``seed_everything_from``, cheaper.

``torch.manual_seed`` seeds every device type PyTorch knows. For a type that is not initialised
(XPU and MTIA on a CUDA machine, CUDA itself in a CPU run) it queues the seed for a later init and
records ``traceback.format_stack()`` with it, so each call costs a walk and format of the whole
Python stack: under Lightning's loops ~1 ms of host time per training step on a small CPU, for
generators that never produce a number. :func:`reseed_step` sets the same states without that:
the CPU generator, every CUDA generator (directly once CUDA runs, lazily before, as
``torch.manual_seed`` does), numpy's global ``RandomState`` and ``random``. When another device
type is present (XPU, MTIA, MPS or a registered custom backend) it calls
:func:`~deepep_lightning.determinism.rng.seed_everything_from` itself, so no generator is ever left
out; the resulting states are equal bit for bit in both paths (``tests/strategies/test_step_seed.py``).
"""

from __future__ import annotations

import functools
import random

import numpy as np
import torch

from deepep_lightning.determinism.rng import seed_everything_from
from deepep_lightning.determinism.streams import derive_seed

__all__: list[str] = []

_NUMPY_SEED_MASK = 2**32 - 1  # numpy's legacy seed is 32-bit (as in determinism/rng.py)


@functools.lru_cache(maxsize=None)
def _only_cpu_and_cuda() -> bool:
    """True when torch.manual_seed would seed nothing but the CPU and CUDA generators (fixed per process)."""
    others = (
        torch.xpu.is_available(),
        hasattr(torch, "mtia") and torch.mtia.is_available(),
        torch.backends.mps.is_available(),
        hasattr(torch, torch._C._get_privateuse1_backend_name()),
    )
    return not any(others)


def reseed_step(seed: int, *keys: int | str) -> int:
    """Seed torch (CPU and CUDA), numpy and ``random`` from ``derive_seed(seed, *keys)``; return it.

    Same generator states as ``seed_everything_from(seed, *keys)``, without ``torch.manual_seed``'s
    per-call stack capture for uninitialised device types.
    """
    if not _only_cpu_and_cuda():
        return seed_everything_from(seed, *keys)
    derived = derive_seed(seed, *keys)
    torch.default_generator.manual_seed(derived)
    if torch.cuda.is_initialized():
        for generator in torch.cuda.default_generators:
            generator.manual_seed(derived)
    elif torch.cuda.is_available() and not torch.cuda._is_in_bad_fork():
        torch.cuda.manual_seed_all(derived)  # queued until CUDA starts, as torch.manual_seed does
    np.random.seed(derived & _NUMPY_SEED_MASK)
    random.seed(derived)
    return derived
