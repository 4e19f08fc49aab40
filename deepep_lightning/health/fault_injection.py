"""FaultInjectionCallback: plant NaN/Inf in the loss, a gradient, a parameter or the batch, on chosen steps."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Literal, get_args

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import Callback
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from typing_extensions import override

from deepep_lightning import _checks
from deepep_lightning._sharded import local
from deepep_lightning.health._step_hooks import add_step_hook, remove_step_hook
from deepep_lightning.protocols import step_loss

__all__ = ["FaultInjectionCallback"]

log = logging.getLogger(__name__)

#: Where the fault is planted.
Target = Literal["loss", "gradient", "parameter", "batch"]
#: ``"once"`` per listed step (a transient fault) or ``"always"`` (every time the step runs: persistent).
Mode = Literal["once", "always"]
#: The planted value.
Value = Literal["nan", "inf", "-inf"]
_TARGETS: tuple[str, ...] = get_args(Target)
_MODES: tuple[str, ...] = get_args(Mode)
_VALUES = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}


def _poison(tensor: Tensor, value: float) -> None:
    # a sharded tensor (FSDP2, tensor parallel): the first element of this rank's shard, no collective
    tensor = local(tensor)
    with torch.no_grad():
        tensor[(0,) * tensor.dim()] = value


class FaultInjectionCallback(Callback):
    r"""Injects a non-finite value at given optimizer steps, for testing detection and recovery.

    Steps are 0-based optimizer-step indices (``trainer.global_step`` when the step starts).
    Injection also fires inside rollback replays, so ``mode="once"`` models a transient fault
    (a replay is clean) and ``mode="always"`` a persistent one (a replay fails the same way).

    Under manual optimisation the optimizer step happens inside ``training_step``; for a module
    whose step is one CUDA graph (e.g. ``ExecutionConfig(cuda_graph=True)`` of DeepEP) it is a graph replay.
    There, ``"parameter"`` is the fault that reaches training: it is written into the parameter
    in place, which the graph reads, so the loss, the gradients and the updated weights turn non-finite. ``"loss"`` only
    poisons the loss the step *reports* (the update is already done), which tests detection
    alone; ``"gradient"`` needs ``on_after_backward``, which a captured backward never calls, so
    it raises instead of silently planting nothing.

    Args:
        target: ``"loss"`` (the training step's loss is multiplied by the value, so the
            gradients turn non-finite too), ``"gradient"`` (after backward, one element of a
            parameter's gradient), ``"parameter"`` (before the forward, one element of a parameter)
            or ``"batch"`` (one element of the first floating-point tensor of the batch).
        steps: the steps to inject at (non-negative ints).
        mode: ``"once"`` per listed step, or ``"always"`` (every time the step runs).
        value: ``"nan"``, ``"inf"`` or ``"-inf"``.
        parameter: name of the parameter for ``"gradient"``/``"parameter"`` (default: the first
            trainable one).

    Raises:
        MisconfigurationException: an invalid argument or an unknown parameter name.

    Example::

        Trainer(callbacks=[FaultInjectionCallback("gradient", steps=[12], mode="once"), ...])
    """

    def __init__(
        self,
        target: Target = "loss",
        steps: Sequence[int] = (5,),
        mode: Mode = "once",
        value: Value = "nan",
        parameter: str | None = None,
    ) -> None:
        self.target: Target = _checks.choice(None, "target", target, _TARGETS)
        self.mode: Mode = _checks.choice(None, "mode", mode, _MODES)
        self.value: Value = _checks.choice(None, "value", value, tuple(_VALUES))
        if isinstance(steps, (int, str)) or not all(
            isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in steps
        ):
            raise MisconfigurationException(f"`steps` must be a list of ints >= 0, got {steps!r}.")
        self.steps = sorted(set(steps))
        self.parameter = parameter
        self.injections: list[tuple[int, str]] = []  # (step, target) each time a fault was planted
        self._fired: set[int] = set()
        self._param: torch.nn.Parameter | None = None
        self._gradient_due: int | None = None  # a step whose gradient fault has not been planted yet

    @property
    def state_key(self) -> str:
        return self._generate_state_key(target=self.target, steps=tuple(self.steps), mode=self.mode)

    def _fire(self, step: int) -> bool:
        if step not in self.steps or (self.mode == "once" and step in self._fired):
            return False
        self._fired.add(step)
        self.injections.append((step, self.target))
        log.info("FaultInjectionCallback: %s %s at step %d", self.value, self.target, step)
        return True

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.target in ("gradient", "parameter"):
            params = dict(pl_module.named_parameters())
            name = self.parameter or next((n for n, p in params.items() if p.requires_grad), None)
            if name not in params:
                raise MisconfigurationException(
                    f"`parameter` must name a parameter of the module, got {self.parameter!r}. "
                    f"HINT: one of {sorted(params)[:8]}."
                )
            self._param = params[name]
            self.parameter = name
        if self.target == "loss":
            add_step_hook(pl_module, f"fault:{id(self)}", post=self._poison_loss)
        elif self.target in ("parameter", "batch"):
            add_step_hook(pl_module, f"fault:{id(self)}", pre=self._poison_input)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # the parameter as the strategy left it: `configure_model` runs after `setup` (fully_shard, tensor
        # parallel and meta-device init put new Parameter objects in place)
        if self._param is not None and self.parameter is not None:
            self._param = dict(pl_module.named_parameters())[self.parameter]

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        remove_step_hook(pl_module, f"fault:{id(self)}")

    def _poison_loss(self, step: int, output: Any) -> Any:
        loss = step_loss(output)
        if loss is None or not self._fire(step):
            return output
        poisoned = loss * _VALUES[self.value]
        return poisoned if isinstance(output, Tensor) else {**output, "loss": poisoned}

    def _poison_input(self, step: int, batch: Any) -> Any:
        if not self._fire(step):
            return batch
        if self.target == "parameter":
            assert self._param is not None
            _poison(self._param.data, _VALUES[self.value])
            return batch
        batch = apply_to_collection(batch, Tensor, lambda t: t.clone())
        floats = []
        apply_to_collection(batch, Tensor, lambda t: floats.append(t) if t.is_floating_point() else None)
        if not floats:
            raise ValueError(
                "FaultInjectionCallback(target='batch') needs a floating-point tensor in the batch, got "
                f"{type(batch).__name__}. HINT: use target='loss' or 'parameter' for index-only batches."
            )
        _poison(floats[0], _VALUES[self.value])
        return batch

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        due = self.target == "gradient" and step in self.steps and not (self.mode == "once" and step in self._fired)
        self._gradient_due = step if due else None

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.target == "gradient" and self._param is not None and self._param.grad is not None:
            if self._fire(trainer.global_step):
                _poison(self._param.grad, _VALUES[self.value])
                self._gradient_due = None

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step, self._gradient_due = self._gradient_due, None
        if step is not None and not pl_module.automatic_optimization:
            raise RuntimeError(
                f"FaultInjectionCallback(target='gradient') could not plant its fault at step {step}: "
                "`on_after_backward` was not called, as in a manually optimised step without `manual_backward` "
                "(e.g. a module whose backward runs inside a CUDA graph, see protocols.UncapturedSteps). "
                "HINT: use target='parameter', which the graph reads."
            )

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"fired": sorted(self._fired)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._fired = set(state_dict.get("fired", []))
