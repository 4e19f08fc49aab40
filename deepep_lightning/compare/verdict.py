"""Are two (or more) TensorBoard runs bitwise identical, and if not, where do they part?

Every run is compared with the first (the reference). Per scalar tag the verdict is *bitwise*: the
same steps and the same bit pattern of every stored value (float32 for TensorBoard scalars). So
``+0.0`` and ``-0.0`` differ, and a NaN equals a NaN only when their bits (payload, sign) agree
(quiet-NaN payloads survive TensorBoard's writer and reader; a signalling NaN is quieted when written).
``rtol`` never changes the verdict; it only reports the first step where ``|a - b| / max(|a|, |b|)``
exceeds it. A tag logged by only one run also makes the runs differ.

Tags that say nothing about the training are left out unless named with ``tags``
(:data:`DEFAULT_EXCLUDE`: Lightning's ``hp_metric`` placeholder and ``epoch`` counter, and ``perf/*``,
wall-clock figures such as DeepEP's ``perf/env_steps_per_s``, which differ between identical runs).

Exit codes of the CLI: 0 identical, 1 diverged, 2 error (missing run, no event file, empty or corrupt
event file, no scalar data, no tag in common).

JSON schema (``--json``; non-finite floats are written as the strings ``"nan"``, ``"inf"``, ``"-inf"``)::

    {"identical": bool, "rtol": float, "excluded": [str],
     "runs": [{"path": str, "root": str, "event_files": [str], "tags": int, "overwritten_points": int}],
     "comparisons": [{"reference": str, "other": str, "identical": bool,
                      "only_in_reference": [str], "only_in_other": [str],
                      "tags": {TAG: {"identical": bool, "steps_reference": int, "steps_other": int,
                                     "common_steps": int, "differing_points": int,
                                     "first_divergent_step": int|null,
                                     "reference_value": float|null, "other_value": float|null,
                                     "reference_bits": "0x…"|null, "other_bits": "0x…"|null,
                                     "max_abs_diff": float, "max_rel_diff": float,
                                     "first_step_rel_above_rtol": int|null}}}]}

Example::

    result = compare_runs(["logs/a/lightning_logs/version_0", "logs/b"])
    assert result.identical, result.format_table()
"""

from __future__ import annotations

import fnmatch
import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from deepep_lightning import _checks
from deepep_lightning.compare.reader import (
    EventFileError,
    RunScalars,
    ScalarSeries,
    read_run,
)

__all__ = ["DEFAULT_EXCLUDE", "CompareResult", "EventFileError", "PairComparison", "TagComparison", "compare_runs"]

DEFAULT_RTOL = 1e-6

#: Tag patterns (``fnmatch``) left out of a comparison unless named in ``tags``.
DEFAULT_EXCLUDE: tuple[str, ...] = ("hp_metric", "epoch", "perf/*")


@dataclass
class TagComparison:
    """One tag of one run against the reference; values at the first divergent step (None: absent)."""

    identical: bool
    steps_reference: int
    steps_other: int
    common_steps: int
    differing_points: int
    first_divergent_step: int | None = None
    reference_value: float | None = None
    other_value: float | None = None
    reference_bits: str | None = None
    other_bits: str | None = None
    max_abs_diff: float = 0.0
    max_rel_diff: float = 0.0
    first_step_rel_above_rtol: int | None = None


@dataclass
class PairComparison:
    """One run against the reference: per common tag, plus the tags only one of them logged."""

    reference: str
    other: str
    tags: dict[str, TagComparison]
    only_in_reference: list[str]
    only_in_other: list[str]

    @property
    def identical(self) -> bool:
        same_tags = not self.only_in_reference and not self.only_in_other
        return same_tags and all(t.identical for t in self.tags.values())


@dataclass
class CompareResult:
    """All runs against the first. ``identical`` is the overall verdict; ``to_dict()`` is the JSON."""

    rtol: float
    runs: list[RunScalars] = field(repr=False)
    comparisons: list[PairComparison]
    excluded: list[str] = field(default_factory=list)  # tags logged but left out (``exclude``)

    @property
    def identical(self) -> bool:
        return all(pair.identical for pair in self.comparisons)

    @property
    def compared_tags(self) -> set[str]:
        """Every tag compared in at least one pair."""
        return {tag for pair in self.comparisons for tag in pair.tags}

    @property
    def differing_tags(self) -> set[str]:
        """Every tag that differs in at least one pair."""
        return {tag for pair in self.comparisons for tag, verdict in pair.tags.items() if not verdict.identical}

    def to_dict(self) -> dict:
        runs = [
            {
                "path": r.path,
                "root": r.root,
                "event_files": r.event_files,
                "tags": len(r.series),
                "overwritten_points": r.overwritten_points,
            }
            for r in self.runs
        ]
        comparisons = [
            {
                "reference": p.reference,
                "other": p.other,
                "identical": p.identical,
                "only_in_reference": p.only_in_reference,
                "only_in_other": p.only_in_other,
                "tags": {tag: asdict(t) for tag, t in p.tags.items()},
            }
            for p in self.comparisons
        ]
        result = {
            "identical": self.identical,
            "rtol": self.rtol,
            "excluded": self.excluded,
            "runs": runs,
            "comparisons": comparisons,
        }
        return _json_safe(result)

    def format_table(self) -> str:
        """A human-readable report, one block per compared run."""
        reference = self.runs[0]
        files, tags = len(reference.event_files), len(reference.series)
        lines = [f"reference: {reference.path}  ({files} event file(s), {tags} tags)"]
        if self.excluded:
            lines.append(f"not compared (see --all-tags): {', '.join(self.excluded)}")
        header = ("tag", "verdict", "first diff step", "reference", "other") + (
            "max abs diff",
            "max rel diff",
            "rel>rtol step",
        )
        for pair in self.comparisons:
            differing = sum(not t.identical for t in pair.tags.values())
            verdict = "IDENTICAL" if pair.identical else "DIVERGED"
            counts = f"{differing} of {len(pair.tags)} common tags differ, rtol={self.rtol:g}"
            lines.append(f"\n{pair.other}: {verdict}  ({counts})")
            rows = [header]
            for tag, t in pair.tags.items():
                absent = "-" if t.identical else "(absent)"  # a step only one run logged
                rows.append(
                    (
                        tag,
                        "identical" if t.identical else "DIFFERS",
                        _cell(t.first_divergent_step),
                        _cell(t.reference_value, absent),
                        _cell(t.other_value, absent),
                        _cell(t.max_abs_diff),
                        _cell(t.max_rel_diff),
                        _cell(t.first_step_rel_above_rtol),
                    )
                )
            widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
            lines.extend("  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)
            if pair.only_in_reference:
                lines.append(f"  tags only in the reference: {', '.join(pair.only_in_reference)}")
            if pair.only_in_other:
                lines.append(f"  tags only in {pair.other}: {', '.join(pair.only_in_other)}")
        return "\n".join(lines)


def compare_runs(
    runs: Sequence[str | os.PathLike[str]],
    rtol: float = DEFAULT_RTOL,
    tags: Sequence[str] | None = None,
    exclude: Sequence[str] = DEFAULT_EXCLUDE,
) -> CompareResult:
    """Compare every run with the first, tag by tag, bitwise.

    Args:
        runs: two or more run directories, Lightning ``version_N`` directories or event files;
            how a directory is resolved is described in ``deepep_lightning.compare.reader``.
        rtol: report the first step whose relative difference exceeds this; does not affect the verdict.
        tags: compare only these tags (exact names; default: every scalar tag not excluded).
        exclude: ``fnmatch`` patterns of tags left out when ``tags`` is None (default
            :data:`DEFAULT_EXCLUDE`; ``()`` compares every tag).

    Raises:
        ValueError: fewer than two runs, a bad ``rtol``, a tag no run logged, an ambiguous run directory,
            or no tag in common.
        TypeError: ``tags`` or ``exclude`` is a single string.
        FileNotFoundError: a run does not exist or holds no event file.
        EventFileError: an event file is empty or corrupt, or a run holds no scalar data.
    """
    paths = [os.fspath(run) for run in runs]
    if len(paths) < 2:
        raise ValueError(f"`runs` must name at least two runs, got {paths!r}. HINT: the first is the reference.")
    _checks.number(None, "rtol", rtol, minimum=0, finite=True, error=ValueError)
    if isinstance(tags, str):
        raise TypeError(f"`tags` must be a list of tag names, got the string {tags!r}. HINT: [{tags!r}].")
    exclude = _checks.str_sequence(None, "exclude", exclude, error=TypeError)
    data = [read_run(path) for path in paths]
    excluded: set[str] = set()
    if tags is None:
        for run in data:
            left_out = {tag for tag in run.series if any(fnmatch.fnmatchcase(tag, p) for p in exclude)}
            excluded |= left_out
            run.series = {tag: series for tag, series in run.series.items() if tag not in left_out}
    if tags is not None:
        logged = set().union(*(run.series for run in data))
        unknown = sorted(set(tags) - logged)
        if unknown:
            raise ValueError(f"`tags` {unknown!r} were logged by no run; logged tags: {sorted(logged)!r}")
        for run in data:
            run.series = {tag: series for tag, series in run.series.items() if tag in set(tags)}
    comparisons = []
    for other in data[1:]:
        common = sorted(set(data[0].series) & set(other.series))
        if not common:
            raise ValueError(
                f"runs {data[0].path!r} and {other.path!r} share no scalar tag: "
                f"{sorted(data[0].series)!r} vs {sorted(other.series)!r}"
            )
        comparisons.append(
            PairComparison(
                reference=data[0].path,
                other=other.path,
                tags={tag: _compare_series(data[0].series[tag], other.series[tag], rtol) for tag in common},
                only_in_reference=sorted(set(data[0].series) - set(other.series)),
                only_in_other=sorted(set(other.series) - set(data[0].series)),
            )
        )
    return CompareResult(rtol=float(rtol), runs=data, comparisons=comparisons, excluded=sorted(excluded))


def _compare_series(reference: ScalarSeries, other: ScalarSeries, rtol: float) -> TagComparison:
    common, ref_index, other_index = np.intersect1d(reference.steps, other.steps, return_indices=True)
    a, b = reference.values[ref_index], other.values[other_index]
    if a.dtype != b.dtype:  # e.g. float32 against float64: compare after the exact widening
        a, b = a.astype(np.float64), b.astype(np.float64)
    differs = _bits(a) != _bits(b)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    both_finite = np.isfinite(a64) & np.isfinite(b64)
    with np.errstate(invalid="ignore", divide="ignore"):
        abs_diff = np.where(differs, np.where(both_finite, np.abs(a64 - b64), np.inf), 0.0)
        scale = np.maximum(np.abs(a64), np.abs(b64))
        rel_diff = np.where(abs_diff == 0, 0.0, np.where(both_finite, abs_diff / scale, np.inf))
    candidates = [int(s) for s in common[differs][:1]]
    candidates += [int(s) for s in np.setxor1d(reference.steps, other.steps)[:1]]
    result = TagComparison(
        identical=not candidates,
        steps_reference=len(reference.steps),
        steps_other=len(other.steps),
        common_steps=len(common),
        differing_points=int(differs.sum()),
        max_abs_diff=float(abs_diff.max(initial=0.0)),
        max_rel_diff=float(rel_diff.max(initial=0.0)),
    )
    above = common[rel_diff > rtol]
    result.first_step_rel_above_rtol = int(above[0]) if len(above) else None
    if candidates:
        step = min(candidates)
        result.first_divergent_step = step
        result.reference_value, result.reference_bits = _value_at(reference, step)
        result.other_value, result.other_bits = _value_at(other, step)
    return result


def _bits(values: np.ndarray) -> np.ndarray:
    return values.view(np.dtype(f"u{values.dtype.itemsize}"))


def _value_at(series: ScalarSeries, step: int):
    index = np.searchsorted(series.steps, step)
    if index == len(series.steps) or series.steps[index] != step:
        return None, None
    value = series.values[index : index + 1]
    return float(value[0]), f"0x{int(_bits(value)[0]):0{2 * value.dtype.itemsize}x}"


def _cell(value, missing: str = "-") -> str:
    if value is None:
        return missing
    return f"{value:.9g}" if isinstance(value, float) else str(value)


def _json_safe(obj):
    if isinstance(obj, float) and not math.isfinite(obj):
        return "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {key: _json_safe(value) for key, value in obj.items()}
    if isinstance(obj, list):
        return [_json_safe(value) for value in obj]
    return obj
