"""Shared timing helpers for the GPU benchmarks: medians of CUDA-event-timed repeats after warm-up."""

from __future__ import annotations

import json
import platform
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

__all__ = ["environment", "median_ms", "write_json"]


def median_ms(fn: Callable[[], Any], repeats: int, warmup: int = 2) -> tuple[float, list[float]]:
    """Median wall time of ``fn`` in milliseconds (CUDA events on GPU, perf_counter on CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            import time

            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), times


def environment() -> dict[str, Any]:
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
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"environment": environment(), **payload}, indent=2))
    print(f"wrote {path}")
