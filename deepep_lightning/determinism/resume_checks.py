"""What DeterminismCallback checks when it resumes: its state, the digests, the seed and the stack.

A resume is bitwise equal to the uninterrupted run only from a checkpoint that holds the callback's
state, intact, with the same seed, on the same stack. A checkpoint without that state resumes with a
warning. Each check names what differs: the digests that :func:`stamp_digests` writes of the
callback's state and of the model's weights (a corrupt file raises
:class:`~deepep_lightning.determinism.checkpoint_integrity.CheckpointIntegrityError`), the seed
(``strict``: refused) and every fingerprint field that changed (``strict``:
:class:`FingerprintMismatchError`); without ``strict`` the last two warn.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from deepep_lightning.determinism.checkpoint_integrity import (
    CheckpointIntegrityError,
    digest,
    local_shards_digest,
    model_digest,
)
from deepep_lightning.determinism.fingerprint import collect_fingerprint, diff_fingerprints

__all__ = [
    "FingerprintMismatchError",
    "check_saved_fingerprint",
    "check_saved_seed",
    "stamp_digests",
    "verify_digests",
    "warn_without_state",
]


class FingerprintMismatchError(RuntimeError):
    """A checkpoint was written on a different stack than the one resuming it (strict mode)."""


def warn_without_state(path: Any) -> None:
    """Warn that the checkpoint at ``path`` holds no DeterminismCallback state: the resume is not exact."""
    rank_zero_warn(
        f"DeterminismCallback: the checkpoint {str(path)!r} holds no DeterminismCallback state (it was"
        " written without the plugin, or with save_weights_only): training resumes, but not bitwise"
        " equal to an uninterrupted run (no RNG states, no mid-epoch loader position, no seed check)."
    )


def stamp_digests(state: dict[str, Any], checkpoint: dict[str, Any], shard_digests: list[str] | None = None) -> None:
    """Store in ``state`` the SHA-256 digests of ``state`` itself and of the checkpoint's ``state_dict``.

    ``shard_digests``: for a sharded ``state_dict``, every rank's digest of its shards
    (:func:`~deepep_lightning.determinism.checkpoint_integrity.gather_shard_digests`), in rank order.
    """
    state["digest"] = {
        "state": digest({k: v for k, v in state.items() if k != "digest"}),
        "model": model_digest(checkpoint.get("state_dict")),
    }
    if shard_digests is not None:
        state["digest"]["model_shards"] = list(shard_digests)


def verify_digests(
    path: Any,
    state: dict[str, Any],
    checkpoint: dict[str, Any],
    loaded_state_dict: Any = None,
    rank: int = 0,
    world_size: int = 1,
) -> None:
    """Compare the digests stored in ``state`` with its content and the checkpoint's ``state_dict``.

    A sharded checkpoint (a directory written by ``torch.distributed.checkpoint``) is loaded into the
    module before this runs and its ``state_dict`` is not in ``checkpoint``: pass the module's
    ``state_dict`` as ``loaded_state_dict``, this process's ``rank`` and the ``world_size``, and its shards
    are compared with the digest that rank wrote (by a checkpoint of the same world size; another one is
    refused before, by :func:`~deepep_lightning.determinism.sharded_resume.check_mesh_layout`).

    Raises:
        CheckpointIntegrityError: either no longer matches the digest written with it.
    """
    saved = state.get("digest")
    if not isinstance(saved, dict):
        return  # written before digests existed
    problems = []
    if saved.get("state") != digest({k: v for k, v in state.items() if k != "digest"}):
        problems.append("the DeterminismCallback state (RNG states, logged values)")
    current_model = model_digest(checkpoint.get("state_dict"))
    if saved.get("model") is not None and current_model is not None and saved["model"] != current_model:
        problems.append("the model's state_dict (weights)")
    shards = saved.get("model_shards")
    if shards and "state_dict" not in checkpoint and len(shards) == world_size and 0 <= rank < world_size:
        loaded = local_shards_digest(loaded_state_dict)
        if loaded is not None and loaded != shards[rank]:
            problems.append(f"rank {rank}'s shards of the model's state_dict (weights)")
    if problems:
        raise CheckpointIntegrityError(
            f"DeterminismCallback: the checkpoint {str(path)!r} is corrupt: {' and '.join(problems)} no longer"
            " match the digest written with it. HINT: resume from an earlier checkpoint; for a checkpoint"
            " edited on purpose, delete checkpoint['callbacks']['DeterminismCallback']['digest']."
        )


def check_saved_seed(saved_seed: Any, seed: int, strict: bool) -> None:
    """Refuse (``strict``) or warn when the checkpoint was written with another seed.

    Raises:
        MisconfigurationException: under ``strict``, the seeds differ.
    """
    if saved_seed != seed:
        message = f"DeterminismCallback: the checkpoint was written with seed={saved_seed!r}, resuming with {seed!r}"
        if strict:
            raise MisconfigurationException(message + " (HINT: resume with the same seed)")
        rank_zero_warn(message)


def check_saved_fingerprint(saved_fingerprint: Any, world_size: int, num_nodes: int, strict: bool) -> None:
    """Refuse (``strict``) or warn when the checkpoint's fingerprint differs from this stack's, naming each field.

    Raises:
        FingerprintMismatchError: under ``strict``, a field differs.
    """
    if not saved_fingerprint:
        return
    differences = diff_fingerprints(saved_fingerprint, collect_fingerprint(world_size, num_nodes))
    if differences:
        detail = "; ".join(f"{key}: {old!r} -> {new!r}" for key, (old, new) in differences.items())
        message = (
            "DeterminismCallback: the checkpoint was written on a different stack, so the resumed run"
            f" may not be bitwise equal to an uninterrupted one. Fields that differ: {detail}"
        )
        if strict:
            raise FingerprintMismatchError(message)
        rank_zero_warn(message)
