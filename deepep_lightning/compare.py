"""``deepep-compare``: are two (or more) TensorBoard runs bitwise identical, and if not, where do they part?

Every run is compared with the first (the reference). Per scalar tag the verdict is *bitwise*: the
same steps and the same bit pattern of every stored value (float32 for TensorBoard scalars). So
``+0.0`` and ``-0.0`` differ, and a NaN equals a NaN only when their bits (payload, sign) agree
(quiet-NaN payloads survive TensorBoard's writer and reader; a signalling NaN is quieted when written).
``rtol`` never changes the verdict; it only reports the first step where ``|a - b| / max(|a|, |b|)``
exceeds it. A tag logged by only one run also makes the runs differ.

Exit codes of the CLI: 0 identical, 1 diverged, 2 error (missing run, no event file, empty or corrupt
event file, no scalar data, no tag in common).

JSON schema (``--json``; non-finite floats are written as the strings ``"nan"``, ``"inf"``, ``"-inf"``)::

    {"identical": bool, "rtol": float,
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

import argparse
import json
import math
import os
import sys
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence, Union

import numpy as np

from deepep_lightning._compare_plot import _compared_tags, _differing_tags, plot_comparison
from deepep_lightning._tb_reader import (
    EventFileError,
    RunScalars,
    ScalarSeries,
    read_run,
    write_custom_scalars_layout,
)

__all__ = [
    "CompareResult",
    "EventFileError",
    "PairComparison",
    "TagComparison",
    "compare_runs",
    "main",
    "plot_comparison",
    "write_tensorboard_layout",
]

DEFAULT_RTOL = 1e-6


@dataclass
class TagComparison:
    """One tag of one run against the reference; values at the first divergent step (None: absent)."""

    identical: bool
    steps_reference: int
    steps_other: int
    common_steps: int
    differing_points: int
    first_divergent_step: Optional[int] = None
    reference_value: Optional[float] = None
    other_value: Optional[float] = None
    reference_bits: Optional[str] = None
    other_bits: Optional[str] = None
    max_abs_diff: float = 0.0
    max_rel_diff: float = 0.0
    first_step_rel_above_rtol: Optional[int] = None


@dataclass
class PairComparison:
    """One run against the reference: per common tag, plus the tags only one of them logged."""

    reference: str
    other: str
    tags: Dict[str, TagComparison]
    only_in_reference: List[str]
    only_in_other: List[str]

    @property
    def identical(self) -> bool:
        same_tags = not self.only_in_reference and not self.only_in_other
        return same_tags and all(t.identical for t in self.tags.values())


@dataclass
class CompareResult:
    """All runs against the first. ``identical`` is the overall verdict; ``to_dict()`` is the JSON."""

    rtol: float
    runs: List[RunScalars] = field(repr=False)
    comparisons: List[PairComparison]

    @property
    def identical(self) -> bool:
        return all(pair.identical for pair in self.comparisons)

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
        result = {"identical": self.identical, "rtol": self.rtol, "runs": runs, "comparisons": comparisons}
        return _json_safe(result)

    def format_table(self) -> str:
        """A human-readable report, one block per compared run."""
        reference = self.runs[0]
        files, tags = len(reference.event_files), len(reference.series)
        lines = [f"reference: {reference.path}  ({files} event file(s), {tags} tags)"]
        header = ("tag", "verdict", "first diff step", "reference", "other") + (
            "max abs diff", "max rel diff", "rel>rtol step")
        for pair in self.comparisons:
            differing = sum(not t.identical for t in pair.tags.values())
            verdict = "IDENTICAL" if pair.identical else "DIVERGED"
            counts = f"{differing} of {len(pair.tags)} common tags differ, rtol={self.rtol:g}"
            lines.append(f"\n{pair.other}: {verdict}  ({counts})")
            rows = [header]
            for tag, t in pair.tags.items():
                absent = "-" if t.identical else "(absent)"  # a step only one run logged
                rows.append((
                    tag,
                    "identical" if t.identical else "DIFFERS",
                    _cell(t.first_divergent_step),
                    _cell(t.reference_value, absent),
                    _cell(t.other_value, absent),
                    _cell(t.max_abs_diff),
                    _cell(t.max_rel_diff),
                    _cell(t.first_step_rel_above_rtol),
                ))
            widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
            lines.extend("  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)
            if pair.only_in_reference:
                lines.append(f"  tags only in the reference: {', '.join(pair.only_in_reference)}")
            if pair.only_in_other:
                lines.append(f"  tags only in {pair.other}: {', '.join(pair.only_in_other)}")
        return "\n".join(lines)


def compare_runs(
    runs: Sequence[Union[str, "os.PathLike[str]"]],
    rtol: float = DEFAULT_RTOL,
    tags: Optional[Sequence[str]] = None,
) -> CompareResult:
    """Compare every run with the first, tag by tag, bitwise.

    Args:
        runs: two or more run directories, Lightning ``version_N`` directories or event files;
            how a directory is resolved is described in ``deepep_lightning._tb_reader``.
        rtol: report the first step whose relative difference exceeds this; does not affect the verdict.
        tags: compare only these tags (exact names; default: every scalar tag).

    Raises:
        ValueError: fewer than two runs, a bad ``rtol``, a tag no run logged, an ambiguous run directory,
            or no tag in common.
        TypeError: ``tags`` is a single string.
        FileNotFoundError: a run does not exist or holds no event file.
        EventFileError: an event file is empty or corrupt, or a run holds no scalar data.
    """
    paths = [os.fspath(run) for run in runs]
    if len(paths) < 2:
        raise ValueError(
            f"`runs` must name at least two runs, got {paths!r}. HINT: the first is the reference."
        )
    if isinstance(rtol, bool) or not isinstance(rtol, (int, float)) or not math.isfinite(rtol) or rtol < 0:
        raise ValueError(f"`rtol` must be a finite number >= 0, got {rtol!r}.")
    if isinstance(tags, str):
        raise TypeError(f"`tags` must be a list of tag names, got the string {tags!r}. HINT: [{tags!r}].")
    data = [read_run(path) for path in paths]
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
    return CompareResult(rtol=float(rtol), runs=data, comparisons=comparisons)


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
        identical=not candidates, steps_reference=len(reference.steps), steps_other=len(other.steps),
        common_steps=len(common), differing_points=int(differs.sum()),
        max_abs_diff=float(abs_diff.max(initial=0.0)), max_rel_diff=float(rel_diff.max(initial=0.0)),
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


def write_tensorboard_layout(result: CompareResult, logdir: str) -> str:
    """Write a custom-scalars layout into ``logdir``: one chart per compared tag, differing tags first.

    Launch ``tensorboard --logdir_spec ref:RUN_A,other:RUN_B,layout:LOGDIR`` and open "Custom Scalars"
    to see the runs overlaid per tag. Returns the event file written.
    """
    differing = _differing_tags(result)
    groups = {
        "deepep-compare: differing": sorted(differing),
        "deepep-compare: identical": sorted(_compared_tags(result) - differing),
    }
    return write_custom_scalars_layout(logdir, groups)


def _parse_rtol(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"--rtol must be a finite number >= 0, got {text!r}")
    return value


_EPILOG = """\
How a RUN is read: an event file is read alone. A directory is searched recursively for '*tfevents*'
files; if they lie in several Lightning version_N directories the run is ambiguous (exit 2: pass one
version_N). Tags of files in sub-directories of the run get the sub-directory as prefix ('grp_a/grp').
Several files in one directory are merged in file-name order; a step written twice keeps the later value.

Verdict: identical = same tags, same steps, same float32 bit patterns (+0 != -0; NaN == NaN only with
the same bits). --rtol only reports where the relative difference first exceeds it.
Exit codes: 0 identical, 1 diverged, 2 error (missing run, no/empty/corrupt event file, no common tag).
"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="deepep-compare",
        description="Compare the scalar curves of TensorBoard runs bitwise, every run against the first.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("runs", nargs="+", metavar="RUN", help="run directory or event file; the first is the reference")
    parser.add_argument(
        "--rtol", type=_parse_rtol, default=DEFAULT_RTOL,
        help=f"report the first step whose relative difference exceeds this (default {DEFAULT_RTOL:g})",
    )
    parser.add_argument(
        "--tag", action="append", dest="tags", metavar="TAG",
        help="compare only this tag; repeat for several (default: every scalar tag)",
    )
    parser.add_argument("--json", metavar="PATH", help="write the result as JSON to PATH ('-': stdout, no table)")
    parser.add_argument("--plot", metavar="PNG", help="save the curves and their log-scale difference to PNG")
    parser.add_argument("--tb-layout", metavar="DIR", help="write a TensorBoard custom-scalars layout into DIR")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Console entry point ``deepep-compare``; returns the exit code (0 identical, 1 diverged, 2 error)."""
    args = _parser().parse_args(argv)
    try:
        result = compare_runs(args.runs, rtol=args.rtol, tags=args.tags)
    except (OSError, ValueError, EventFileError) as error:
        print(f"deepep-compare: error: {error}", file=sys.stderr)
        return 2
    if args.json == "-":
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(result.format_table())
        if args.json:
            with open(args.json, "w", encoding="utf-8") as handle:
                json.dump(result.to_dict(), handle, indent=2)
    if args.plot:
        drawn = plot_comparison(result, args.plot)
        print(f"plot of {len(drawn)} tag(s) written to {args.plot}", file=sys.stderr)
    if args.tb_layout:
        layout_file = write_tensorboard_layout(result, args.tb_layout)
        print(f"TensorBoard layout written to {layout_file}", file=sys.stderr)
    return 0 if result.identical else 1


if __name__ == "__main__":
    sys.exit(main())
