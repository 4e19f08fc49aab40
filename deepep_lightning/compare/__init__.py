"""Compare TensorBoard runs bitwise: :func:`compare_runs` and the ``deepep-compare`` command line."""

from deepep_lightning.compare.cli import ExitCode, main
from deepep_lightning.compare.plot import plot_comparison, write_tensorboard_layout
from deepep_lightning.compare.reader import EventFileError
from deepep_lightning.compare.verdict import CompareResult, PairComparison, TagComparison, compare_runs

__all__ = [
    "CompareResult",
    "EventFileError",
    "ExitCode",
    "PairComparison",
    "TagComparison",
    "compare_runs",
    "main",
    "plot_comparison",
    "write_tensorboard_layout",
]
