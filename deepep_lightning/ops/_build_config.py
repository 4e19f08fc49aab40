"""What the C++/CUDA extension is compiled from and with: one definition for both build paths.

The JIT build (:mod:`deepep_lightning.ops.extension_loader`, on first use) and the ahead-of-time build
(``setup.py`` with ``DEEPEP_LIGHTNING_BUILD_EXTENSION`` set, at install time) read the sources,
flags and names from here, so a compiled module and a JIT build of one checkout hold the same
kernels built the same way. This module imports nothing but the standard library: ``setup.py`` loads
it by path, before torch or the package can be imported.
"""

from __future__ import annotations

import os
from pathlib import Path

# "cpu": the C++ kernels only; "1": also the CUDA kernels when torch is a CUDA build and nvcc is
# found; "cuda": the CUDA kernels or a build error. Unset or "0": no compiled module (JIT on first use).
AOT_BUILD_ENV = "DEEPEP_LIGHTNING_BUILD_EXTENSION"
AOT_BUILD_MODES = ("0", "1", "cpu", "cuda")
# The ahead-of-time module: deepep_lightning/_C<EXTENSION_SUFFIX>, as extension-cpp names it.
COMPILED_MODULE = "_C"
# The JIT library; a CPU-only and a CUDA build of one checkout get distinct names in the cache.
JIT_NAME = "deepep_lightning_ext"

# -ffp-contract=off: no fused multiply-adds the reference does not do, so the C++ kernels match it.
CXX_FLAGS = ["-O3", "-ffp-contract=off"]
_SM90_FLAGS = ["-gencode=arch=compute_90,code=sm_90"]
SOURCE_PATTERNS = ("*.cpp", "*.h", "*.cu", "*.cuh")
# One library, two TORCH_LIBRARY namespaces: the plugin's kernels (``deepep_lightning::``, the refused ops)
# at the top of the sources, the DeepEP workload's (``deepep_lightning::``) in ``deepep/``. Each folder keeps its
# CUDA kernels in ``cuda/``; one build step compiles both.
SOURCE_FOLDERS = (".", "deepep")


def cuda_flags() -> list[str]:
    """nvcc flags: built for sm_90 unless ``TORCH_CUDA_ARCH_LIST`` is set, which torch then honours."""
    return ["-O3"] + ([] if os.environ.get("TORCH_CUDA_ARCH_LIST") else list(_SM90_FLAGS))


def source_files(root: Path, with_cuda: bool) -> list[Path]:
    """The translation units under ``root``: every ``*.cpp`` of each of :data:`SOURCE_FOLDERS`, and with
    ``with_cuda`` every ``*.cu`` of its ``cuda/``."""
    sources: list[Path] = []
    for folder in (root / name for name in SOURCE_FOLDERS):
        sources += sorted(folder.glob("*.cpp"))
        if with_cuda:
            sources += sorted((folder / "cuda").glob("*.cu"))
    return sources


def newest_source_mtime(root: Path) -> float:
    """The latest modification time of any source or header under ``root`` (0.0 when there is none)."""
    times = [path.stat().st_mtime for pattern in SOURCE_PATTERNS for path in root.rglob(pattern)]
    return max(times, default=0.0)
