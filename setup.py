"""Packaging for deepep_lightning.

The C++/CUDA extension in ``extensions/csrc`` is JIT-compiled on first use by
``deepep_lightning.ops`` (cached under ``TORCH_EXTENSIONS_DIR``), so installing
needs no compiler; an editable install keeps the sources beside the package.
"""

from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).parent
version = {}
exec((ROOT / "deepep_lightning" / "_version.py").read_text(), version)

setup(
    name="deepep_lightning",
    version=version["__version__"],
    description=(
        "Provably reproducible and NaN-survivable PyTorch Lightning training, "
        "with DeepEP (Deep Expected Policy gradient) as the reference workload."
    ),
    long_description=(ROOT / "README.md").read_text(encoding="utf-8") if (ROOT / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["deepep_lightning", "deepep_lightning.*"]),
    install_requires=[
        "torch>=2.4",
        "lightning>=2.4",
        "numpy>=1.24",
        "torchmetrics>=1.3",
        "tensorboard>=2.14",
        "jsonargparse[signatures]>=4.27",
        "matplotlib>=3.7",
    ],
    extras_require={
        "test": ["pytest>=7.4", "ninja", "ruff>=0.6", "mypy>=1.10"],
    },
    entry_points={
        "console_scripts": [
            "deepep-audit=deepep_lightning.audit.cli:main",
            "deepep-compare=deepep_lightning.compare.cli:main",
        ],
    },
)
