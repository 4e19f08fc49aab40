"""L1: one op (or any callable) N times on fixed inputs → bitwise verdict; the catalogue table.

Columns of the catalogue table:

* ``default`` — this process as it is.
* ``deterministic`` — ``torch.use_deterministic_algorithms(True)``; on CUDA in a fresh subprocess
  with ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (cuBLAS reads it when its handle is created). An op
  without a deterministic kernel shows ``raises``.
* ``launch_blocking`` — a fresh subprocess with ``CUDA_LAUNCH_BLOCKING=1`` (read at CUDA init): it
  serialises launches and, as the table shows, does **not** make atomic kernels reproducible.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch

from deepep_lightning.audit.catalogue import CATALOGUE, catalogue_names, size_of
from deepep_lightning.audit.op_hashes import locate
from deepep_lightning.audit.repeat import run_repeats
from deepep_lightning.audit.report import LevelResult, Status

__all__ = ["COLUMNS", "audit_callable", "audit_catalogue", "format_catalogue_table"]

COLUMNS = ("default", "deterministic", "launch_blocking")


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


def _run_column_here(names: Sequence[str], device: str, repeats: int, size: str, deterministic: bool) -> list[dict]:
    rows = []
    previous = torch.are_deterministic_algorithms_enabled()
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
            row["seconds_per_call"] = result.details.get("seconds_per_call")
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
        columns: any of :data:`COLUMNS`.
        device: default CUDA when available.
        repeats: calls per op and column.
        size: ``"large"`` (default on CUDA) or ``"small"`` (default on CPU).
        isolate: run ``deterministic`` in a subprocess (default: on CUDA). ``launch_blocking``
            always runs in one (and is ``n/a`` on CPU).
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
        elif column == "launch_blocking" or (column == "deterministic" and isolate):
            cells = _run_column_subprocess(column, names, device, repeats, size)
        else:
            cells = _run_column_here(names, device, repeats, size, deterministic=column == "deterministic")
        for cell in cells:
            rows[cell["op"]][column] = cell
    return {
        "device": device,
        "repeats": repeats,
        "size": size,
        "columns": list(columns),
        "rows": rows,
        "notes": {n: CATALOGUE[n].note for n in names},
    }


def _cell_text(cell: dict) -> str:
    status = cell.get("status")
    if status == "reproducible":
        return "yes"
    if status == "divergent":
        return f"NO ({cell['distinct_results']} distinct, max {cell['max_abs_diff']:.2g})"
    if cell.get("raises"):
        return "raises"
    return status if status == "n/a" else f"error: {str(cell.get('error'))[:40]}"


def format_catalogue_table(table: dict[str, Any]) -> str:
    """Markdown table: one row per op, one column per mode (``yes`` = bitwise reproducible)."""
    columns = table["columns"]
    lines = [
        f"L1 catalogue on {table['device']} ({table['repeats']} calls each, size {table['size']})",
        "",
        "| op | " + " | ".join(columns) + " | what |",
        "|---|" + "---|" * len(columns) + "---|",
    ]
    for name, cells in table["rows"].items():
        lines.append(
            f"| {name} | "
            + " | ".join(_cell_text(cells.get(c, {})) for c in columns)
            + f" | {table['notes'].get(name, '')} |"
        )
    return "\n".join(lines + ["", *catalogue_legend(columns, table["repeats"])])


#: What each column of the L1 table runs.
_COLUMN_MEANING = {
    "default": "PyTorch's defaults",
    "deterministic": "torch.use_deterministic_algorithms(True)",
    "launch_blocking": "CUDA_LAUNCH_BLOCKING=1, in a subprocess (serialises launches; does not fix atomics)",
}


def catalogue_legend(columns: Sequence[str], repeats: int) -> list[str]:
    """The lines under the L1 table: what its cells and its columns mean."""
    return [
        f"Legend: yes = {repeats} calls gave bitwise identical outputs; NO (k distinct, max d) = k different"
        " outputs, d the largest |difference| from the first; raises = PyTorch refuses the op in that mode"
        " (no deterministic kernel); n/a = not run here (e.g. a CUDA-only op on CPU); error: = it failed otherwise.",
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
        rows = _run_column_here(
            args.ops.split(","), args.device, args.repeats, args.size, deterministic=args.column == "deterministic"
        )
    except Exception:
        traceback.print_exc()
        return 2
    with open(args.out, "w", encoding="utf-8") as handle:
        json.dump(rows, handle)
    return 0


if __name__ == "__main__":
    sys.exit(_worker())
