"""What the world-size-invariant test harnesses share: the Trainer they fit with and the files each rank writes."""

from __future__ import annotations

import json
import os
from typing import Any

import torch


def virtual_trainer(devices: int, virtual: int | None, max_steps: int, out: str, callbacks: list[Any]) -> Any:
    """A CPU ``Trainer`` on ``DeterministicDDPStrategy(virtual_world_size=virtual)``, accumulating virtual / devices."""
    import lightning.pytorch as pl

    from deepep_lightning.strategies import DeterministicDDPStrategy

    return pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=DeterministicDDPStrategy(virtual_world_size=virtual),
        accumulate_grad_batches=virtual // devices if virtual else 1,
        max_steps=max_steps,
        logger=False,
        default_root_dir=out,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        callbacks=callbacks,
    )


def write_rank_outputs(out: str, rank: int, record: dict[str, Any], model: torch.nn.Module) -> None:
    """``out/rank{rank}.json`` (the record) and ``out/weights_rank{rank}.pt`` (the model's state on the CPU)."""
    with open(os.path.join(out, f"rank{rank}.json"), "w") as handle:
        json.dump(record, handle, indent=1)
    torch.save({k: v.cpu() for k, v in model.state_dict().items()}, os.path.join(out, f"weights_rank{rank}.pt"))
