"""Audit results: one :class:`LevelResult` per check, an :class:`AuditReport` with text, JSON and exit code."""

from __future__ import annotations

import dataclasses
import json
import platform
from typing import Any

import torch

from deepep_lightning._enums import StrEnum

__all__ = ["EXIT_COULD_NOT_RUN", "EXIT_DIVERGENT", "EXIT_REPRODUCIBLE", "AuditReport", "LevelResult", "Status"]

EXIT_REPRODUCIBLE = 0
EXIT_DIVERGENT = 1
EXIT_COULD_NOT_RUN = 2


class Status(StrEnum):
    """The verdict of one check (written as its string in JSON reports)."""

    REPRODUCIBLE = "reproducible"
    DIVERGENT = "divergent"
    ERROR = "error"  # could not run


_STATUSES = tuple(status.value for status in Status)


@dataclasses.dataclass
class LevelResult:
    """The verdict of one audit check (an L1 op, an L2 step, an L3 sequence, an L4 pair of runs).

    Attributes:
        level: ``"L1"`` … ``"L4"``.
        target: what was audited (op name, module class, config).
        status: ``"reproducible"``, ``"divergent"`` or ``"error"`` (could not run).
        repeats: repeats compared (L4: runs).
        distinct_results: different results among the repeats.
        max_abs_diff: largest |difference| from the first repeat.
        differing: names of differing tensors/scalars (truncated).
        divergence: the first divergent op (``Divergence.to_dict()``) when the locator found one.
        seconds: wall time of the check.
        error: why it could not run.
        details: anything level-specific (e.g. L4 tables, deterministic-mode notes).
    """

    level: str
    target: str
    status: Status
    repeats: int = 0
    distinct_results: int = 0
    max_abs_diff: float | None = None
    differing: list[str] = dataclasses.field(default_factory=list)
    divergence: dict[str, Any] | None = None
    seconds: float = 0.0
    error: str | None = None
    details: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.status not in _STATUSES:
            raise ValueError(f"`status` must be one of {_STATUSES}, got {self.status!r}")
        self.status = Status(self.status)

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "status": self.status.value}

    def describe(self) -> str:
        head = f"[{self.level}] {self.target}: {self.status.upper()}"
        if self.status == Status.ERROR:
            return f"{head} — {self.error}"
        head += f" ({self.repeats} repeats, {self.distinct_results} distinct result(s)"
        if self.status == Status.DIVERGENT:
            head += f", max |diff| {self.max_abs_diff:.6g}" if self.max_abs_diff is not None else ""
        head += f", {self.seconds:.2f} s)"
        lines = [head]
        if self.differing:
            shown = ", ".join(self.differing[:8]) + (" …" if len(self.differing) > 8 else "")
            lines.append(f"  differing: {shown}")
        if self.divergence:
            lines.append(_describe_divergence(self.divergence))
        elif self.status == Status.DIVERGENT and "locator" in self.details:
            lines.append(f"  locator: {self.details['locator']}")
        for key in ("table", "note"):
            if key in self.details:
                lines.append("  " + str(self.details[key]).replace("\n", "\n  "))
        return "\n".join(lines)


def _describe_divergence(d: dict) -> str:
    diff = "n/a" if d.get("max_abs_diff") is None else f"{d['max_abs_diff']:.6g}"
    outputs = ", ".join(f"{t}{s}" for t, s in zip(d.get("output_dtypes", []), d.get("output_shapes", [])))
    lines = [
        f"  first divergent op: {d['op']} ({d['phase']}, op #{d['index']} of {d.get('ops_compared', '?')})",
        f"    module: {d.get('module_path') or '(outside any module)'}"
        + (f"; autograd node: {d['autograd_node']}" if d.get("autograd_node") else ""),
        *([f"    called in forward at: {d['forward_caller']}"] if d.get("forward_caller") else []),
        f"    outputs: {outputs}; max |diff| {diff}; inputs identical: {d.get('inputs_identical')}",
        f"    likely cause: {d['cause']} — {d['explanation']}",
    ]
    lines += [f"    at {frame}" for frame in d.get("stack", [])]
    return "\n".join(lines)


@dataclasses.dataclass
class AuditReport:
    """All checks of one ``deepep-audit`` invocation."""

    results: list[LevelResult] = dataclasses.field(default_factory=list)
    environment: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.environment:
            self.environment = environment_summary()

    @property
    def exit_code(self) -> int:
        """0: all reproducible; 1: some divergence (even if another check errored); 2: nothing could be decided."""
        statuses = {r.status for r in self.results}
        if Status.DIVERGENT in statuses:
            return EXIT_DIVERGENT
        if not self.results or Status.ERROR in statuses:
            return EXIT_COULD_NOT_RUN
        return EXIT_REPRODUCIBLE

    def to_dict(self) -> dict[str, Any]:
        return {
            "exit_code": self.exit_code,
            "environment": self.environment,
            "results": [r.to_dict() for r in self.results],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=str)

    def format_text(self) -> str:
        verdict = {
            EXIT_REPRODUCIBLE: "REPRODUCIBLE",
            EXIT_DIVERGENT: "DIVERGENCE FOUND",
            EXIT_COULD_NOT_RUN: "COULD NOT RUN",
        }[self.exit_code]
        env = self.environment
        lines = [f"deepep-audit: {verdict}  (torch {env.get('torch')}, {env.get('device')})"]
        lines += [r.describe() for r in self.results]
        return "\n".join(lines)


def environment_summary() -> dict[str, Any]:
    """torch version, device name, deterministic flags: the scope a verdict holds for."""
    device = "cpu"
    if torch.cuda.is_available():
        try:
            device = torch.cuda.get_device_name(0)
        except Exception:  # pragma: no cover - a broken driver still allows a CPU audit
            device = "cuda (name unavailable)"
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": device,
        "cuda": torch.version.cuda,
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
    }
