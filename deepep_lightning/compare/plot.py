"""The PNG of ``deepep-compare --plot``: curves overlaid and their difference on a log scale."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from deepep_lightning.compare.reader import write_custom_scalars_layout

if TYPE_CHECKING:
    from deepep_lightning.compare.verdict import CompareResult

__all__ = ["plot_comparison", "verdict_title", "write_tensorboard_layout"]


def plot_comparison(result: "CompareResult", path: str, max_tags: int = 16) -> list[str]:
    """Save a PNG: per tag, the curves overlaid (left) and ``|run - reference|`` on a log scale (right).

    Args:
        result: what :func:`compare_runs` returned.
        path: the PNG to write.
        max_tags: draw at most this many tags, the differing ones first.

    Returns:
        The tags drawn. A dotted line marks each run's first divergent step; the figure's title is the
        verdict (``IDENTICAL`` or ``DIVERGED``: how many tags differ, the earliest divergent step).
        Tags the comparison left out (``hp_metric``, ``epoch``, ``perf/*`` by default) get no row.
    """
    from matplotlib.figure import Figure  # no pyplot: leaves the caller's backend and figures alone

    differing = result.differing_tags
    tags = sorted(result.compared_tags, key=lambda tag: (tag not in differing, tag))[:max_tags]
    figure = Figure(figsize=(12, 2.6 * len(tags)))
    axes = figure.subplots(len(tags), 2, squeeze=False, sharex="row")
    reference = result.runs[0]
    for (curves, diffs), tag in zip(axes, tags):
        ref = reference.series[tag]
        curves.plot(ref.steps, ref.values.astype(np.float64), lw=1.2, label=f"{reference.path} (reference)")
        for index, (pair, run) in enumerate(zip(result.comparisons, result.runs[1:])):
            if tag not in pair.tags:
                continue
            color, series, verdict = f"C{index + 1}", run.series[tag], pair.tags[tag]
            curves.plot(series.steps, series.values.astype(np.float64), "--", c=color, lw=1, label=run.path)
            common, i, j = np.intersect1d(ref.steps, series.steps, return_indices=True)
            with np.errstate(invalid="ignore"):
                gap = np.abs(series.values[j].astype(np.float64) - ref.values[i].astype(np.float64))
            shown = np.isfinite(gap) & (gap > 0)  # zeros cannot be drawn on a log scale
            if shown.any():
                diffs.semilogy(common[shown], gap[shown], ".", color=color, ms=3)
            if verdict.first_divergent_step is not None:
                for axis in (curves, diffs):
                    axis.axvline(verdict.first_divergent_step, color=color, ls=":", lw=1)
                label = f"first divergence: step {verdict.first_divergent_step}"
                position = (0.01, 0.9 - 0.1 * index)
                diffs.annotate(label, position, xycoords="axes fraction", color=color, fontsize=8)
        if tag not in differing:
            diffs.text(0.5, 0.5, "bitwise identical", ha="center", va="center", transform=diffs.transAxes)
            diffs.set_yticks([])
        curves.set_title(tag, fontsize=9)
        diffs.set_title(f"|run - reference| of {tag} (log scale)", fontsize=9)
        curves.legend(fontsize=7)
    for axis in axes[-1]:
        axis.set_xlabel("step")
    figure.suptitle(verdict_title(result), fontsize=11, color="C2" if result.identical else "C3")
    figure.tight_layout()
    figure.savefig(path, dpi=80)  # Agg canvas
    return tags


def verdict_title(result: "CompareResult") -> str:
    """The PNG's title: ``IDENTICAL: 5 tags bitwise equal in 2 runs`` or ``DIVERGED: 2 of 5 tags, first at step 37``."""
    runs, compared, differing = len(result.runs), len(result.compared_tags), result.differing_tags
    if result.identical:
        return f"IDENTICAL: {compared} tags bitwise equal in {runs} runs"
    steps = [
        verdict.first_divergent_step
        for pair in result.comparisons
        for verdict in pair.tags.values()
        if verdict.first_divergent_step is not None
    ]
    where = f", first at step {min(steps)}" if steps else ""
    only = sorted({tag for pair in result.comparisons for tag in pair.only_in_reference + pair.only_in_other})
    missing = f"; logged by one run only: {', '.join(only[:3])}" if only else ""
    return f"DIVERGED: {len(differing)} of {compared} tags differ{where}{missing}"


def write_tensorboard_layout(result: "CompareResult", logdir: str) -> str:
    """Write a custom-scalars layout into ``logdir``: one chart per compared tag, differing tags first.

    Launch ``tensorboard --logdir_spec ref:RUN_A,other:RUN_B,layout:LOGDIR`` and open "Custom Scalars"
    to see the runs overlaid per tag. Returns the event file written.
    """
    differing = result.differing_tags
    groups = {
        "deepep-compare: differing": sorted(differing),
        "deepep-compare: identical": sorted(result.compared_tags - differing),
    }
    return write_custom_scalars_layout(logdir, groups)
