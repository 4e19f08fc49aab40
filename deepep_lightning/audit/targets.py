"""What L2/L3 audit: a LightningModule (DeepEP by default, or any class by import path) and how to step it.

Protocol (the same for every module; L4 covers Trainer, data loading and checkpoints):

* The module is built once (``Class(**config)``, ``setup("fit")``, ``configure_model()``) and moved
  to the device; this is the *template*. The global RNG state (torch CPU/CUDA, NumPy, Python) is
  captured, the batches are drawn from ``train_dataloader()`` once, and the RNG state is captured
  again. Each repeat then restores that state and runs on a ``copy.deepcopy`` of the template: same
  weights, same Python attributes, same RNG, same batches.
* **L2** — ``training_step(batch_0, 0)`` and ``loss.backward()``; compared: the loss and every
  parameter's gradient. A :class:`~deepep_lightning.protocols.SequenceAuditable` module is built
  with ``audit_config(config, "L2")``, one timestep of its sequence (DeepEP: ``env.rollout_length=1``:
  policy, value head, recurrent cell, loss).
* **L3** — a ``SequenceAuditable`` module: one whole sequence forward and backward (one
  ``training_step`` under ``audit_config(config, "L3")``; DeepEP: a rollout of ``env.rollout_length``
  timesteps), compared like L2. Another module: ``steps`` consecutive
  ``training_step``/``backward``/``optimizer.step`` on the first ``steps`` batches with the first
  optimizer of ``configure_optimizers()``; compared: every step's loss, the last gradients and the
  final parameters.

Batches come from the module's ``train_dataloader()``, or, as ``Trainer.fit(model, datamodule=...)``
does, from a LightningDataModule's when one is given (``data="pkg.mod:DataModule"`` with init args,
or the ``data:`` section of a LightningCLI YAML): ``prepare_data()``, ``setup("fit")``, then its
``train_dataloader()``.

A ``SequenceAuditable`` class may also name *variants* (``audit_variants()``: constructor-kwarg
overrides such as DeepEP's value heads ``"reference"``, ``"fused"``, ``"fused_atomic"``).
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import os
from typing import Any

import torch
import yaml
from lightning.pytorch.utilities import move_data_to_device

from deepep_lightning.determinism.rng import capture_rng_state, restore_rng_state
from deepep_lightning.protocols import AuditLevel, SequenceAuditable, step_loss

__all__ = [
    "DEEPEP_TARGET",
    "DataSpec",
    "ModuleTarget",
    "audit_device",
    "load_class",
    "load_config",
    "load_data",
    "load_lightning_module_class",
]

#: The default target: the reference workload, by import string (the audit never imports it otherwise).
DEEPEP_TARGET = "deepep_lightning.deepep.module:DeepEPModule"


def load_class(spec: str) -> type:
    """``"package.module:Class"`` (or ``package.module.Class``) → the class.

    Raises:
        ValueError: malformed spec, module or attribute not found.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"`target` must be 'package.module:Class', got {spec!r}")
    module_name, _, attribute = spec.partition(":") if ":" in spec else spec.rpartition(".")
    if not module_name or not attribute:
        raise ValueError(f"`target` must be 'package.module:Class', got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"`target` {spec!r}: cannot import {module_name!r} ({error})") from error
    if not hasattr(module, attribute):
        raise ValueError(f"`target` {spec!r}: module {module_name!r} has no attribute {attribute!r}")
    return getattr(module, attribute)


def load_lightning_module_class(spec: str) -> type:
    """:func:`load_class`, and the class must be a LightningModule (what every level steps)."""
    import lightning.pytorch as pl

    cls = load_class(spec)
    if not (isinstance(cls, type) and issubclass(cls, pl.LightningModule)):
        raise ValueError(f"`target` {spec!r} is not a LightningModule (it is {cls!r})")
    return cls


def audit_device(device: str | None) -> torch.device:
    """``"cpu"``, ``"cuda"`` or ``"cuda:N"`` (default: CUDA when available); anything else is refused clearly."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"`device` must be 'cpu', 'cuda' or 'cuda:N', got {device!r}") from error
    if parsed.type not in ("cpu", "cuda"):
        raise ValueError(f"`device` must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"`device` is {device!r} but CUDA is not available here; HINT: --device cpu")
    if parsed.type == "cuda" and parsed.index is not None and parsed.index >= torch.cuda.device_count():
        raise ValueError(f"`device` is {device!r} but only {torch.cuda.device_count()} CUDA device(s) are visible")
    return parsed


def load_config(config: Any) -> dict[str, Any]:
    """Constructor kwargs from a dict, a YAML/JSON path, or a LightningCLI config (its ``model`` section)."""
    if config is None:
        return {}
    if isinstance(config, (str, os.PathLike)):
        with open(config, encoding="utf-8") as handle:
            config = yaml.safe_load(handle) or {}
    if not isinstance(config, dict):
        raise ValueError(f"`config` must be a mapping or a YAML file of one, got {type(config).__name__}")
    if _is_cli_config(config):
        model = config.get("model") or {}
        if not isinstance(model, dict):
            raise ValueError(f"the config's `model:` section must be a mapping, got {model!r}")
        config = dict(model.get("init_args", model)) if "class_path" in model else dict(model)
        config.pop("class_path", None)
    return dict(config)


def _merged(config: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``config`` with ``overrides`` laid over it, nested mappings merged key by key (a variant sets a few fields
    of an argument group and keeps the config's others)."""
    merged = dict(config)
    for key, value in overrides.items():
        below = merged.get(key)
        if dataclasses.is_dataclass(below) and not isinstance(below, type):
            below = dataclasses.asdict(below)  # an argument group built in code: its fields
        merged[key] = _merged(below, value) if isinstance(below, dict) and isinstance(value, dict) else value
    return merged


def _is_cli_config(config: Any) -> bool:
    """A LightningCLI file (its top-level keys are LightningCLI's), not a YAML of constructor kwargs."""
    return isinstance(config, dict) and bool(_CLI_KEYS & set(config))


#: Top-level keys of a LightningCLI config (the same test as the L4 runner's).
_CLI_KEYS = frozenset({"model", "trainer", "data", "seed_everything"})


class DataSpec:
    """A LightningDataModule class and its init args: what ``--data`` and a config's ``data:`` section name."""

    def __init__(self, cls: type, init_args: dict[str, Any]) -> None:
        self.cls, self.init_args = cls, dict(init_args)

    @property
    def class_path(self) -> str:
        return f"{self.cls.__module__}.{self.cls.__qualname__}"

    def train_dataloader(self) -> Any:
        """Build the DataModule as ``Trainer.fit`` would (``prepare_data``, ``setup("fit")``) and return its loader."""
        datamodule = self.cls(**self.init_args)
        datamodule.prepare_data()
        datamodule.setup("fit")
        return datamodule.train_dataloader()


def _read_yaml(config: Any) -> Any:
    if isinstance(config, (str, os.PathLike)):
        with open(config, encoding="utf-8") as handle:
            return yaml.safe_load(handle) or {}
    return config


def load_data(data: str | None, config: Any = None) -> DataSpec | None:
    """The DataModule to draw batches from: ``data`` (``"pkg.mod:DataModule"``) and/or the config's ``data:``.

    ``data`` names the class; its init args are the config's ``data:`` section (its ``init_args`` when it
    has a ``class_path``, else the section itself). Without ``data``, the section's ``class_path`` names
    the class. None when neither names a DataModule.

    Raises:
        ValueError: the class cannot be imported or is not a LightningDataModule, or the ``data:`` section
            has init args but no ``class_path`` and no ``data`` names the class.
    """
    import lightning.pytorch as pl

    loaded = _read_yaml(config)
    section = loaded.get("data") if _is_cli_config(loaded) else None
    if section is not None and not isinstance(section, dict):
        raise ValueError(f"the config's `data:` section must be a mapping, got {section!r}")
    init_args: dict[str, Any] = {}
    spec = data
    if section:
        init_args = dict(section.get("init_args") or {}) if "class_path" in section else dict(section)
        spec = spec or section.get("class_path")
    if spec is None:
        if init_args:
            raise ValueError(
                f"the config's `data:` section has init args {sorted(init_args)!r} but no class_path. "
                "HINT: --data package.module:DataModule"
            )
        return None
    cls = load_class(spec)
    if not (isinstance(cls, type) and issubclass(cls, pl.LightningDataModule)):
        raise ValueError(f"`data` {spec!r} is not a LightningDataModule (it is {cls!r})")
    return DataSpec(cls, init_args)


def _loss_of(output: Any) -> torch.Tensor:
    loss = step_loss(output)
    if loss is None:
        raise TypeError(
            f"`training_step` must return a loss tensor or a dict with 'loss', got {type(output).__name__}"
            " (HINT: manual optimisation needs a Trainer; audit it at L4)"
        )
    return loss


def _first_optimizer(configured: Any) -> torch.optim.Optimizer:
    if isinstance(configured, torch.optim.Optimizer):
        return configured
    if isinstance(configured, dict):
        return _first_optimizer(configured["optimizer"])
    if isinstance(configured, (list, tuple)) and configured:
        return _first_optimizer(configured[0])
    raise TypeError(f"cannot find an optimizer in configure_optimizers() output {type(configured).__name__}")


class ModuleTarget:
    """A LightningModule to audit at L2/L3.

    Args:
        target: ``"package.module:Class"`` (default: DeepEP).
        config: constructor kwargs, or a YAML path (a LightningCLI config's ``model`` section works).
        device: ``"cpu"``/``"cuda"``; default CUDA when available.
        steps: L3 of a module that is not ``SequenceAuditable``: number of consecutive optimizer steps.
        variant: one of the target's ``audit_variants()`` (DeepEP: ``"reference"``, the PyTorch value
            head; ``"fused"``, the extension's op; ``"fused_atomic"``, its atomic backward), applied
            over ``config``; None keeps the config.
        data: ``"package.module:DataModule"`` whose ``train_dataloader()`` gives the batches (init args
            from the config's ``data:`` section); None: the config's ``data:`` class, else the module's loader.

    Raises:
        ValueError: bad target/config/steps/variant.

    Example::

        target = ModuleTarget(config="configs/default.yaml", variant="fused_atomic", device="cuda")
    """

    def __init__(
        self,
        target: str | None = None,
        config: Any = None,
        device: str | None = None,
        steps: int = 3,
        variant: str | None = None,
        data: str | None = None,
    ) -> None:
        self.spec = target or DEEPEP_TARGET
        self.cls = load_lightning_module_class(self.spec)
        self.data = load_data(data, config)
        self.config = load_config(config)
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"`steps` must be an int >= 1, got {steps!r}")
        self.steps = steps
        self.device = audit_device(device)
        # asked of the class, before any instance exists: a classmethod protocol
        self.sequence: SequenceAuditable | None = self.cls if isinstance(self.cls, SequenceAuditable) else None
        variants = self.sequence.audit_variants() if self.sequence is not None else {}
        if variant is not None and not variants:
            raise ValueError(
                f"`variant` needs a target with audit_variants() (protocols.SequenceAuditable), got {variant!r} "
                f"for {self.spec!r}"
            )
        if variant is not None and variant not in variants:
            raise ValueError(f"`variant` must be one of {tuple(variants)} or None, got {variant!r}")
        self.variant = variant
        if variant is not None:
            self.config = _merged(self.config, variants[variant])

    def name(self, level: AuditLevel) -> str:
        suffix = f", variant={self.variant}" if self.variant else ""
        if self.sequence is not None:
            what = self.sequence.audit_describe(self.sequence.audit_config(dict(self.config), level), level)
        else:
            what = "one training step" if level == "L2" else f"{self.steps} optimizer steps"
        return f"{self.cls.__name__} ({what}{suffix}, {self.device.type})"

    def prepare(self, level: AuditLevel) -> "PreparedRun":
        """Build the template, draw the batches, capture the RNG state (see the module docstring)."""
        config = dict(self.config)
        if self.sequence is not None:
            config = self.sequence.audit_config(config, level)
        template = self.cls(**config)
        template.setup("fit")
        if hasattr(template, "configure_model"):
            template.configure_model()
        template = template.to(self.device)
        template.train()
        multi_step = level == "L3" and self.sequence is None
        count = self.steps if multi_step else 1
        batches = []
        if self.data is None and _lacks_own_loader(self.cls):
            raise ValueError(
                f"{self.spec} has no train_dataloader() of its own and no DataModule is named. HINT: --data "
                "package.module:DataModule, or a data: section with a class_path in the LightningCLI --config"
            )
        loader = self.data.train_dataloader() if self.data is not None else template.train_dataloader()
        for index, batch in enumerate(loader):
            if index >= count:
                break
            batches.append(move_data_to_device(batch, self.device))
        if len(batches) < count:
            source = self.data.class_path if self.data is not None else self.spec
            raise ValueError(f"{source}.train_dataloader() gave {len(batches)} batches, L3 needs {count}")
        return PreparedRun(template, batches, capture_rng_state(), multi_step)


def _lacks_own_loader(cls: type) -> bool:
    import lightning.pytorch as pl

    return getattr(cls, "train_dataloader", None) is pl.LightningModule.train_dataloader


class PreparedRun:
    """Template module + fixed batches + RNG snapshot; :meth:`run` is one repeat."""

    def __init__(self, template: Any, batches: list[Any], rng_state: dict[str, Any], multi_step: bool) -> None:
        self.template, self.batches, self.rng_state = template, batches, rng_state
        self.multi_step = multi_step

    def fresh_module(self) -> Any:
        restore_rng_state(self.rng_state)
        return copy.deepcopy(self.template)

    def run(self, module: Any) -> dict[str, Any]:
        """One repeat on ``module`` (from :meth:`fresh_module`): outputs and gradients to compare."""
        if not self.multi_step:
            loss = _loss_of(module.training_step(self.batches[0], 0))
            loss.backward()
            grads = {f"grad/{n}": p.grad for n, p in module.named_parameters() if p.grad is not None}
            return {"loss": loss.detach(), **grads}
        optimizer = _first_optimizer(module.configure_optimizers())
        result: dict[str, Any] = {}
        for step, batch in enumerate(self.batches):
            optimizer.zero_grad(set_to_none=True)
            loss = _loss_of(module.training_step(batch, step))
            loss.backward()
            optimizer.step()
            result[f"loss/step{step}"] = loss.detach()
        result.update({f"grad/{n}": p.grad for n, p in module.named_parameters() if p.grad is not None})
        result.update({f"param/{n}": p.detach() for n, p in module.named_parameters()})
        return result
