"""The model zoo of ``bench_zoo.py``: what a model is to the benchmark, the registry, and its selection by name.

A :class:`ZooModel` names one configuration (an architecture in one precision), the groups it belongs to, the
packages it needs and a builder. The builder runs in the worker process after ``seed_everything`` and returns a
:class:`ZooTask`: a random-init ``nn.Module`` (nothing is downloaded), a pool of synthetic batches drawn from a
seeded generator on the CPU, and the loss of one batch. The catalogues live by source: ``zoo_vision.py``
(torchvision, timm), ``zoo_sequence.py`` (transformers, torchaudio), ``zoo_graph.py`` (PyG); this file holds
the tiny CPU models of the benchmark's own tests, among them a planted nondeterministic one.

Builders import their package inside the function, so listing the zoo or running one model imports only what
that model needs.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ZooModel", "ZooTask", "all_models", "missing_package", "select_models", "with_bf16"]


@dataclasses.dataclass
class ZooTask:
    """One model ready to train: the module, its batches (CPU tensors, any nesting) and the loss of a batch."""

    model: nn.Module
    batches: list[Any]
    loss: Callable[[nn.Module, Any], torch.Tensor]


@dataclasses.dataclass(frozen=True)
class ZooModel:
    """One configuration of the zoo.

    Args:
        name: unique, used on the command line and as the key of the result file.
        groups: selection groups besides ``all`` (``vision``, ``detection``, ``nlp``, ...); ``test`` models are
            not part of ``all``.
        packages: import names that must be installed (the model is skipped otherwise).
        build: ``build(generator) -> ZooTask``; ``generator`` is a seeded CPU generator for the batches.
        precision: Lightning's ``precision`` argument.
    """

    name: str
    groups: tuple[str, ...]
    packages: tuple[str, ...]
    build: Callable[[torch.Generator], ZooTask]
    precision: str = "32-true"


def with_bf16(models: Sequence[ZooModel], names: Sequence[str]) -> list[ZooModel]:
    """``models`` plus a ``<name>_bf16`` configuration under ``bf16-mixed`` for each of ``names``."""
    by_name = {model.name: model for model in models}
    extra = [
        dataclasses.replace(
            by_name[name], name=f"{name}_bf16", precision="bf16-mixed", groups=(*by_name[name].groups, "bf16")
        )
        for name in names
    ]
    return [*models, *extra]


def missing_package(model: ZooModel) -> str | None:
    """The first of ``model.packages`` that is not installed, or None."""
    for package in model.packages:
        if importlib.util.find_spec(package) is None:
            return package
    return None


# ---- the benchmark's own test models (CPU, milliseconds per step) -------------------------------------------


def _classification_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    inputs, labels = batch
    return F.cross_entropy(model(inputs), labels)


def _tiny_mlp(generator: torch.Generator) -> ZooTask:
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    batches = [
        (torch.randn(8, 16, generator=generator), torch.randint(0, 4, (8,), generator=generator)) for _ in range(4)
    ]
    return ZooTask(model, batches, _classification_loss)


def _tiny_cnn(generator: torch.Generator) -> ZooTask:
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 4),
    )
    batches = [
        (torch.randn(4, 3, 12, 12, generator=generator), torch.randint(0, 4, (4,), generator=generator))
        for _ in range(4)
    ]
    return ZooTask(model, batches, _classification_loss)


class PidOrderedSum(nn.Module):
    """A planted fault: a loss factor from a float sum whose order is drawn from the process id.

    Summing the same values in two orders rounds differently in the last bits; the factor scales that rounding
    difference up to a visible size and multiplies the loss, so the losses and, through the gradients, the
    weights of two fresh processes (two process ids) differ under any determinism setting.
    """

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        spread = torch.logspace(-3, 3, features.numel()).reshape(-1, 64).T  # [64, N / 64], each row spans 1e-3..1e3
        values = features.detach().reshape(64, -1) * spread
        generator = torch.Generator().manual_seed(os.getpid())
        order = torch.rand(values.shape, generator=generator).argsort(dim=1)  # a summation order per row
        permuted = values.gather(1, order)
        in_order, drawn = torch.zeros(64), torch.zeros(64)
        for column in range(values.shape[1]):  # sequential float32 sums: each order rounds its own way
            in_order, drawn = in_order + values[:, column], drawn + permuted[:, column]
        ulps = (drawn - in_order) / (values.abs().sum(dim=1) * 2**-23)  # [64], a few units each
        return 1 + 1e-3 * (ulps * torch.arange(1, 65)).sum() / 64


class _PlantedMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.hidden = nn.Sequential(nn.Linear(16, 64), nn.Tanh())
        self.head = nn.Linear(64, 4)
        self.planted = PidOrderedSum()

    def forward(self, inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.hidden(inputs)  # [B, 64]: 512 values to sum
        return self.head(hidden), self.planted(hidden)


def _planted_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    inputs, labels = batch
    logits, factor = model(inputs)
    return F.cross_entropy(logits, labels) * factor


def _planted_nondeterministic(generator: torch.Generator) -> ZooTask:
    batches = [
        (torch.randn(8, 16, generator=generator), torch.randint(0, 4, (8,), generator=generator)) for _ in range(4)
    ]
    return ZooTask(_PlantedMLP(), batches, _planted_loss)


TEST_MODELS = [
    ZooModel("tiny_mlp", ("test",), (), _tiny_mlp),
    ZooModel("tiny_cnn", ("test",), (), _tiny_cnn),
    ZooModel("planted_nondeterministic", ("test",), (), _planted_nondeterministic),
]


def all_models() -> list[ZooModel]:
    """Every configuration: the catalogues in the order they run, then the test models."""
    import zoo_graph
    import zoo_sequence
    import zoo_vision

    return [*zoo_vision.MODELS, *zoo_sequence.MODELS, *zoo_graph.MODELS, *TEST_MODELS]


def select_models(selection: Sequence[str]) -> list[ZooModel]:
    """The models that ``selection`` names (model names or groups; ``all`` is every non-test model), in zoo order.

    Raises:
        ValueError: a name that is neither a model nor a group, listing both.
    """
    models = all_models()
    groups = {"all"} | {group for model in models for group in model.groups}
    names = {model.name for model in models}
    for item in selection:
        if item not in names and item not in groups:
            raise ValueError(
                f"--models: {item!r} is neither a model nor a group; groups: {sorted(groups)}; models: {sorted(names)}"
            )
    wanted = set(selection)
    return [
        model
        for model in models
        if model.name in wanted or wanted & set(model.groups) or ("all" in wanted and "test" not in model.groups)
    ]
