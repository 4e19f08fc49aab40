"""Independent random streams derived from (seed, rank, purpose, step).

Every random consumer gets its own stream, so adding one consumer (a dropout
layer, a validation rollout, a logging sample) never shifts another, and any
stream at any step can be rebuilt in O(1) from its key: resuming seeks
instead of replaying.
"""

from __future__ import annotations

import hashlib

import torch

__all__ = ["derive_seed", "make_generator"]

_SEED_BITS = 63  # torch.Generator.manual_seed takes a signed 64-bit value


def derive_seed(seed: int, *keys: int | str) -> int:
    """Return a 63-bit seed that is a pure function of ``seed`` and ``keys``.

    Args:
        seed: the run seed.
        *keys: what identifies the stream, e.g. ``("rollout", rank, step)``.
            Ints and strings only, so the result never depends on ``PYTHONHASHSEED``.

    Raises:
        TypeError: a key is neither int nor str.

    Example::

        g = torch.Generator().manual_seed(derive_seed(7, "rollout", 0, 123))
    """
    parts = [repr(int(seed))]
    for key in keys:
        if isinstance(key, bool) or not isinstance(key, (int, str)):
            raise TypeError(f"derive_seed keys must be int or str, got {key!r} of type {type(key).__name__}")
        parts.append(f"{type(key).__name__}:{key}")
    digest = hashlib.blake2b("|".join(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> (64 - _SEED_BITS)


def make_generator(seed: int, *keys: int | str, device: torch.device | str = "cpu") -> torch.Generator:
    """A ``torch.Generator`` on ``device`` seeded with ``derive_seed(seed, *keys)``."""
    generator = torch.Generator(device=device)
    generator.manual_seed(derive_seed(seed, *keys))
    return generator
