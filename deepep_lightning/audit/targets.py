"""What L2/L3 audit: a LightningModule (DeepEP by default, or any class by import path) and how to step it.

Protocol (the same for every module; L4 covers Trainer, data loading and checkpoints):

* The module is built once (``Class(**config)``, ``setup("fit")``, ``configure_model()``) and moved
  to the device; this is the *template*. The global RNG state (torch CPU/CUDA, NumPy, Python) is
  captured, the batches are drawn from ``train_dataloader()`` once, and the RNG state is captured
  again. Each repeat then restores that state and runs on a ``copy.deepcopy`` of the template: same
  weights, same Python attributes, same RNG, same batches.
* **L2** — a generic module: ``training_step(batch_0, 0)`` and ``loss.backward()``; compared: the
  loss and every parameter's gradient. DeepEP: the same with ``rollout_length=1``, i.e. one timestep
  of the agent (policy, value head, recurrent cell, loss).
* **L3** — DeepEP: one full rollout of ``rollout_length`` timesteps forward and backward (one
  ``training_step``), compared like L2. A generic module: ``steps`` consecutive
  ``training_step``/``backward``/``optimizer.step`` on the first ``steps`` batches with the first
  optimizer of ``configure_optimizers()``; compared: every step's loss, the last gradients and the
  final parameters.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
import yaml
from lightning.pytorch.utilities import move_data_to_device

from deepep_lightning.determinism.rng import capture_rng_state, restore_rng_state

__all__ = ["DEEPEP_TARGET", "ModuleTarget", "load_class", "load_config"]

DEEPEP_TARGET = "deepep_lightning.deepep.module:DeepEPModule"
VALUE_HEADS = ("reference", "fused", "fused_atomic")


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


def load_config(config: Any) -> dict[str, Any]:
    """Constructor kwargs from a dict, a YAML/JSON path, or a LightningCLI config (its ``model`` section)."""
    if config is None:
        return {}
    if isinstance(config, (str, os.PathLike)):
        with open(config, encoding="utf-8") as handle:
            config = yaml.safe_load(handle) or {}
    if not isinstance(config, dict):
        raise ValueError(f"`config` must be a mapping or a YAML file of one, got {type(config).__name__}")
    if "model" in config and isinstance(config["model"], dict):  # a LightningCLI file
        model = config["model"]
        config = dict(model.get("init_args", model)) if "class_path" in model else dict(model)
        config.pop("class_path", None)
    return dict(config)


@contextlib.contextmanager
def _atomic_value_head() -> Iterator[None]:
    """Route DeepEP's value head to the extension's atomic (``deterministic=False``) backward."""
    import deepep_lightning.ops as ops

    original = ops.all_action_q
    ops.all_action_q = functools.partial(original, deterministic=False)
    try:
        yield
    finally:
        ops.all_action_q = original


def _loss_of(output: Any) -> torch.Tensor:
    loss = output.get("loss") if isinstance(output, dict) else output
    if not isinstance(loss, torch.Tensor):
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
        steps: L3 for a generic module: number of consecutive optimizer steps.
        value_head: DeepEP only — ``"reference"`` (PyTorch), ``"fused"`` (the extension, deterministic
            backward) or ``"fused_atomic"`` (the extension's atomic backward); None keeps the config.

    Raises:
        ValueError: bad target/config/steps/value_head.
    """

    def __init__(
        self,
        target: str | None = None,
        config: Any = None,
        device: str | None = None,
        steps: int = 3,
        value_head: str | None = None,
    ) -> None:
        self.spec = target or DEEPEP_TARGET
        self.cls = load_class(self.spec)
        self.config = load_config(config)
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"`steps` must be an int >= 1, got {steps!r}")
        self.steps = steps
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.is_deepep = self.cls.__name__ == "DeepEPModule" and hasattr(self.cls, "rollout_state_dict")
        if value_head is not None and value_head not in VALUE_HEADS:
            raise ValueError(f"`value_head` must be one of {VALUE_HEADS} or None, got {value_head!r}")
        if value_head is not None and not self.is_deepep:
            raise ValueError(f"`value_head` applies to DeepEP only, the target is {self.spec!r}")
        self.value_head = value_head
        if self.is_deepep:
            self.config.pop("seed_everything", None)
            if value_head is not None:
                self.config["fused_value_head"] = value_head != "reference"

    def name(self, level: str) -> str:
        suffix = f", value_head={self.value_head}" if self.value_head else ""
        if self.is_deepep:
            what = "one timestep" if level == "L2" else f"rollout of T={self._rollout_length()}"
        else:
            what = "one training step" if level == "L2" else f"{self.steps} optimizer steps"
        return f"{self.cls.__name__} ({what}{suffix}, {self.device.type})"

    def _rollout_length(self) -> int:
        return int(self.config.get("rollout_length", 32))

    def prepare(self, level: str) -> "PreparedRun":
        """Build the template, draw the batches, capture the RNG state (see the module docstring)."""
        config = dict(self.config)
        if self.is_deepep and level == "L2":
            config["rollout_length"] = 1
        template = self.cls(**config)
        template.setup("fit")
        if hasattr(template, "configure_model"):
            template.configure_model()
        template = template.to(self.device)
        template.train()
        count = 1 if (level == "L2" or self.is_deepep) else self.steps
        batches = []
        loader = template.train_dataloader()
        for index, batch in enumerate(loader):
            if index >= count:
                break
            batches.append(move_data_to_device(batch, self.device))
        if len(batches) < count:
            raise ValueError(f"{self.spec}.train_dataloader() gave {len(batches)} batches, L3 needs {count}")
        rng_state = capture_rng_state()
        multi_step = level == "L3" and not self.is_deepep
        return PreparedRun(
            template, batches, rng_state, multi_step, _atomic_value_head if self.value_head == "fused_atomic" else None
        )


class PreparedRun:
    """Template module + fixed batches + RNG snapshot; :meth:`run` is one repeat."""

    def __init__(
        self, template: Any, batches: list, rng_state: dict, multi_step: bool, context: Callable[[], Any] | None
    ) -> None:
        self.template, self.batches, self.rng_state = template, batches, rng_state
        self.multi_step, self.context = multi_step, context

    def fresh_module(self) -> Any:
        restore_rng_state(self.rng_state)
        return copy.deepcopy(self.template)

    def run(self, module: Any) -> dict[str, Any]:
        """One repeat on ``module`` (from :meth:`fresh_module`): outputs and gradients to compare."""
        with self.context() if self.context else contextlib.nullcontext():
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
