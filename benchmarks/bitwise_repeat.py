"""Run one computation several times from identical inputs and compare every output and gradient bitwise.

A :class:`Case` is a name, a function and a maker of fresh inputs. :func:`run_case` calls the maker before
every repeat (identical inputs, rebuilt so that no repeat sees another's in-place writes or gradients), runs
the function, and when an output needs a gradient, runs the backward with fixed output gradients into every
floating input leaf that requires one. The verdict is

* ``bitwise``: every output and gradient of every repeat has the first repeat's bytes (NaN payloads and
  signed zeros included);
* ``differs``: some repeat does not (``first_difference`` says which tensor, and its max |diff|);
* ``raises``: the deterministic-mode error ("does not have a deterministic implementation");
* ``error``: any other exception (unsupported input, a bug in the case), with its first line;
* ``skipped``: nothing to compare (no floating output).

Determinism is measured here, never inferred from the absence of an error: an op that runs is only covered
when its repeats are bitwise equal.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten

__all__ = ["Case", "Verdict", "bytes_equal", "run_case"]

DETERMINISTIC_ERROR = "does not have a deterministic implementation"


@dataclasses.dataclass(frozen=True)
class Case:
    """One computation to repeat.

    Attributes:
        name: unique within a sweep (``"index_add/float32/sample3"``).
        function: called as ``function(*inputs)``; returns a tensor or a (nested) sequence of tensors.
        make_inputs: returns a fresh tuple of inputs with identical values on every call.
        path: the kernel family the case exercises (``"opinfo"``, ``"module"``, ``"cudnn"``, ``"sdpa"`` ...).
    """

    name: str
    function: Callable[..., Any]
    make_inputs: Callable[[], tuple]
    path: str = "opinfo"


@dataclasses.dataclass
class Verdict:
    """What the repeats of one case showed."""

    name: str
    path: str
    verdict: str
    detail: str = ""
    compared: int = 0  # tensors compared per repeat (outputs and gradients)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def bytes_equal(a: Tensor, b: Tensor) -> bool:
    """Same dtype, shape and bytes (NaN payloads and the sign of zero count)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_sparse or b.is_sparse:
        a, b = a.to_dense(), b.to_dense()
    # a fresh contiguous copy: a one-element or expanded tensor can keep a stride that a byte view refuses
    a, b = (t.reshape(-1).clone(memory_format=torch.contiguous_format) for t in (a, b))
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _floating(value: Any) -> bool:
    return isinstance(value, Tensor) and (value.is_floating_point() or value.is_complex())


def _observe(case: Case, grad_seed: int) -> tuple[list[Tensor], int]:
    """One repeat: the outputs, then the gradients of the differentiable leaves (detached copies), and how
    many of them are outputs. The global RNG is reseeded first, so random ops draw the same numbers."""
    torch.manual_seed(grad_seed)
    inputs = case.make_inputs()
    outputs = [v for v in tree_flatten(case.function(*inputs))[0] if isinstance(v, Tensor)]
    observed = [o.detach().clone() for o in outputs]
    leaves = [v for v in tree_flatten(inputs)[0] if _floating(v) and v.requires_grad and v.is_leaf]
    differentiable = [o for o in outputs if _floating(o) and o.requires_grad]
    if leaves and differentiable:
        generator = torch.Generator().manual_seed(grad_seed)
        grad_outputs = [
            torch.randn(o.shape, generator=generator, dtype=torch.float64).to(o.device, o.dtype) for o in differentiable
        ]
        grads = torch.autograd.grad(differentiable, leaves, grad_outputs, allow_unused=True)
        observed += [g.detach().clone() for g in grads if g is not None]
    return observed, len(outputs)


def _max_abs_diff(a: Tensor, b: Tensor) -> float:
    if a.shape != b.shape or not (a.is_floating_point() or a.is_complex()):
        return float("nan")
    return float((a.double() - b.double()).abs().nan_to_num(nan=float("inf")).max()) if a.numel() else 0.0


def run_case(case: Case, repeats: int = 3, grad_seed: int = 0) -> Verdict:
    """Run ``case`` ``repeats`` times and compare bitwise (see the module docstring for the verdicts).

    Raises:
        ValueError: ``repeats`` is not an int >= 2.
    """
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 2:
        raise ValueError(f"run_case: repeats must be an int >= 2, got {repeats!r}")
    try:
        first, outputs = _observe(case, grad_seed)
        if not any(_floating(t) for t in first):
            return Verdict(case.name, case.path, "skipped", "no floating output")
        for repeat in range(1, repeats):
            again, _ = _observe(case, grad_seed)
            if len(again) != len(first):
                return Verdict(
                    case.name, case.path, "differs", f"repeat {repeat}: {len(again)} tensors, not {len(first)}"
                )
            for index, (a, b) in enumerate(zip(first, again)):
                if not bytes_equal(a, b):
                    kind = f"output {index}" if index < outputs else f"gradient {index - outputs}"
                    return Verdict(
                        case.name,
                        case.path,
                        "differs",
                        f"repeat {repeat}: {kind} {tuple(a.shape)} {a.dtype}, max |diff| {_max_abs_diff(a, b):.3g}",
                        len(first),
                    )
        return Verdict(case.name, case.path, "bitwise", "", len(first))
    except Exception as error:  # noqa: BLE001 - every failure is a verdict, the sweep goes on
        message = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
        verdict = "raises" if DETERMINISTIC_ERROR in str(error) else "error"
        return Verdict(case.name, case.path, verdict, f"{type(error).__name__}: {message}")
