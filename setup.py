"""What ``pyproject.toml`` cannot say: the extension sources and configs as package data, and the
optional ahead-of-time build of the extension.

The C++/CUDA sources live at the top level (``extensions/csrc``) and the LightningCLI YAMLs in
``configs/``, outside the package, so an editable install and ``PYTHONPATH=$PWD`` use them in place.
A built package (``pip install .``, a wheel) gets copies: ``deepep_lightning/_csrc`` and
``deepep_lightning/configs``. By default ``deepep_lightning.ops`` JIT-compiles those sources on first
use (cached), so installing needs no compiler and no torch.

With ``DEEPEP_LIGHTNING_BUILD_EXTENSION`` set (as DeepSpeed's ``DS_BUILD_OPS``), the install compiles
them into ``deepep_lightning/_C*.so`` with :class:`torch.utils.cpp_extension.BuildExtension` and the
loader uses that module, so the machine that runs it needs no compiler: ``cpu`` builds the C++ kernels,
``1`` adds the CUDA kernels when torch is a CUDA build and nvcc is found, ``cuda`` requires them. The
build compiles against the torch it finds, so it runs without build isolation
(``pip install --no-build-isolation .``, ``pip wheel --no-build-isolation .``); the wheel it makes is
tied to that torch, Python and platform. Sources and flags come from
``deepep_lightning/ops/_build_config.py``, as for the JIT build.
"""

import importlib.util
import os
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
# (source in the checkout, destination inside the built package, the files to ship)
PACKAGE_DATA_TREES = [
    (ROOT / "extensions" / "csrc", Path("deepep_lightning") / "_csrc", ("*.cpp", "*.h", "*.cu", "*.cuh")),
    (ROOT / "configs", Path("deepep_lightning") / "configs", ("*.yaml",)),
]


class BuildPyWithSources(build_py):
    """``build_py`` that also copies the extension sources and configs into the built package."""

    def run(self) -> None:
        super().run()
        if self.editable_mode:  # the editable package reads the checkout's trees in place
            return
        for source, destination, patterns in PACKAGE_DATA_TREES:
            if not source.is_dir():
                raise FileNotFoundError(f"{str(source)!r} is missing: the package data is built from it")
            files = sorted(path for pattern in patterns for path in source.rglob(pattern))
            if not files:
                raise FileNotFoundError(f"no {' / '.join(patterns)} files under {str(source)!r}")
            for path in files:
                target = Path(self.build_lib) / destination / path.relative_to(source)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, target)


def _build_config():
    """``deepep_lightning/ops/_build_config.py``, loaded by path: the package itself needs torch to import."""
    path = ROOT / "deepep_lightning" / "ops" / "_build_config.py"
    spec = importlib.util.spec_from_file_location("_deepep_lightning_build_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compiled_extension() -> dict:
    """``setup()`` arguments for the ahead-of-time build: none unless the variable asks for it."""
    config = _build_config()
    mode = os.environ.get(config.AOT_BUILD_ENV, "0").strip().lower() or "0"
    if mode not in config.AOT_BUILD_MODES:
        raise SystemExit(f"{config.AOT_BUILD_ENV}={mode!r}: expected one of {', '.join(config.AOT_BUILD_MODES)}")
    if mode == "0":
        return {}
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
    except ImportError as err:
        raise SystemExit(
            f"{config.AOT_BUILD_ENV}={mode}: the ahead-of-time build compiles against the installed torch, which "
            f"this build cannot import ({err}). HINT: install torch first, then "
            "pip install --no-build-isolation ."
        ) from err
    nvcc = CUDA_HOME and Path(CUDA_HOME) / "bin" / "nvcc"
    with_cuda = bool(torch.version.cuda and nvcc and nvcc.exists()) and mode in ("1", "cuda")
    if mode == "cuda" and not with_cuda:
        raise SystemExit(
            f"{config.AOT_BUILD_ENV}=cuda: needs a CUDA build of torch (torch.version.cuda={torch.version.cuda!r}) "
            f"and nvcc (CUDA_HOME={CUDA_HOME!r}). HINT: {config.AOT_BUILD_ENV}=cpu builds the C++ kernels only."
        )
    sources = [str(path.relative_to(ROOT)) for path in config.source_files(ROOT / "extensions" / "csrc", with_cuda)]
    extension = (CUDAExtension if with_cuda else CppExtension)(
        name=f"deepep_lightning.{config.COMPILED_MODULE}",
        sources=sources,
        include_dirs=[str(ROOT / "extensions" / "csrc")],
        # -g0: Python's default -g makes the build slower and the module 2.5x larger, for no use here
        extra_compile_args={"cxx": [*config.CXX_FLAGS, "-g0"], "nvcc": config.cuda_flags()},
    )
    return {"ext_modules": [extension], "cmdclass": {"build_ext": BuildExtension}}


aot = compiled_extension()
setup(**{**aot, "cmdclass": {"build_py": BuildPyWithSources, **aot.get("cmdclass", {})}})
