"""Where the JIT build of the extension is cached, whether a load must compile, and the lines that say so.

The cache directory is ``$TORCH_EXTENSIONS_DIR/<name>`` when that variable is set (torch's own
layout). Otherwise it is ``<torch's default root>/deepep_lightning/<environment key>/<name>``, keyed by
the Python version, the torch version, the CUDA version and a hash of the interpreter's prefix and
torch's install path: torch's default (``~/.cache/torch_extensions/py311_cu130``) is shared by every
environment with the same Python and CUDA, whose different torch headers make each one recompile what
the other built.

A build that compiles prints one line before it starts and one when it is done, on rank 0 only,
through ``tqdm.write`` (which clears an active progress bar first and redraws it after): the first use
takes minutes, and a silent first run looks like a hang.
"""

from __future__ import annotations

import hashlib
import math
import os
import sys
import time
from pathlib import Path

import torch

from deepep_lightning.ops._build_config import newest_source_mtime

__all__ = ["BuildAnnouncement", "build_directory", "environment_key", "needs_compile"]

_PREFIX = "deepep_lightning: "
# core-seconds per translation unit on an idle x86 core (-O3; nvcc for sm_90 only): for the estimate
_CPP_CORE_SECONDS = 10.0
_CU_CORE_SECONDS = 60.0


def environment_key() -> str:
    """``py311_torch2.14.1_cu130_<hash>``: what a compiled library depends on, as a directory name."""
    if torch.version.hip is not None:
        accelerator = f"rocm{torch.version.hip.replace('.', '')}"
    elif torch.version.cuda is not None:
        accelerator = f"cu{torch.version.cuda.replace('.', '')}"
    else:
        accelerator = "cpu"
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    torch_version = torch.__version__.split("+")[0]
    where = os.pathsep.join(os.path.realpath(path) for path in (sys.prefix, os.path.dirname(torch.__file__)))
    interpreter = hashlib.sha256(where.encode()).hexdigest()[:10]
    return f"{python}_torch{torch_version}_{accelerator}_{interpreter}"


def build_directory(name: str) -> Path:
    """The directory the JIT build of ``name`` compiles into and loads from (created if missing)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        directory = Path(root) / name
    else:
        from torch.utils.cpp_extension import get_default_build_root

        directory = Path(get_default_build_root()) / "deepep_lightning" / environment_key() / name
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def needs_compile(directory: Path, name: str, sources_root: Path) -> bool:
    """Whether loading ``name`` from ``directory`` compiles: no library yet, or a source is newer."""
    library = directory / f"{name}.so"
    if not library.is_file():
        return True
    return newest_source_mtime(sources_root) > library.stat().st_mtime


def _is_rank_zero() -> bool:
    # Lightning's record of this process's rank: from the launcher's variables at import, set by
    # the strategy in processes it spawns.
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    return getattr(rank_zero_only, "rank", 0) == 0


def _write_line(line: str) -> None:
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm comes with Lightning
        print(line, file=sys.stderr, flush=True)
    else:
        tqdm.write(line, file=sys.stderr)


def _estimated_minutes(cpp_files: int, cu_files: int) -> int:
    jobs = os.environ.get("MAX_JOBS", "")  # ninja's parallelism, as torch passes it
    workers = int(jobs) if jobs.isdigit() and int(jobs) > 0 else (os.cpu_count() or 1)
    seconds = (cpp_files * _CPP_CORE_SECONDS + cu_files * _CU_CORE_SECONDS) / workers
    return max(1, math.ceil(seconds / 60))


class BuildAnnouncement:
    """The two lines around a compiling JIT build: :meth:`start` before it, :meth:`done` after it.

    Args:
        directory: the cache directory, named in the first line.
        sources: the translation units (``.cpp`` and ``.cu``), for the time estimate.

    Example::

        announcement = BuildAnnouncement(directory, sources)
        announcement.start()  # deepep_lightning: building the C++/CUDA extension (first use, about 2 min; ...)
        load(...)
        announcement.done()  # deepep_lightning: built the C++/CUDA extension in 95 s
    """

    def __init__(self, directory: Path, sources: list[str]) -> None:
        self.directory = directory
        self.cu_files = sum(1 for source in sources if source.endswith(".cu"))
        self.cpp_files = len(sources) - self.cu_files
        self._started_at: float | None = None

    def start(self) -> None:
        self._started_at = time.monotonic()
        if _is_rank_zero():
            minutes = _estimated_minutes(self.cpp_files, self.cu_files)
            kernels = "CPU and CUDA kernels" if self.cu_files else "CPU kernels"
            _write_line(
                f"{_PREFIX}building the C++/CUDA extension (first use, about {minutes} min, {kernels}; "
                f"cached in {self.directory})"
            )

    def done(self) -> None:
        if self._started_at is None:
            raise RuntimeError("BuildAnnouncement.done() called before start()")
        if _is_rank_zero():
            _write_line(f"{_PREFIX}built the C++/CUDA extension in {time.monotonic() - self._started_at:.0f} s")
