"""The zoo's results at a glance: the summary in ``zoo.json`` and the Markdown table for BENCHMARKS.md.

Targets (issue: the model zoo as the bar): every model bitwise under the plugin; determinism tax median
<= 1.05x and worst <= 1.25x over the models that were timed. The tax times the steps (``on_train_batch_start``
to ``on_train_batch_end``); the iteration tax, where the runs recorded it, times step end to step end, which
adds the loader's fetch and Lightning's work between steps. Beside the taxes the summary gives the kernel
ratio: the device time of the kernels of a profiled step, plugin over plain, which says how much of a tax is
the GPU's work and how much the host's.
"""

from __future__ import annotations

import statistics
from typing import Any

__all__ = ["TARGET_TAX_MEDIAN", "TARGET_TAX_WORST", "kernel_ratio", "markdown_table", "summarise"]

TARGET_TAX_MEDIAN = 1.05
TARGET_TAX_WORST = 1.25


def kernel_ratio(record: dict[str, Any]) -> float | None:
    """Kernel time per profiled step, plugin over plain (``None`` without kernel rows)."""
    totals = (record.get("attribution") or {}).get("kernels_total_ms") or {}
    plain, plugin = totals.get("plain"), totals.get("plugin")
    return round(plugin / plain, 4) if plain and plugin is not None else None


def summarise(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Verdict counts, the tax median and worst (and the kernel ratio's), and whether each target is met."""
    counts: dict[str, dict[str, int]] = {"plugin": {}, "trainer_deterministic": {}, "plain": {}}
    for record in results.values():
        for key, tally in counts.items():
            outcome = (record.get(key) or {}).get("verdict")
            if outcome:
                tally[outcome] = tally.get(outcome, 0) + 1
    taxes = {name: record["tax"]["tax"] for name, record in results.items() if "tax" in record}
    iterations = {
        name: record["tax"]["iteration_tax"]
        for name, record in results.items()
        if "iteration_tax" in record.get("tax", {})
    }
    kernels = {name: ratio for name, record in results.items() if (ratio := kernel_ratio(record)) is not None}
    judged = sum(counts["plugin"].values())
    summary: dict[str, Any] = {
        "models": len(results),
        "skipped": sorted(name for name, record in results.items() if "skipped" in record),
        "verdicts": counts,
        "plugin_bitwise_fraction": round(counts["plugin"].get("bitwise", 0) / judged, 4) if judged else None,
        "timed": len(taxes),
        "tax_median": round(statistics.median(taxes.values()), 4) if taxes else None,
        "tax_worst": max(taxes.items(), key=lambda item: item[1]) if taxes else None,
        "iteration_tax_median": round(statistics.median(iterations.values()), 4) if iterations else None,
        "iteration_tax_worst": max(iterations.items(), key=lambda item: item[1]) if iterations else None,
        "kernel_ratio_median": round(statistics.median(kernels.values()), 4) if kernels else None,
        "kernel_ratio_worst": max(kernels.items(), key=lambda item: item[1]) if kernels else None,
        "targets": {"plugin_bitwise": 1.0, "tax_median": TARGET_TAX_MEDIAN, "tax_worst": TARGET_TAX_WORST},
    }
    summary["met"] = {
        "plugin_bitwise": bool(judged) and counts["plugin"].get("bitwise", 0) == judged,
        "tax_median": bool(taxes) and summary["tax_median"] <= TARGET_TAX_MEDIAN,
        "tax_worst": bool(taxes) and summary["tax_worst"][1] <= TARGET_TAX_WORST,
    }
    return summary


def _verdict(record: dict[str, Any], key: str) -> str:
    entry = record.get(key)
    if not entry:
        return ""
    if entry["verdict"] == "bitwise":
        return "bitwise"
    return f"{entry['verdict']}: {entry['detail'][:80]}".replace("|", "/")


def _grown(record: dict[str, Any]) -> str:
    """The two kernels (ops where no kernel rows) and the host event whose time per step grew most."""
    attribution = record.get("attribution") or {}
    shown = []
    for table in ("kernels", "ops"):
        rows = attribution.get(table) or []
        if rows:
            shown = [f"`{row['name'][:60]}` +{row['grown_ms']:.2f}" for row in rows[:2]]
            break
    host = attribution.get("host") or []
    if host:
        shown.append(f"host `{host[0]['name'][:40]}` +{host[0]['grown_ms']:.2f}")
    return "; ".join(shown).replace("|", "/")


def markdown_table(results: dict[str, dict[str, Any]]) -> str:
    """One row per model: verdicts, medians side by side, tax (per alternation), kernel time per profiled step
    (plain -> plugin), what grew most (ms/step)."""
    lines = [
        "| model | precision | plugin | `Trainer(deterministic=True)` | plain | plain ms | plugin ms"
        " | tax (per alternation) | kernels ms (ratio) | grew most (ms/step) | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, record in results.items():
        if "skipped" in record or "driver_error" in record:
            lines.append(
                f"| {name} | {record.get('precision', '')} | {record.get('skipped') or record['driver_error']} ||||||||"
            )
            continue
        timing = record.get("tax")
        if timing:
            each = ", ".join(f"{row['tax']:.2f}" for row in timing["alternations"])
            whole = f"; iteration {timing['iteration_tax']:.2f}" if "iteration_tax" in timing else ""
            times = (
                f"{timing['plain_median_ms']:.2f} | {timing['plugin_median_ms']:.2f}"
                f" | **{timing['tax']:.2f}** ({each}{whole})"
            )
        else:
            times = f" | | {record.get('tax_note', '')}"
        verdicts = " | ".join(_verdict(record, key) for key in ("plugin", "trainer_deterministic", "plain"))
        ratio = kernel_ratio(record)
        totals = (record.get("attribution") or {}).get("kernels_total_ms") or {}
        kernel = f"{totals['plain']:.1f} → {totals['plugin']:.1f} ({ratio:.2f})" if ratio is not None else ""
        lines.append(
            f"| {name} | {record['precision']} | {verdicts} | {times} | {kernel} | {_grown(record)}"
            f" | {record.get('wall_s', '')} |"
        )
    return "\n".join(lines) + "\n"
