"""What ``pyproject.toml`` cannot say: the extension sources and configs as package data.

The C++/CUDA sources live at the top level (``extensions/csrc``) and the LightningCLI YAMLs in
``configs/``, outside the package, so an editable install and ``PYTHONPATH=$PWD`` use them in place.
A built package (``pip install .``, a wheel) gets copies: ``deepep_lightning/_csrc`` and
``deepep_lightning/configs``. ``deepep_lightning.ops`` JIT-compiles the sources on first use (cached
under ``TORCH_EXTENSIONS_DIR``), so installing needs no compiler.
"""

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


setup(cmdclass={"build_py": BuildPyWithSources})
