"""What DeterministicDDPStrategy says about the layout of the run a checkpoint comes from.

Seeds, shards and per-rank state are keyed by the global rank, so a checkpoint resumes on any node
layout of its world size (2 nodes x 2 processes -> 1 node x 4) and continues the same run; another
world size is refused (:func:`~deepep_lightning.strategies.rank_state.check_world_size`). Only
NCCL's own all-reduce from three ranks on may build another ring on another topology and sum in
another order, which :func:`check_resume_layout` says in a warning; a different seed is warned
about by :func:`warn_if_seed_differs`, and a checkpoint without the strategy's record by
:func:`warn_without_record`.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from deepep_lightning.determinism.fingerprint import describe_layout
from deepep_lightning.strategies.rank_state import check_world_size

__all__ = ["check_resume_layout", "warn_if_seed_differs", "warn_without_record"]


def warn_without_record() -> None:
    """Warn that the checkpoint holds no record of this strategy: nothing to check, rank 0's state for all."""
    rank_zero_warn(
        "DeterministicDDPStrategy: the checkpoint has no world-size record (not written by this strategy);"
        " a world-size change cannot be detected and rank-local state comes from rank 0."
    )


def check_resume_layout(
    state: dict[str, Any],
    *,
    world_size: int,
    num_nodes: int,
    node_layout: str,
    allow_world_size_change: bool,
    ring_dependent: bool,
    backend: str,
) -> None:
    """Refuse another world size; say whether another node layout of the same size changes the sums.

    ``node_layout``: this run's layout (:func:`~deepep_lightning.determinism.fingerprint.describe_layout`);
    ``ring_dependent``: the gradients are summed by NCCL's ring (not in rank order) with three or
    more ranks; ``backend`` is the process group's backend as a string.

    Raises:
        WorldSizeMismatchError: the saved world size differs (unless ``allow_world_size_change``).
    """
    check_world_size(state, world_size, allow_world_size_change, num_nodes=num_nodes)
    saved_nodes = state.get("num_nodes")
    same_size = int(state.get("world_size", 0)) == world_size
    if saved_nodes is None or int(saved_nodes) == num_nodes or not same_size:
        return
    saved_layout = describe_layout(int(saved_nodes), world_size // int(saved_nodes))
    message = f"DeterministicDDPStrategy: resuming a run of {saved_layout} on {node_layout}"
    if ring_dependent and "nccl" in backend:
        rank_zero_warn(
            message + ": NCCL's all-reduce may build another ring on another topology, so the gradients' bits"
            " may differ from the uninterrupted run. HINT: `gradient_reduction='ordered'` sums in rank order."
        )
    else:
        rank_zero_info(message + " (same world size: the same run continues)")


def warn_if_seed_differs(saved_seed: Any, current_seed: int) -> None:
    """Warn when the checkpoint's seed is not this run's (``None``: the checkpoint records none)."""
    if saved_seed is not None and saved_seed != current_seed:
        rank_zero_warn(
            f"DeterministicDDPStrategy: the checkpoint's seed is {saved_seed!r}, this run's is {current_seed!r}"
        )
