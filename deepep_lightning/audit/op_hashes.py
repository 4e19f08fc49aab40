"""Per-op hash log (a ``TorchDispatchMode``) and the first divergent op between two logs.

:class:`OpHashMode` sees every ATen/custom op that runs, forward and backward (autograd runs the
backward ops through the same dispatcher), and records for each: name, phase, qualified module path (from
``named_modules()``, tracked by a ``ModTracker``: ``blocks.2.attn``), a short user stack, dtype/shape and exact
hashes (:func:`~deepep_lightning.audit.hashing.tensor_hash`) of the tensor inputs **before** the op
runs (in-place ops mutate them) and of the outputs after, and the non-tensor arguments. This is
PyTorch's ``DebugMode(record_tensor_attributes, log_tensor_hashes)`` idea with exact hashes and
input hashes, so :func:`first_divergence` can tell the op that *created* a difference (inputs
identical, outputs differ) from the ops that merely propagated it.

View ops create no values and are not logged (their output's provenance is their base's).
"""

from __future__ import annotations

import dataclasses
import linecache
import sys
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from deepep_lightning._lightning_compat import current_autograd_node
from deepep_lightning.audit._provenance import in_backward, innermost_module, is_user_file, named_module_tracker
from deepep_lightning.audit.causes import EMPTY_LIKE_OPS, base_name, likely_cause
from deepep_lightning.audit.forward_origins import ForwardOrigins
from deepep_lightning.audit.hashing import hashes_to_ints, max_abs_diff, tensor_hash

__all__ = ["Divergence", "OpHashMode", "OpRecord", "first_divergence", "locate"]

_STACK_DEPTH = 3


def _user_frames() -> list[tuple[str, int, str]]:
    """Up to three innermost frames of the user's code (:func:`._provenance.is_user_file`; no source read)."""
    frames: list[tuple[str, int, str]] = []
    frame: types.FrameType | None = sys._getframe(2)
    while frame is not None and len(frames) < _STACK_DEPTH:
        if is_user_file(frame.f_code.co_filename):
            frames.append((frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back
    return frames


def _scalar_repr(value: Any) -> str:
    if isinstance(
        value, (bool, int, float, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)
    ):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_scalar_repr(v) for v in value) + "]"
    if isinstance(value, torch.Generator):
        return f"Generator({value.device})"  # its state is the op's hidden input: RNG ops are classified by name
    return type(value).__name__


@dataclasses.dataclass
class OpRecord:
    """One op as the mode saw it (hashes are host ints after :meth:`OpHashMode.finish`)."""

    index: int
    op: str
    phase: str
    module_path: str | None
    autograd_node: str | None
    frames: list
    scalars: str
    input_meta: list
    output_meta: list
    input_hashes: list = dataclasses.field(default_factory=list)
    output_hashes: list = dataclasses.field(default_factory=list)
    input_producers: list = dataclasses.field(default_factory=list)
    accumulate: bool = False
    deterministic_arg: bool | None = None
    forward_caller: str | None = None  # backward ops: the call outside torch that made their autograd node

    @property
    def uninitialised_inputs(self) -> list[int]:
        """Inputs that came straight from an allocation (``empty*``): their bytes are not compared."""
        return [k for k, p in enumerate(self.input_producers) if p is not None and base_name(p) in EMPTY_LIKE_OPS]

    def compared_inputs(self) -> list:
        skip = set(self.uninitialised_inputs)
        return [(m, h) for k, (m, h) in enumerate(zip(self.input_meta, self.input_hashes)) if k not in skip]

    def stack(self) -> list[str]:
        return [f"{f}:{n} in {fn}: {linecache.getline(f, n).strip()}" for f, n, fn in self.frames]


@dataclasses.dataclass
class Divergence:
    """The first op whose outputs differ between a reference run and another run."""

    index: int
    op: str
    phase: str
    module_path: str | None
    autograd_node: str | None
    stack: list
    output_shapes: list
    output_dtypes: list
    inputs_identical: bool
    max_abs_diff: float | None
    cause: str
    explanation: str
    ops_compared: int
    forward_caller: str | None = None

    def describe(self) -> str:
        where = self.module_path or "(no module)"
        if self.forward_caller:
            where += f" (its forward: {self.forward_caller})"
        diff = "n/a (values not kept)" if self.max_abs_diff is None else f"{self.max_abs_diff:.6g}"
        lines = [
            f"first divergent op #{self.index}: {self.op} ({self.phase}) in module {where}"
            + (f", autograd node {self.autograd_node}" if self.autograd_node else ""),
            f"  outputs: {', '.join(f'{d}{s}' for d, s in zip(self.output_dtypes, self.output_shapes))};"
            f" max |diff| {diff}",
            f"  inputs identical: {self.inputs_identical}; likely cause: {self.cause} ({self.explanation})",
        ]
        lines += [f"  at {frame}" for frame in self.stack]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class OpHashMode(TorchDispatchMode):
    """Record every op's input/output hashes; use as ``with OpHashMode(module) as log: ...``.

    Args:
        module: the model (module paths are its ``named_modules()`` names; ``None``: no paths).
        keep_bytes: keep detached copies of outputs (on their device) until this many bytes, so a
            divergence can report its max |diff|; 0 keeps none (hash only, the fastest).

    Example::

        with OpHashMode(model) as log:
            model(x).sum().backward()
        log.records[0].op  # e.g. 'aten.addmm.default'
    """

    def __init__(self, module: torch.nn.Module | None = None, keep_bytes: int = 256 * 2**20) -> None:
        super().__init__()
        if isinstance(keep_bytes, bool) or not isinstance(keep_bytes, int) or keep_bytes < 0:
            raise ValueError(f"`keep_bytes` must be an int >= 0, got {keep_bytes!r}")
        self.records: list[OpRecord] = []
        self.kept: dict[int, list[Tensor]] = {}
        self._keep_left = keep_bytes
        self._tracker = named_module_tracker(module) if module is not None else None
        self._producer: WeakIdKeyDictionary = WeakIdKeyDictionary()
        # tensor -> (version counter, hash): an input that an earlier op produced (or that was hashed
        # before) and has not been written since is not hashed again
        self._hash_cache: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._pending: list[tuple[OpRecord, list[Tensor], list[Tensor]]] = []
        # a backward op is attributed to the module and call that ran its forward, not to the module
        # whose backward hook ran last
        self._origins = ForwardOrigins(self._tracker, _user_frames)

    def __enter__(self) -> "OpHashMode":
        if self._tracker is not None:
            self._tracker.__enter__()
        self._origins.__enter__()
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self._origins.__exit__(*exc)
        if self._tracker is not None:
            self._tracker.__exit__(*exc)
        self.finish()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "is_view", False):
            out = func(*args, **kwargs)
            base = args[0] if args and isinstance(args[0], Tensor) else None
            for value in tree_flatten(out)[0]:
                if isinstance(value, Tensor) and base is not None and base in self._producer:
                    self._producer[value] = self._producer[base]
            return out
        flat_inputs = tree_flatten((args, kwargs))[0]
        tensors_in = [v for v in flat_inputs if isinstance(v, Tensor)]
        in_hashes = [self._hash(t) for t in tensors_in]
        node = current_autograd_node()
        origin = self._origins.origin_of(node)
        record = OpRecord(
            index=len(self.records),
            op=str(func),
            phase="backward" if in_backward(self._tracker, node) else "forward",
            module_path=origin.module_path if origin is not None else innermost_module(self._tracker),
            autograd_node=type(node).__name__ if node is not None else None,
            frames=origin.frames if origin is not None else _user_frames(),
            forward_caller=origin.caller if origin is not None else None,
            scalars=_scalar_repr([v for v in flat_inputs if not isinstance(v, Tensor)]),
            input_meta=[(str(t.dtype).replace("torch.", ""), tuple(t.shape)) for t in tensors_in],
            output_meta=[],
            input_producers=[self._producer.get(t) for t in tensors_in],
        )
        schema_args = getattr(getattr(func, "_schema", None), "arguments", [])
        for position, argument in enumerate(schema_args):
            value = kwargs.get(argument.name, args[position] if position < len(args) else None)
            if argument.name == "accumulate" and value is True:
                record.accumulate = True
            if argument.name == "deterministic" and isinstance(value, bool):
                record.deterministic_arg = value
        out = func(*args, **kwargs)
        tensors_out = [v for v in tree_flatten(out)[0] if isinstance(v, Tensor)]
        record.output_meta = [(str(t.dtype).replace("torch.", ""), tuple(t.shape)) for t in tensors_out]
        out_hashes = [tensor_hash(t) for t in tensors_out]
        for value, digest in zip(tensors_out, out_hashes):
            self._producer[value] = record.op
            self._remember(value, digest)
        size = sum(t.numel() * t.element_size() for t in tensors_out)
        if size <= self._keep_left:
            self._keep_left -= size
            self.kept[record.index] = [t.detach().clone() for t in tensors_out]
        self.records.append(record)
        self._pending.append((record, in_hashes, out_hashes))
        return out

    def _hash(self, tensor: Tensor) -> Tensor:
        cached = self._hash_cache.get(tensor)
        version = getattr(tensor, "_version", None)
        if cached is not None and version is not None and cached[0] == version:
            return cached[1]
        digest = tensor_hash(tensor)
        self._remember(tensor, digest)
        return digest

    def _remember(self, tensor: Tensor, digest: Tensor) -> None:
        try:
            self._hash_cache[tensor] = (tensor._version, digest)
        except (RuntimeError, TypeError):  # inference tensors have no version counter
            pass

    def finish(self) -> None:
        """Bring pending hashes to the host (called on exit)."""
        flat = [h for _, i, o in self._pending for h in i + o]
        values = iter(hashes_to_ints(flat))
        for record, in_hashes, out_hashes in self._pending:
            record.input_hashes = [next(values) for _ in in_hashes]
            record.output_hashes = [next(values) for _ in out_hashes]
        self._pending = []


def first_divergence(reference: OpHashMode, other: OpHashMode) -> Divergence | None:
    """The first op whose outputs differ (or where the op sequences part); None when identical."""
    refs, others = reference.records, other.records
    for index in range(min(len(refs), len(others))):
        a, b = refs[index], others[index]
        if a.op != b.op or a.phase != b.phase:
            return _make(
                a,
                None,
                "control flow",
                f"the op sequences part here: {a.op} ({a.phase}) vs {b.op} ({b.phase}); a data-dependent"
                " branch, or an earlier difference seen by Python (.item(), a Python RNG)",
                len(refs),
            )
        if a.output_meta == b.output_meta and (a.output_hashes == b.output_hashes or base_name(a.op) in EMPTY_LIKE_OPS):
            continue  # an allocation's bytes differ freely; reading them is caught at the reader
        inputs_identical = a.compared_inputs() == b.compared_inputs()
        diff = None
        if index in reference.kept and index in other.kept:
            diffs = [max_abs_diff(x, y) for x, y in zip(reference.kept[index], other.kept[index])]
            known = [d for d in diffs if d is not None]
            diff = max(known) if known else None
        skip = set(b.uninitialised_inputs)
        differing = [k for k, (x, y) in enumerate(zip(a.input_hashes, b.input_hashes)) if x != y and k not in skip]
        cause, explanation = likely_cause(
            b,
            inputs_identical=inputs_identical,
            scalars_identical=a.scalars == b.scalars,
            differing_input_producers=[b.input_producers[k] for k in differing],
        )
        return _make(b, diff, cause, explanation, len(refs), inputs_identical)
    if len(refs) != len(others):
        shorter = refs[len(others)] if len(refs) > len(others) else others[len(refs)]
        return _make(
            shorter, None, "control flow", f"one run executed {len(refs)} ops, the other {len(others)}", len(refs)
        )
    return None


def _make(
    record: OpRecord, diff: float | None, cause: str, explanation: str, count: int, inputs_identical: bool = False
) -> Divergence:
    return Divergence(
        index=record.index,
        op=record.op,
        phase=record.phase,
        module_path=record.module_path,
        autograd_node=record.autograd_node,
        stack=record.stack(),
        output_shapes=[list(s) for _, s in record.output_meta],
        output_dtypes=[d for d, _ in record.output_meta],
        inputs_identical=inputs_identical,
        max_abs_diff=diff,
        cause=cause,
        explanation=explanation,
        ops_compared=count,
        forward_caller=record.forward_caller,
    )


def locate(
    make_run: Callable[[], tuple[torch.nn.Module | None, Callable[[], Any]]],
    attempts: int = 4,
    keep_bytes: int = 256 * 2**20,
) -> tuple[Divergence | None, int]:
    """Log a reference run, then up to ``attempts`` more until one differs; ``(divergence, runs logged)``.

    Args:
        make_run: returns ``(module or None, run)``; called before every logged run, it must reset
            whatever the computation starts from (RNG, weights), exactly as between audit repeats.
        attempts: logged runs compared with the reference before giving up (a rare difference).
        keep_bytes: see :class:`OpHashMode`.
    """
    if isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1:
        raise ValueError(f"`attempts` must be an int >= 1, got {attempts!r}")

    def logged() -> OpHashMode:
        module, run = make_run()
        with OpHashMode(module, keep_bytes=keep_bytes) as log:
            run()
        return log

    reference = logged()
    for attempt in range(1, attempts + 1):
        divergence = first_divergence(reference, logged())
        if divergence is not None:
            return divergence, attempt + 1
    return None, attempts + 1
