"""A tiny regression module and trainer factory shared by the health tests."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import Logger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class ToyModule(pl.LightningModule):
    """MLP regression with dropout (uses the global RNG), Adam and a per-step StepLR."""

    def __init__(self, lr: float = 0.05, n_samples: int = 64, batch_size: int = 4) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Dropout(0.1), nn.Linear(8, 1))
        self.lr = lr
        self.n_samples = n_samples
        self.batch_size = batch_size

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.inner(x), y)
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.parameters(), lr=self.lr)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.9)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(self.n_samples, 4, generator=g)
        y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(self.n_samples, 1, generator=g)
        return DataLoader(
            TensorDataset(x, y), batch_size=self.batch_size, shuffle=True, generator=torch.Generator().manual_seed(1)
        )


class CursorModuleWithoutProtocol(ToyModule):
    """A non-DeepEP module with rollout state: a cursor outside parameters and buffers shifts each step's inputs.

    It does not implement :class:`~deepep_lightning.protocols.RolloutStateful`, so nothing restores the
    cursor (the negative control for :class:`CursorModule`, which does).
    """

    def __init__(self) -> None:
        super().__init__()
        self.cursor = torch.zeros((), dtype=torch.int64)  # a plain attribute: not in state_dict

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = super().training_step((x + 0.25 * self.cursor.float(), y), batch_idx)
        self.cursor += 1
        return loss


class CursorModule(CursorModuleWithoutProtocol):
    """The cursor module implementing RolloutStateful: a rollback restores the cursor, a replay is bitwise."""

    def rollout_state_dict(self) -> dict[str, Any]:
        return {"cursor": self.cursor.clone()}

    def load_rollout_state_dict(self, state: dict[str, Any]) -> None:
        self.cursor.copy_(state["cursor"])  # in place, as a captured graph would need


def checkpoint_round_trip(tmp_path: Any, trainer: pl.Trainer, callback: pl.Callback, twin: pl.Callback) -> dict:
    """Check that ``callback``'s state is in a Lightning checkpoint under its ``state_key``, loads with
    ``weights_only=True`` and restores into ``twin`` (a fresh callback with the same arguments); returns it."""
    path = str(tmp_path / "round_trip.ckpt")
    trainer.save_checkpoint(path)
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)  # plain values only
    saved = checkpoint["callbacks"][callback.state_key]
    assert saved == callback.state_dict()
    assert twin.state_key == callback.state_key
    twin.load_state_dict(saved)
    assert twin.state_dict() == callback.state_dict()
    return saved


class CaptureLogger(Logger):
    """Keeps every ``log_metrics`` call in memory."""

    def __init__(self, save_dir: str) -> None:
        super().__init__()
        self._save_dir = save_dir
        self.metrics: list[tuple[int, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "capture"

    @property
    def version(self) -> int:
        return 0

    @property
    def log_dir(self) -> str:
        return self._save_dir

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.metrics.append((step, dict(metrics)))


def make_trainer(tmp_path: Any, callbacks: list, max_steps: int = 12, logger: Any = False, **kwargs: Any) -> pl.Trainer:
    return pl.Trainer(
        accelerator=kwargs.pop("accelerator", "cpu"),
        devices=kwargs.pop("devices", 1),
        max_steps=max_steps,
        logger=logger,
        callbacks=callbacks,
        default_root_dir=str(tmp_path),
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        deterministic=True,
        **kwargs,
    )


def fit(tmp_path: Any, callbacks: list, max_steps: int = 12, seed: int = 0, module: Any = None, **kwargs: Any):
    pl.seed_everything(seed, verbose=False)
    module = module() if callable(module) and not isinstance(module, pl.LightningModule) else module
    module = module if module is not None else ToyModule()
    trainer = make_trainer(tmp_path, callbacks, max_steps=max_steps, **kwargs)
    trainer.fit(module)
    return trainer, module


def state_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture
def toy_fit():
    return fit


class OverflowBeforeStep(pl.Callback):
    """Sets the value head's output bias to 1e30 before step ``step``, every time it runs (or ``times`` times).

    Outside ``training_step`` (at batch start, and at every replay and diagnosis through
    ``on_replay_batch_start``), and finite, so the non-finite locator can only name the op
    inside the step where it overflows: the critic's squared error in ``loss.py``.
    """

    def __init__(self, step: int, times: int | None = None) -> None:
        self.step, self.times, self.planted = step, times, 0

    def _plant(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_step == self.step and (self.times is None or self.planted < self.times):
            self.planted += 1
            with torch.no_grad():
                pl_module.agent.value_head.output_bias.fill_(1e30)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._plant(trainer, pl_module)

    def on_replay_batch_start(self, trainer, pl_module, batch, batch_idx, epoch):
        self._plant(trainer, pl_module)


def tensor_addresses(pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer) -> list[int]:
    """Where the parameters and the optimizer state live (what a captured CUDA graph points to)."""
    params = list(pl_module.parameters())
    state = [v for p in params for v in optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor)]
    return [t.data_ptr() for t in params + state]


class Recorder(pl.Callback):
    """Step outputs as the callbacks see them, and the tensors' addresses after the first and the last step."""

    def __init__(self):
        self.outputs, self.first, self.last = [], None, None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.outputs.append(outputs)
        if self.first is None:
            self.first = tensor_addresses(pl_module, trainer.optimizers[0])

    def on_train_end(self, trainer, pl_module):
        self.last = tensor_addresses(pl_module, trainer.optimizers[0])
