"""The one timer of the GPU benchmarks: CUDA events on a GPU, ``perf_counter`` on CPU; medians after warm-up.

CUDA events time the GPU's timeline: ``stop()`` records an event behind everything queued since ``start()``
and waits for it, so the figure includes the kernels a call launched, not only the host's dispatch. Import it
from a benchmark run as a script (``benchmarks/`` is then on ``sys.path``)::

    from _timing import median_ms

    median, samples = median_ms(step, repeats=10)  # milliseconds
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

__all__ = ["Stopwatch", "elapsed_ms", "environment", "median_ms", "peak_extra_mib", "sample_ms", "write_json"]


def _uses_cuda(device: torch.device | str | None) -> bool:
    if device is None:
        return torch.cuda.is_available()
    return torch.device(device).type == "cuda"


class Stopwatch:
    """Milliseconds from ``start()`` to ``stop()``, for a window that is not one function call (a Lightning hook).

    Args:
        device: where the timed work runs; ``None`` means CUDA when it is available. On a CUDA device the two
            ends are CUDA events on the current stream, otherwise ``time.perf_counter``.
    """

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.cuda = _uses_cuda(device)
        self._begin: Any = None

    def start(self) -> None:
        if self.cuda:
            self._begin = torch.cuda.Event(enable_timing=True)
            self._begin.record()
        else:
            self._begin = time.perf_counter()

    def stop(self) -> float:
        """Waits for the work queued since ``start()`` and returns the elapsed milliseconds.

        Raises:
            RuntimeError: when ``start()`` has not been called.
        """
        if self._begin is None:
            raise RuntimeError("Stopwatch.stop() called before start()")
        begin, self._begin = self._begin, None
        if not self.cuda:
            return (time.perf_counter() - begin) * 1e3
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        end.synchronize()
        return begin.elapsed_time(end)


def elapsed_ms(fn: Callable[[], Any], device: torch.device | str | None = None) -> float:
    """Milliseconds of one call of ``fn``, with the kernels it queued (see :class:`Stopwatch`)."""
    watch = Stopwatch(device)
    watch.start()
    fn()
    return watch.stop()


def sample_ms(
    fn: Callable[[], Any], repeats: int, warmup: int = 2, device: torch.device | str | None = None
) -> list[float]:
    """Milliseconds of each of ``repeats`` calls of ``fn`` after ``warmup`` untimed calls.

    Raises:
        ValueError: when ``repeats`` is below 1 or ``warmup`` is negative.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats!r}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup!r}")
    for _ in range(warmup):
        fn()
    return [elapsed_ms(fn, device) for _ in range(repeats)]


def median_ms(
    fn: Callable[[], Any], repeats: int, warmup: int = 2, device: torch.device | str | None = None
) -> tuple[float, list[float]]:
    """Median milliseconds of ``repeats`` calls after warm-up, and the samples (see :func:`sample_ms`)."""
    samples = sample_ms(fn, repeats, warmup, device)
    return statistics.median(samples), samples


def peak_extra_mib(fn: Callable[[], Any], device: torch.device | str | None = None) -> float | None:
    """MiB of device memory one call of ``fn`` held at its peak beyond what was allocated before it, its output
    included; ``None`` off CUDA."""
    if not _uses_cuda(device):
        return None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del out
    return peak / 2**20


def environment() -> dict[str, Any]:
    """The stack a result was measured on: torch, Python, CUDA, GPU, cuDNN, Lightning."""
    info = {"torch": torch.__version__, "python": platform.python_version(), "cuda": torch.version.cuda}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_count"] = torch.cuda.device_count()
        info["cudnn"] = torch.backends.cudnn.version()
    try:
        import lightning

        info["lightning"] = lightning.__version__
    except ImportError:
        pass
    return info


def write_json(path: str | Path, payload: dict[str, Any]) -> None:
    """Writes ``payload`` with the :func:`environment` to ``path`` (parent folders created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"environment": environment(), **payload}, indent=2))
    print(f"wrote {path}")
