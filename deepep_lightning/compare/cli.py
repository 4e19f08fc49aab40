"""``deepep-compare``: the command line of :func:`~deepep_lightning.compare.compare_runs`.

Exit codes: 0 identical, 1 diverged, 2 error (missing run, no event file, empty or corrupt event file,
no scalar data, no tag in common).
"""

import argparse
import json
import math
import sys
from collections.abc import Sequence
from enum import IntEnum

from deepep_lightning.compare.plot import plot_comparison, write_tensorboard_layout
from deepep_lightning.compare.reader import EventFileError
from deepep_lightning.compare.verdict import DEFAULT_EXCLUDE, DEFAULT_RTOL, compare_runs

__all__ = ["ExitCode", "main"]


class ExitCode(IntEnum):
    """What the exit status of ``deepep-compare`` means."""

    IDENTICAL = 0
    DIVERGED = 1
    ERROR = 2  # missing run, no or damaged event file, no scalar data, no tag in common


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
the same bits). --rtol only reports where the relative difference first exceeds it. Not compared unless
named with --tag (or --all-tags): hp_metric, epoch and perf/* (wall-clock figures such as DeepEP's
perf/env_steps_per_s, which differ between identical runs).

--json PATH writes the result as JSON to PATH and prints the table; --json - prints the JSON on stdout
instead of the table (the same convention as deepep-audit).
Exit codes: 0 identical, 1 diverged, 2 error (missing run, no/empty/corrupt event file, no common tag).
"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="deepep-compare",
        description="Compare the scalar curves of TensorBoard runs bitwise, every run against the first.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "runs", nargs="+", metavar="RUN", help="run directory or event file; the first is the reference"
    )
    parser.add_argument(
        "--rtol",
        type=_parse_rtol,
        default=DEFAULT_RTOL,
        help=f"report the first step whose relative difference exceeds this (default {DEFAULT_RTOL:g})",
    )
    parser.add_argument(
        "--tag",
        action="append",
        dest="tags",
        metavar="TAG",
        help="compare only this tag; repeat for several (default: every scalar tag)",
    )
    parser.add_argument(
        "--exclude",
        action="append",
        metavar="PATTERN",
        help="also leave out tags matching this fnmatch pattern; repeat for several"
        f" (always left out: {', '.join(DEFAULT_EXCLUDE)})",
    )
    parser.add_argument("--all-tags", action="store_true", help="compare every tag, hp_metric, epoch and perf/* too")
    parser.add_argument("--json", metavar="PATH", help="write the result as JSON to PATH ('-': stdout, no table)")
    parser.add_argument("--plot", metavar="PNG", help="save the curves and their log-scale difference to PNG")
    parser.add_argument("--tb-layout", metavar="DIR", help="write a TensorBoard custom-scalars layout into DIR")
    return parser


def main(argv: Sequence[str] | None = None) -> ExitCode:
    """Console entry point ``deepep-compare``; returns the :class:`ExitCode` (0 identical, 1 diverged, 2 error).

    Every failure of the tool itself (unreadable runs, an unwritable ``--json``/``--plot`` path, a
    missing plotting library, an unexpected exception) is 2: 1 means only that the runs diverged.
    """
    args = _parser().parse_args(argv)
    try:
        exclude = () if args.all_tags else (*DEFAULT_EXCLUDE, *(args.exclude or ()))
        result = compare_runs(args.runs, rtol=args.rtol, tags=args.tags, exclude=exclude)
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
    except (OSError, ValueError, EventFileError) as error:
        print(f"deepep-compare: error: {error}", file=sys.stderr)
        return ExitCode.ERROR
    except Exception as error:  # the tool's own failure, never "diverged"
        print(f"deepep-compare: error: {type(error).__name__}: {error}", file=sys.stderr)
        return ExitCode.ERROR
    return ExitCode.IDENTICAL if result.identical else ExitCode.DIVERGED
