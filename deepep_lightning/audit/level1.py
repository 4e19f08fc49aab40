"""L1: one op (or any callable) N times on fixed inputs → bitwise verdict; the catalogue table.

Columns of the catalogue table, each a verdict over N calls and the time per call:

* ``default`` — PyTorch's defaults (deterministic mode off, the plugin's routing off), and the time
  per call.
* ``deterministic`` — PyTorch's own ``torch.use_deterministic_algorithms(True)``; on CUDA in a fresh
  subprocess with ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (cuBLAS reads it when its handle is created). An
  op without a deterministic kernel shows ``raises``; where it runs, its time as a ratio to ``default``
  shows what PyTorch's deterministic path costs.
* ``plugin`` — deterministic mode with the plugin's kernels for refused ops
  (:func:`deepep_lightning.ops.patch_refused_ops`, which ``DeterminismCallback`` turns on); isolated
  like ``deterministic``. An op the plugin routes (``CatalogueEntry.routed``) runs its deterministic
  kernel here; any other op reports what ``deterministic`` reports.
* ``launch_blocking`` — a fresh subprocess with ``CUDA_LAUNCH_BLOCKING=1`` (read at CUDA init): it
  serialises launches and, as the table shows, does **not** make atomic kernels reproducible.

Each cell records the mode it ran in (``deterministic_mode``, ``routing``) and which of the op's routed
aten ops had their kernel overridden during it (``routed_ops``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import torch

from deepep_lightning.audit.catalogue import CATALOGUE, catalogue_names, size_of
from deepep_lightning.audit.op_hashes import locate
from deepep_lightning.audit.repeat import run_repeats
from deepep_lightning.audit.report import LevelResult, Status

__all__ = ["COLUMNS", "audit_callable", "audit_catalogue", "format_catalogue_table"]

COLUMNS = ("default", "deterministic", "plugin", "launch_blocking")
#: Per column: (torch.use_deterministic_algorithms, the plugin's dispatcher routing of refused ops).
_COLUMN_MODES = {
    "default": (False, False),
    "deterministic": (True, False),
    "plugin": (True, True),
    "launch_blocking": (False, False),
}
#: Columns that run in a fresh subprocess when ``isolate`` (launch_blocking always does, on CUDA).
_ISOLATED = ("deterministic", "plugin")
#: Calls timed per cell (after the N calls of the verdict, so warm), synchronised; the median is kept.
_TIMED_CALLS = 5


def audit_callable(
    fn: Callable[[], Any], repeats: int = 100, name: str | None = None, locate_ops: bool = False
) -> LevelResult:
    """L1 on any zero-argument callable (bind fixed random inputs first: never zeros).

    Args:
        fn: the computation; returns a tensor or a nested structure of tensors.
        repeats: calls compared bitwise with the first (default 100).
        name: label in the report.
        locate_ops: on a difference, name the first divergent op inside ``fn`` (op-hash locator).

    Example::

        x, idx = torch.randn(10**6, device="cuda"), torch.randint(0, 100, (10**6,), device="cuda")
        audit_callable(lambda: torch.zeros(100, device="cuda").index_add_(0, idx, x)).status  # 'divergent'
    """
    label = cast(str, name or getattr(fn, "__name__", repr(fn)))
    start = time.perf_counter()
    try:
        stats = run_repeats(fn, repeats=repeats)
    except RuntimeError as error:
        if "deterministic" in str(error):
            return LevelResult(
                "L1",
                label,
                Status.ERROR,
                seconds=time.perf_counter() - start,
                error=f"raises: {str(error).splitlines()[0]}",
                details={"raises": True},
            )
        return LevelResult(
            "L1", label, Status.ERROR, seconds=time.perf_counter() - start, error=f"RuntimeError: {error}"
        )
    except Exception as error:
        return LevelResult(
            "L1", label, Status.ERROR, seconds=time.perf_counter() - start, error=f"{type(error).__name__}: {error}"
        )
    result = LevelResult(
        "L1",
        label,
        Status.REPRODUCIBLE if stats.reproducible else Status.DIVERGENT,
        repeats=stats.repeats,
        distinct_results=stats.distinct_results,
        max_abs_diff=stats.max_abs_diff,
        differing=stats.differing,
        seconds=stats.seconds,
        details={"seconds_per_call": stats.seconds / stats.repeats},
    )
    if locate_ops and not stats.reproducible:
        divergence, runs = locate(lambda: (None, fn))
        if divergence is not None:
            result.divergence = divergence.to_dict()
        else:
            result.details["locator"] = f"{runs} logged runs were all identical (the difference is rare)"
    return result


@contextlib.contextmanager
def _routing(enabled: bool) -> Iterator[None]:
    """The plugin's dispatcher routing of refused ops on or off inside, the previous state after."""
    from deepep_lightning.ops.routing import refused_ops_routing

    with refused_ops_routing(enabled):
        yield


def _synchronize(device: str) -> None:
    if device.startswith("cuda") and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _seconds_per_call(fn: Callable[[], Any], device: str, calls: int = _TIMED_CALLS) -> float:
    """Median seconds of ``calls`` synchronised calls of ``fn`` (without the verdict's hashing)."""
    times = []
    for _ in range(calls):
        _synchronize(device)
        start = time.perf_counter()
        fn()
        _synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _run_column_here(names: Sequence[str], device: str, repeats: int, size: str, column: str) -> list[dict]:
    """One column in this process: each op's verdict, time per call and the mode it ran in."""
    from deepep_lightning.ops._routes import installed_ops, routes_enabled

    deterministic, routing = _COLUMN_MODES[column]
    rows = []
    previous = torch.are_deterministic_algorithms_enabled()
    with _routing(routing):
        torch.use_deterministic_algorithms(deterministic)
        try:
            for name in names:
                entry = CATALOGUE[name]
                if entry.cuda_only and not device.startswith("cuda"):
                    rows.append({"op": name, "status": "n/a", "error": "CUDA only"})
                    continue
                generator = torch.Generator().manual_seed(1234)
                try:
                    fn = entry.build(torch.device(device), size_of(size), generator)
                except Exception as error:
                    rows.append({"op": name, "status": "error", "error": f"{type(error).__name__}: {error}"})
                    continue
                result = audit_callable(fn, repeats=repeats, name=name)
                row = {
                    "op": name,
                    **{k: result.to_dict()[k] for k in ("status", "distinct_results", "max_abs_diff", "error")},
                }
                row["raises"] = bool(result.details.get("raises"))
                row["seconds_per_call"] = _seconds_per_call(fn, device) if result.status != Status.ERROR else None
                row["deterministic_mode"] = torch.are_deterministic_algorithms_enabled()
                row["routing"] = routes_enabled()
                # overridden at this device's dispatch key (patch_refused_ops installs at CUDA: none on CPU)
                key = torch.device(device).type.upper()
                row["routed_ops"] = [op for op in entry.routed if installed_ops().get(op) == key]
                rows.append(row)
        finally:
            torch.use_deterministic_algorithms(previous)
    return rows


def _run_column_subprocess(column: str, names: Sequence[str], device: str, repeats: int, size: str) -> list[dict]:
    env = dict(os.environ)
    if column == "launch_blocking":
        env["CUDA_LAUNCH_BLOCKING"] = "1"
    else:
        env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    # the worker imports this package from where this process found it (a checkout need not be installed)
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), package_root) if p)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "column.json")
        command = [
            sys.executable,
            "-m",
            "deepep_lightning.audit.level1",
            "--column",
            column,
            "--device",
            device,
            "--repeats",
            str(repeats),
            "--size",
            size,
            "--ops",
            ",".join(names),
            "--out",
            out,
        ]
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if done.returncode != 0 or not os.path.exists(out):
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            return [
                {"op": n, "status": "error", "error": f"{column} subprocess failed: {' | '.join(tail)}"} for n in names
            ]
        with open(out, encoding="utf-8") as handle:
            return json.load(handle)


def audit_catalogue(
    ops: Sequence[str] | None = None,
    columns: Sequence[str] = COLUMNS,
    device: str | None = None,
    repeats: int = 100,
    size: str | None = None,
    isolate: bool | None = None,
) -> dict[str, Any]:
    """Run the catalogue: ``{"device", "repeats", "size", "columns", "rows": {op: {column: cell}}}``.

    Args:
        ops: catalogue names (default: all, see :func:`~deepep_lightning.audit.catalogue.catalogue_names`).
        columns: any of :data:`COLUMNS`: ``default``, ``deterministic`` (PyTorch's deterministic
            mode), ``plugin`` (deterministic mode with ``patch_refused_ops(True)``), ``launch_blocking``.
        device: default CUDA when available.
        repeats: calls per op and column.
        size: ``"large"`` (default on CUDA) or ``"small"`` (default on CPU).
        isolate: run ``deterministic`` and ``plugin`` each in a subprocess (default: on CUDA).
            ``launch_blocking`` always runs in one (and is ``n/a`` on CPU).

    Raises:
        ValueError: an unknown op or column.

    Example::

        table = audit_catalogue(["index_add_", "cross_entropy_4d"], device="cuda", repeats=20)
        table["rows"]["cross_entropy_4d"]["plugin"]["status"]  # 'reproducible' (deterministic: raises)
    """
    names = list(ops) if ops else catalogue_names()
    unknown = [n for n in names if n not in CATALOGUE]
    if unknown:
        raise ValueError(f"`ops` {unknown!r} are not in the catalogue; known: {catalogue_names()}")
    bad = [c for c in columns if c not in COLUMNS]
    if bad:
        raise ValueError(f"`columns` {bad!r} are unknown; allowed: {list(COLUMNS)}")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    size = size or ("large" if device.startswith("cuda") else "small")
    isolate = device.startswith("cuda") if isolate is None else isolate
    rows: dict[str, dict[str, Any]] = {n: {} for n in names}
    for column in columns:
        if column == "launch_blocking" and not device.startswith("cuda"):
            cells = [{"op": n, "status": "n/a", "error": "CPU: nothing to serialise"} for n in names]
        elif column == "launch_blocking" or (column in _ISOLATED and isolate):
            cells = _run_column_subprocess(column, names, device, repeats, size)
        else:
            cells = _run_column_here(names, device, repeats, size, column)
        for cell in cells:
            rows[cell["op"]][column] = cell
    return {
        "device": device,
        "repeats": repeats,
        "size": size,
        "columns": list(columns),
        "rows": rows,
        "notes": {n: CATALOGUE[n].note for n in names},
        "routed": {n: list(CATALOGUE[n].routed) for n in names},
    }


def _verdict_text(cell: dict) -> str:
    status = cell.get("status")
    if status == "reproducible":
        return "yes"
    if status == "divergent":
        return f"NO ({cell['distinct_results']} distinct, max {cell['max_abs_diff']:.2g})"
    if cell.get("raises"):
        return "raises"
    return status if status == "n/a" else f"error: {str(cell.get('error'))[:40]}"


def _cell_text(cell: dict, baseline: float | None = None) -> str:
    """The verdict and the time: ``yes 0.12 ms`` (``default``), ``yes 1.05x`` (ratio to ``baseline``)."""
    text = _verdict_text(cell)
    seconds = cell.get("seconds_per_call")
    if seconds is None or cell.get("status") not in ("reproducible", "divergent"):
        return text
    if baseline:
        ratio = seconds / baseline
        return f"{text} {ratio:.2f}x" if ratio >= 0.1 else f"{text} {ratio:.2g}x"
    return f"{text} {seconds * 1e3:.3g} ms"


def format_catalogue_table(table: dict[str, Any]) -> str:
    """Markdown table: one row per op, one column per mode (``yes`` = bitwise reproducible), with times.

    ``default`` cells give the time per call; the other columns give theirs as a ratio to ``default``
    (when ``default`` ran), so the cost of a deterministic path is visible beside its verdict.
    """
    columns = table["columns"]
    routed = table.get("routed", {})
    lines = [
        f"L1 catalogue on {table['device']} ({table['repeats']} calls each, size {table['size']})",
        "",
        "| op | " + " | ".join(columns) + " | what |",
        "|---|" + "---|" * len(columns) + "---|",
    ]
    for name, cells in table["rows"].items():
        default = cells.get("default", {})
        baseline = default.get("seconds_per_call") if default.get("status") in ("reproducible", "divergent") else None
        texts = [_cell_text(cells.get(c, {}), None if c == "default" else baseline) for c in columns]
        what = table["notes"].get(name, "")
        if routed.get(name):
            what += f" [plugin routes {', '.join(routed[name])}]"
        lines.append(f"| {name} | " + " | ".join(texts) + f" | {what} |")
    return "\n".join(lines + ["", *catalogue_legend(columns, table["repeats"])])


#: What each column of the L1 table runs.
_COLUMN_MEANING = {
    "default": "PyTorch's defaults (time per call)",
    "deterministic": "torch.use_deterministic_algorithms(True), PyTorch's own kernels",
    "plugin": "deterministic mode with deepep_lightning's kernels for refused ops (patch_refused_ops(True),"
    " as DeterminismCallback sets it)",
    "launch_blocking": "CUDA_LAUNCH_BLOCKING=1, in a subprocess (serialises launches; does not fix atomics)",
}


def catalogue_legend(columns: Sequence[str], repeats: int) -> list[str]:
    """The lines under the L1 table: what its cells and its columns mean."""
    return [
        f"Legend: yes = {repeats} calls gave bitwise identical outputs; NO (k distinct, max d) = k different"
        " outputs, d the largest |difference| from the first; raises = PyTorch refuses the op in that mode"
        " (no deterministic kernel); n/a = not run here (e.g. a CUDA-only op on CPU); error: = it failed otherwise."
        " Times: the median of 5 synchronised calls; outside `default`, as a ratio to it (1.50x = 50% slower).",
        "Columns: " + "; ".join(f"{c} = {_COLUMN_MEANING.get(c, c)}" for c in columns) + ".",
    ]


def _worker(argv: Sequence[str] | None = None) -> int:
    """Subprocess entry point for one column (set the environment before CUDA starts)."""
    parser = argparse.ArgumentParser(description="one column of the L1 catalogue (internal)")
    parser.add_argument("--column", choices=COLUMNS, required=True)
    parser.add_argument("--device", required=True)
    parser.add_argument("--repeats", type=int, required=True)
    parser.add_argument("--size", required=True)
    parser.add_argument("--ops", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    try:
        rows = _run_column_here(args.ops.split(","), args.device, args.repeats, args.size, args.column)
    except Exception:
        traceback.print_exc()
        return 2
    with open(args.out, "w", encoding="utf-8") as handle:
        json.dump(rows, handle)
    return 0


if __name__ == "__main__":
    sys.exit(_worker())
