"""Non-finite locator: replay a step and name the first op whose output holds NaN/Inf.

Like TensorFlow's ``enable_check_numerics``, in PyTorch terms: a
``TorchDispatchMode`` sees every aten op of the forward **and** the backward
(autograd runs its backward ops through the dispatcher too), checks each
floating output with ``torch.isfinite`` and records the first offender with its
module path (``ModTracker``; it marks backward as well), the statistics of its
inputs, and the user's stack frame (for backward ops: the frame of the forward
call that created the autograd node, recorded by anomaly mode with
``check_nan=False``). Every op is synchronised on, so use it to diagnose, not to train.

:func:`locate_nonfinite_update` covers the optimizer step: it runs ``optimizer.step()`` on the
gradients in place and names the optimizer and the parameter whose update went non-finite.
"""

from __future__ import annotations

import re
import sys
import traceback
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from deepep_lightning._lightning_compat import current_autograd_node
from deepep_lightning._sharded import local
from deepep_lightning.audit._provenance import (
    in_backward,
    innermost_module,
    is_user_file,
    named_module_tracker,
    normalise_files,
)
from deepep_lightning.protocols import step_loss

__all__ = ["DEFAULT_ALLOW_INF_OPS", "NonFiniteOp", "locate_nonfinite", "locate_nonfinite_update"]

#: ops that produce ±inf on purpose (attention/logit masking). NaN is always reported.
DEFAULT_ALLOW_INF_OPS: frozenset[str] = frozenset(
    {
        "aten.masked_fill.Scalar",
        "aten.masked_fill_.Scalar",
        "aten.masked_fill.Tensor",
        "aten.masked_fill_.Tensor",
        "aten.full.default",
        "aten.fill_.Scalar",
        "aten.scalar_tensor.default",
        "aten.where.self",
        "aten.where.ScalarOther",
        "aten.lift_fresh.default",
        "aten._local_scalar_dense.default",
    }
)

# ops whose output is uninitialised memory (garbage may look like NaN until written)
_UNINITIALISED_PREFIXES = ("aten.empty", "aten.new_empty", "aten.resize_", "aten.set_")

# ops that return a buffer they write only in part, and how many leading outputs they do write:
# FSDP2's all-gather copy-in fills this rank's slice (output 0) of the gather buffer (output 1),
# whose other slices hold whatever memory the buffer got until the all-gather lands
_PARTLY_WRITTEN_OUTPUTS = {"fsdp.all_gather_copy_in.default": 1}

#: Where the first non-finite value appeared: an op's output in forward or backward, a parameter
#: before the step, or a parameter's update in the optimizer step.
Phase = Literal["forward", "backward", "before", "optimizer"]


@dataclass
class NonFiniteOp:
    """The first op whose output was non-finite."""

    op: str  # aten overload, e.g. "aten.log.default"; "parameter" when a parameter was already non-finite
    phase: Phase
    module_path: str | None
    output_dtype: str
    output_shape: tuple[int, ...]
    output_nan: bool
    output_inf: bool
    inputs: list[dict[str, Any]] = field(default_factory=list)
    user_frame: str | None = None
    autograd_node: str | None = None
    optimizer: str | None = None  # phase "optimizer": the optimizer whose step made the parameter non-finite
    parameter: str | None = None  # phase "optimizer": that parameter's qualified name

    @property
    def inputs_finite(self) -> bool:
        return not any(i.get("nan") or i.get("inf") for i in self.inputs)

    def describe(self) -> str:
        kind = "NaN" if self.output_nan else "Inf"
        lines = [f"first non-finite ({kind}) output: {self.op} in {self.phase}"]
        lines.append(f"  module: {self.module_path or '<no module forward active>'}")
        if self.optimizer is not None:
            lines.append(f"  optimizer: {self.optimizer}, parameter: {self.parameter}")
        if self.autograd_node:
            lines.append(f"  autograd node: {self.autograd_node}")
        lines.append(f"  output: {self.output_dtype} {list(self.output_shape)}")
        for info in self.inputs:
            lines.append(f"  input {info['index']}: {info}")
        if self.inputs and not self.inputs_finite:
            lines.append("  (an input was already non-finite: the fault entered before this op)")
        lines.append(f"  at: {self.user_frame or '<no user frame>'}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "output_shape": list(self.output_shape), "inputs_finite": self.inputs_finite}


def _frame_from_stack(internal: frozenset[str]) -> str | None:
    for frame in reversed(traceback.extract_stack()):
        if is_user_file(frame.filename, internal):
            return f"{frame.filename}:{frame.lineno} in {frame.name}: {frame.line}"
    return None


_NODE_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)\s*(?P<code>.*)', re.S)


def _frame_from_node(node: Any, internal: frozenset[str]) -> str | None:
    """The user frame of the forward call that created autograd ``node`` (anomaly-mode traceback)."""
    lines = getattr(node, "metadata", {}).get("traceback_") if node is not None else None
    for entry in reversed(lines or []):
        match = _NODE_FRAME.search(entry)
        if match and is_user_file(match["file"], internal):
            return f"{match['file']}:{match['line']} in {match['func']}: {match['code'].strip()}"
    return None


def _stats(index: int, value: Tensor) -> dict[str, Any]:
    value = local(value)  # a DTensor: this rank's shard, no collective
    info: dict[str, Any] = {"index": index, "dtype": str(value.dtype).replace("torch.", ""), "shape": list(value.shape)}
    if value.is_floating_point() or value.is_complex():
        data = value.detach()
        finite = data[torch.isfinite(data)] if data.numel() else data
        info["nan"] = bool(torch.isnan(data).any())
        info["inf"] = bool(torch.isinf(data).any())
        info["min"] = float(finite.min()) if finite.numel() else None
        info["max"] = float(finite.max()) if finite.numel() else None
        info["zeros"] = int((data == 0).sum())
    elif value.numel():
        info["min"], info["max"] = float(value.min()), float(value.max())
    return info


class _CheckNumerics(TorchDispatchMode):
    def __init__(self, tracker: Any, allow_inf_ops: Iterable[str], internal_files: frozenset[str]) -> None:
        super().__init__()
        self.tracker = tracker
        self.allow = frozenset(allow_inf_ops)
        self.internal = internal_files
        self.found: NonFiniteOp | None = None

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.found is not None:
            return out
        name = str(func)
        # a view creates no values (a NaN in it was already in its base, or is unwritten memory of
        # an ``empty`` buffer about to be filled), so it cannot be the op that produced a NaN
        if name.startswith(_UNINITIALISED_PREFIXES) or getattr(func, "is_view", False):
            return out
        outputs, _ = tree_flatten(out)
        if name in _PARTLY_WRITTEN_OUTPUTS:
            outputs = outputs[: _PARTLY_WRITTEN_OUTPUTS[name]]
        for value in outputs:
            if not isinstance(value, Tensor) or not (value.is_floating_point() or value.is_complex()):
                continue
            # a DTensor (tensor parallel) is checked on this rank's shard: a check over the whole tensor would
            # be a collective, and ranks stop checking at different ops
            value = local(value)
            if value.numel() == 0 or bool(torch.isfinite(value).all()):
                continue
            has_nan = bool(torch.isnan(value).any())
            if not has_nan and name in self.allow:
                continue
            node = current_autograd_node()
            backward = in_backward(self.tracker, node)
            inputs, _ = tree_flatten((args, kwargs or {}))
            frame = _frame_from_stack(self.internal)
            self.found = NonFiniteOp(
                op=name,
                phase="backward" if backward else "forward",
                module_path=innermost_module(self.tracker),
                output_dtype=str(value.dtype).replace("torch.", ""),
                output_shape=tuple(value.shape),
                output_nan=has_nan,
                output_inf=bool(torch.isinf(value).any()),
                inputs=[_stats(i, t) for i, t in enumerate(x for x in inputs if isinstance(x, Tensor))],
                user_frame=(_frame_from_node(node, self.internal) or frame) if backward else frame,
                autograd_node=type(node).__name__ if node is not None else None,
            )
            break
        return out


def _nonfinite_parameter(module: torch.nn.Module) -> NonFiniteOp | None:
    for name, sharded in module.named_parameters():
        param = local(sharded)  # FSDP2, tensor parallel: this rank's shard, no collective
        if param.numel() and not bool(torch.isfinite(param.detach()).all()):
            return NonFiniteOp(
                op="parameter",
                phase="before",
                module_path=name,
                output_dtype=str(param.dtype).replace("torch.", ""),
                output_shape=tuple(sharded.shape),
                output_nan=bool(torch.isnan(param.detach()).any()),
                output_inf=bool(torch.isinf(param.detach()).any()),
            )
    return None


def locate_nonfinite(
    fn: Callable[..., Any],
    *args: Any,
    module: torch.nn.Module | None = None,
    backward: bool = True,
    allow_inf_ops: Iterable[str] = DEFAULT_ALLOW_INF_OPS,
    internal_files: Iterable[str] = (),
    complete_step: bool = False,
    **kwargs: Any,
) -> NonFiniteOp | None:
    """Run ``fn(*args, **kwargs)`` (and the backward of its loss) and return the first non-finite op.

    Args:
        fn: one step's computation, e.g. ``model`` or ``lambda: module.training_step(batch, 0)``.
            It may return a loss tensor, a dict with ``"loss"``, or anything else.
        module: the model; gives module paths (via ``ModTracker``) and is checked for
            non-finite parameters first (reported as ``op="parameter"``, ``phase="before"``).
        backward: call ``.backward()`` on the returned loss inside the check (when it requires grad).
        allow_inf_ops: aten overload names (``str(func)``, e.g. ``"aten.masked_fill.Scalar"``)
            allowed to output ±inf; NaN is never allowed.
        internal_files: paths of the caller's own wrappers around the step (a rollback's replay),
            whose frames are never reported as the user's; torch, Lightning, the standard library
            and installed packages never are either.
        complete_step: run the whole step (forward and backward) even when a parameter or an op
            was already found non-finite. Needed where the step holds collectives every rank must
            join (FSDP2's all-gathers and reduce-scatters, tensor parallel): every rank then runs the
            same ops, whatever it finds. Sharded tensors are checked on this rank's shards.

    Returns:
        A :class:`NonFiniteOp`, or None when every op stayed finite.

    Example::

        found = locate_nonfinite(lambda: model(x).sum(), module=model)
        if found:
            print(found.describe())
    """
    bad_param = _nonfinite_parameter(module) if module is not None else None
    if bad_param is not None and not complete_step:
        return bad_param
    tracker = named_module_tracker(module) if module is not None else None
    mode = _CheckNumerics(tracker, allow_inf_ops, normalise_files(list(internal_files)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # anomaly mode announces itself on every entry
        with torch.autograd.detect_anomaly(check_nan=False):
            if tracker is not None:
                tracker.__enter__()
            try:
                with mode:
                    output = fn(*args, **kwargs)
                    loss = step_loss(output)
                    if backward and loss is not None and loss.requires_grad and (mode.found is None or complete_step):
                        loss.sum().backward() if loss.numel() != 1 else loss.backward()
            finally:
                if tracker is not None:
                    tracker.__exit__(*sys.exc_info())
    return bad_param or mode.found


def locate_nonfinite_update(
    optimizers: Sequence[torch.optim.Optimizer],
    module: torch.nn.Module,
    allow_inf_ops: Iterable[str] = DEFAULT_ALLOW_INF_OPS,
    internal_files: Iterable[str] = (),
) -> NonFiniteOp | None:
    """Run each optimizer's ``step()`` on the gradients in place; name the first parameter it makes non-finite.

    For a step whose forward and backward stay finite (:func:`locate_nonfinite` found nothing) but
    whose update does not: an infinite learning rate, an overflowing moment, a custom optimizer.
    The parameters change, so call it on a state that is restored afterwards.

    Args:
        optimizers: the optimizers, in the order the training step uses them.
        module: the model; its ``named_parameters()`` name the parameter.
        allow_inf_ops / internal_files: as for :func:`locate_nonfinite`.

    Returns:
        A :class:`NonFiniteOp` with ``phase="optimizer"``, ``optimizer`` (class and index) and
        ``parameter`` (qualified name; also ``module_path``); ``op`` is the first aten op of the step
        whose output was non-finite, or ``"<Optimizer>.step"`` when no op's output showed it. None
        when every parameter stays finite.

    Example::

        loss.backward()
        found = locate_nonfinite_update([optimizer], model)
    """
    names = {id(param): name for name, param in module.named_parameters()}
    for index, optimizer in enumerate(optimizers):
        params = [p for group in optimizer.param_groups for p in group["params"]]
        was_finite = [bool(torch.isfinite(p.detach()).all()) for p in params]
        mode = _CheckNumerics(None, allow_inf_ops, normalise_files(list(internal_files)))
        with mode, torch.no_grad():
            optimizer.step()
        for param, before in zip(params, was_finite):
            data = param.detach()
            if not before or bool(torch.isfinite(data).all()):
                continue
            label = f"{type(optimizer).__name__} (optimizer {index})"
            name = names.get(id(param))
            return NonFiniteOp(
                op=mode.found.op if mode.found is not None else f"{type(optimizer).__name__}.step",
                phase="optimizer",
                module_path=name,
                output_dtype=str(data.dtype).replace("torch.", ""),
                output_shape=tuple(data.shape),
                output_nan=bool(torch.isnan(data).any()),
                output_inf=bool(torch.isinf(data).any()),
                inputs=mode.found.inputs if mode.found is not None else [],
                user_frame=mode.found.user_frame if mode.found is not None else None,
                optimizer=label,
                parameter=name,
            )
    return None
