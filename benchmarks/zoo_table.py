"""The zoo's results at a glance: the summary in ``zoo.json`` and the Markdown table for BENCHMARKS.md.

Targets (issue: the model zoo as the bar): every model bitwise under the plugin; determinism tax median
<= 1.05x and worst <= 1.25x over the models that were timed.
"""

from __future__ import annotations

import statistics
from typing import Any

__all__ = ["TARGET_TAX_MEDIAN", "TARGET_TAX_WORST", "markdown_table", "summarise"]

TARGET_TAX_MEDIAN = 1.05
TARGET_TAX_WORST = 1.25


def summarise(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Verdict counts, the tax median and worst, and whether each target is met."""
    counts: dict[str, dict[str, int]] = {"plugin": {}, "trainer_deterministic": {}, "plain": {}}
    for record in results.values():
        for key, tally in counts.items():
            outcome = (record.get(key) or {}).get("verdict")
            if outcome:
                tally[outcome] = tally.get(outcome, 0) + 1
    taxes = {name: record["tax"]["tax"] for name, record in results.items() if "tax" in record}
    judged = sum(counts["plugin"].values())
    summary: dict[str, Any] = {
        "models": len(results),
        "skipped": sorted(name for name, record in results.items() if "skipped" in record),
        "verdicts": counts,
        "plugin_bitwise_fraction": round(counts["plugin"].get("bitwise", 0) / judged, 4) if judged else None,
        "timed": len(taxes),
        "tax_median": round(statistics.median(taxes.values()), 4) if taxes else None,
        "tax_worst": max(taxes.items(), key=lambda item: item[1]) if taxes else None,
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
    """One row per model: verdicts, medians side by side, tax (per alternation), what grew most (ms/step)."""
    lines = [
        "| model | precision | plugin | `Trainer(deterministic=True)` | plain | plain ms | plugin ms"
        " | tax (per alternation) | grew most (ms/step) | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, record in results.items():
        if "skipped" in record or "driver_error" in record:
            lines.append(
                f"| {name} | {record.get('precision', '')} | {record.get('skipped') or record['driver_error']} |||||||"
            )
            continue
        timing = record.get("tax")
        if timing:
            each = ", ".join(f"{row['tax']:.2f}" for row in timing["alternations"])
            times = (
                f"{timing['plain_median_ms']:.2f} | {timing['plugin_median_ms']:.2f} | **{timing['tax']:.2f}** ({each})"
            )
        else:
            times = f" | | {record.get('tax_note', '')}"
        verdicts = " | ".join(_verdict(record, key) for key in ("plugin", "trainer_deterministic", "plain"))
        lines.append(
            f"| {name} | {record['precision']} | {verdicts} | {times} | {_grown(record)} | {record.get('wall_s', '')} |"
        )
    return "\n".join(lines) + "\n"
