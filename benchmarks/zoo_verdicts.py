"""What the zoo's worker reports add up to: the bitwise verdict, the determinism tax and its attribution.

Pure functions over the worker's JSON reports (``zoo_worker.py``), so the driver only launches processes and
writes files:

* :func:`verdict`: ``bitwise`` (every report has the same losses and ``state_dict`` digest as the first),
  ``differs`` (naming the first loss step and the first tensor that differ) or ``raises`` (the error's first
  line, and the whole error with its last frames; a process that died without a report counts as raising,
  with its exit code).
* :func:`tax`: plugin median / plain median per alternation and over all timed steps of all alternations.
* :func:`attribution`: the kernels (and aten ops) whose device time per step grew most from plain to plugin,
  each profile averaged over the alternations.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

__all__ = ["attribution", "tax", "verdict"]


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")[:300]


def verdict(reports: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The verdict of runs that should be bitwise equal: ``{"verdict": ..., "detail": ...}``.

    Raises:
        ValueError: fewer than two reports.
    """
    if len(reports) < 2:
        raise ValueError(f"reports must hold at least two runs to compare, got {len(reports)!r}")
    for report in reports:
        if "error" in report:
            error = report["error"]
            detail = f"{error['type']}: {_first_line(error['message'])}"
            return {"verdict": "raises", "detail": detail, "error": error}  # with its last frames, where known
    first = reports[0]
    for other in reports[1:]:
        notes = []
        losses_a, losses_b = first["losses"], other["losses"]
        step = next((index for index, (a, b) in enumerate(zip(losses_a, losses_b)) if a != b), None)
        if step is not None:
            notes.append(f"loss at step {step}: {float.fromhex(losses_a[step])!r} vs {float.fromhex(losses_b[step])!r}")
        elif len(losses_a) != len(losses_b):
            notes.append(f"{len(losses_a)} vs {len(losses_b)} losses")
        if first["digest"] != other["digest"]:
            tensors_b = other["tensor_digests"]
            names = [name for name, digest in first["tensor_digests"].items() if tensors_b.get(name) != digest]
            notes.append(f"{len(names)} tensors, first {names[0]!r}" if names else "state_dict digest")
        if notes:
            return {"verdict": "differs", "detail": "; ".join(notes)}
    return {"verdict": "bitwise", "detail": f"{len(reports)} runs, {len(first['losses'])} steps"}


def _timed(report: dict[str, Any], warmup: int, steps: int) -> list[float]:
    return report["step_ms"][warmup : warmup + steps]


def _timed_iterations(report: dict[str, Any], warmup: int, steps: int) -> list[float]:
    # iteration_ms[i] ends with step i + 1: the timed steps' iterations (the first step has none)
    first = max(warmup - 1, 0)
    return report["iteration_ms"][first : warmup - 1 + steps]


def tax(pairs: Sequence[tuple[dict[str, Any], dict[str, Any]]], warmup: int, steps: int) -> dict[str, Any]:
    """Plugin / plain step time from ``(plain, plugin)`` report pairs, one pair per alternation."""
    alternations = []
    for plain, plugin in pairs:
        alternations.append(
            {
                "plain_median_ms": plain["median_ms"],
                "plugin_median_ms": plugin["median_ms"],
                "tax": plugin["median_ms"] / plain["median_ms"],
            }
        )
    plain_ms = statistics.median(value for plain, _ in pairs for value in _timed(plain, warmup, steps))
    plugin_ms = statistics.median(value for _, plugin in pairs for value in _timed(plugin, warmup, steps))
    result = {
        "plain_median_ms": round(plain_ms, 4),
        "plugin_median_ms": round(plugin_ms, 4),
        "tax": round(plugin_ms / plain_ms, 4),
        "alternations": [{key: round(value, 4) for key, value in row.items()} for row in alternations],
    }
    if all(report.get("iteration_ms") for pair in pairs for report in pair):
        # the whole iteration, step end to step end: also the loader's fetch and Lightning's work between steps
        plain_it = statistics.median(value for plain, _ in pairs for value in _timed_iterations(plain, warmup, steps))
        plugin_it = statistics.median(
            value for _, plugin in pairs for value in _timed_iterations(plugin, warmup, steps)
        )
        result["plain_iteration_ms"] = round(plain_it, 4)
        result["plugin_iteration_ms"] = round(plugin_it, 4)
        result["iteration_tax"] = round(plugin_it / plain_it, 4)
    return result


def _mean_profile(reports: Sequence[dict[str, Any]], table: str) -> dict[str, float]:
    total: dict[str, float] = {}
    for report in reports:
        for row in report.get("profile", {}).get(table, []):
            total[row["name"]] = total.get(row["name"], 0.0) + row["ms"] / len(reports)
    return total


def attribution(
    plain_reports: Sequence[dict[str, Any]], plugin_reports: Sequence[dict[str, Any]], top: int = 8
) -> dict[str, Any]:
    """The ``top`` kernels, ops and host events whose time per step grew most from plain to plugin (ms per step,
    both sides), with the kernel and host totals.

    A name in only one run's table counts as 0 ms in the other (tables keep each run's top entries, so a small
    entry may be missing from one side).
    """
    result: dict[str, Any] = {}
    for table in ("kernels", "ops", "host"):
        plain, plugin = _mean_profile(plain_reports, table), _mean_profile(plugin_reports, table)
        rows = [
            {
                "name": name,
                "plain_ms": round(plain.get(name, 0.0), 4),
                "plugin_ms": round(plugin.get(name, 0.0), 4),
                "grown_ms": round(plugin.get(name, 0.0) - plain.get(name, 0.0), 4),
            }
            for name in plain.keys() | plugin.keys()
        ]
        rows.sort(key=lambda row: -row["grown_ms"])
        result[table] = [row for row in rows[:top] if row["grown_ms"] > 0]
        if table != "ops":  # op times are inclusive on a GPU (nested ops count twice): no total
            result[f"{table}_total_ms"] = {
                "plain": round(sum(plain.values()), 4),
                "plugin": round(sum(plugin.values()), 4),
            }
    return result
