"""Tiny LightningModules for the audit tests: a clean one and planted nondeterminism (negative controls)."""

from __future__ import annotations

import itertools

import lightning.pytorch as pl
import torch
from torch import nn

_CALLS = itertools.count()  # global state the repeats do not reset: a call counter


class _Data(torch.utils.data.Dataset):
    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(32, 6, generator=generator)
        self.y = torch.randn(32, 1, generator=generator)

    def __len__(self) -> int:
        return 32

    def __getitem__(self, index: int):
        return self.x[index], self.y[index]


class CleanModule(pl.LightningModule):
    """Linear → Dropout (global RNG, reset by the audit) → Linear; reproducible."""

    def __init__(self, hidden: int = 8, lr: float = 0.05) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(6, hidden), nn.Tanh(), nn.Dropout(0.2))
        self.head = nn.Linear(hidden, 1)
        self.lr = lr

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(_Data(), batch_size=8, shuffle=True)


class _NoisyGate(nn.Module):
    """Adds noise from a process-wide generator nobody resets: every call draws new numbers."""

    generator = torch.Generator().manual_seed(1234)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 0.01 * torch.randn(x.shape, generator=_NoisyGate.generator)


class UnseededRNGModule(CleanModule):
    """Planted fault: ``encoder.gate`` draws from an unseeded, never-reset generator."""

    def __init__(self, hidden: int = 8, lr: float = 0.05) -> None:
        super().__init__(hidden, lr)
        self.encoder.add_module("gate", _NoisyGate())


class _CountingScale(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (1.0 + 1e-3 * next(_CALLS))


class CallCountModule(CleanModule):
    """Planted fault: ``head_scale`` multiplies by a factor that depends on a global call counter."""

    def __init__(self, hidden: int = 8, lr: float = 0.05) -> None:
        super().__init__(hidden, lr)
        self.head_scale = _CountingScale()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head_scale(self.head(self.encoder(x)))


class IndexAddModule(CleanModule):
    """``index_add_`` over duplicate indices (atomic on CUDA: nondeterministic there, exact on CPU)."""

    def __init__(self, hidden: int = 8, lr: float = 0.05, rows: int = 200_000, bins: int = 100) -> None:
        super().__init__(hidden, lr)
        self.rows, self.bins = rows, bins

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.encoder(x)  # [B, H]
        source = h.repeat(self.rows // h.shape[0], 1)  # [rows, H]
        index = torch.arange(source.shape[0], device=x.device) % self.bins
        pooled = torch.zeros(self.bins, h.shape[1], device=x.device, dtype=h.dtype).index_add_(0, index, source)
        return self.head(pooled.sum(0, keepdim=True) * 1e-3 + h)


_COUNTER_INPUT = torch.randn(16, generator=torch.Generator().manual_seed(3))


def counting_callable() -> torch.Tensor:
    """L1 negative control: the result depends on how often it was called."""
    return _COUNTER_INPUT * (1.0 + 1e-6 * next(_CALLS))


class SequenceModule(CleanModule):
    """A SequenceAuditable module that is not DeepEP: ``training_step`` unrolls ``length`` timesteps.

    The variant ``"unseeded"`` adds noise from a generator nobody seeds, so the audit must see it.
    """

    seed_argument = "seed"

    def __init__(self, hidden: int = 8, lr: float = 0.05, length: int = 5, seed: int = 0, noisy: bool = False) -> None:
        super().__init__(hidden, lr)
        self.length, self.seed, self.noisy = length, seed, noisy
        self.steps_run: list[int] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        total = x.new_zeros(())
        for _ in range(self.length):
            x = torch.tanh(self.encoder[0](x)[:, :6])  # hidden >= 6
            noise = torch.randn(1, generator=torch.Generator().manual_seed(next(_CALLS))) if self.noisy else 0.0
            total = total + nn.functional.mse_loss(self(x) + noise, y)
        self.steps_run.append(self.length)
        return total / self.length

    @classmethod
    def audit_config(cls, config, level):
        return {**config, "length": 1} if level == "L2" else dict(config)

    @classmethod
    def audit_describe(cls, config, level):
        return "one timestep" if level == "L2" else f"sequence of {config.get('length', 5)}"

    @classmethod
    def audit_variants(cls):
        return {"clean": {}, "unseeded": {"noisy": True}}


class _Attn(nn.Module):
    """``tanh(lin(x))``; with ``plant="forward"`` a log of zero, with ``plant="backward"`` a sqrt of zero."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.plant = "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if self.plant == "forward":
            return torch.log(y * 0)
        if self.plant == "backward":
            return torch.sqrt(y * 0)  # finite forward, infinite gradient
        return torch.tanh(y)


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.attn = _Attn(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.attn(self.norm(x))


class IdenticalBlocks(pl.LightningModule):
    """Four identical blocks called from ``training_step`` (never through ``forward``); block ``planted``'s
    ``attn`` plants a non-finite value in ``plant`` ("forward" or "backward")."""

    def __init__(self, planted: int = 2, plant: str = "forward", width: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Block(width) for _ in range(4)])
        self.blocks[planted].attn.plant = plant
        self.head = nn.Linear(width, 1)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        x = batch
        for block in self.blocks:
            x = block(x)
        return self.head(x).pow(2).mean()


class PlantedData(pl.LightningDataModule):
    """The audit's regression data from a DataModule (``batch_size`` shows whose init args were used)."""

    def __init__(self, batch_size: int = 8) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.dataset: _Data | None = None

    def setup(self, stage: str) -> None:
        self.dataset = _Data()

    def train_dataloader(self):
        assert self.dataset is not None, "setup('fit') runs first, as in Trainer.fit"
        return torch.utils.data.DataLoader(self.dataset, batch_size=self.batch_size, shuffle=True)


class ModuleWithoutData(CleanModule):
    """CleanModule without a ``train_dataloader`` of its own: its data comes from a DataModule."""

    train_dataloader = pl.LightningModule.train_dataloader
