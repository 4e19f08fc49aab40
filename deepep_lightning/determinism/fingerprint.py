"""The software/hardware stack a run depends on for bitwise reproducibility, and how two differ.

Bitwise equality is promised only on the same stack (another PyTorch, CUDA, cuDNN, driver or GPU
may pick other kernels or reduction orders): the fingerprint records that stack in every checkpoint
and in TensorBoard, and a resume compares it field by field.

The node layout (``num_nodes``, ``node_layout``, and ``gpu_count``, the GPUs one machine shows) is
recorded but not compared: the world size is, and a resume on another layout of the same world
size is the strategy's to judge (``DeterministicDDPStrategy.check_resume``), since seeds, shards and
per-rank state follow the global rank and its ordered gradient sum does not depend on the layout.
"""

from __future__ import annotations

import functools
import os
import platform
import subprocess
from collections.abc import Mapping

import torch

__all__ = ["DETERMINISM_ENV_VARS", "collect_fingerprint", "describe_layout", "diff_fingerprints", "format_fingerprint"]

#: Environment variables that change numerics or kernel choice; all recorded in the fingerprint.
DETERMINISM_ENV_VARS = (
    "CUBLAS_WORKSPACE_CONFIG",
    "CUBLASLT_WORKSPACE_SIZE",
    "PYTHONHASHSEED",
    "CUDA_LAUNCH_BLOCKING",
    "NCCL_ALGO",
    "NCCL_PROTO",
    "NCCL_NVLS_ENABLE",
    "NCCL_MIN_NCHANNELS",
    "NCCL_MAX_NCHANNELS",
    "TORCH_CUBLASLT_UNIFIED_WORKSPACE",
    "NVIDIA_TF32_OVERRIDE",
)

#: Fields that may differ between two runs on the same stack, or between node layouts of one world size.
_VOLATILE_FIELDS = frozenset({"hostname", "gpu_count", "num_nodes", "node_layout"})


def describe_layout(num_nodes: int, processes_per_node: int) -> str:
    """``"2 nodes x 2 processes"``: a world size as laid out over machines."""
    nodes = f"{num_nodes} node" + ("s" if num_nodes != 1 else "")
    processes = f"{processes_per_node} process" + ("es" if processes_per_node != 1 else "")
    return f"{nodes} x {processes}"


@functools.lru_cache(maxsize=1)
def _driver_version() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return "none"
    lines = out.stdout.strip().splitlines()
    return lines[0].strip() if out.returncode == 0 and lines else "none"


def collect_fingerprint(world_size: int = 1, num_nodes: int = 1) -> dict[str, str]:
    """Describe the stack: versions, GPUs, driver, determinism flags and env vars, world size, node layout.

    Values are strings so the record is plain, stable and ``weights_only``-loadable. Reading the
    GPU name initialises CUDA when a GPU is present: call it after :func:`configure`.

    Args:
        world_size: number of processes of the run (``trainer.world_size``).
        num_nodes: number of machines they run on (``trainer.num_nodes``); ``node_layout`` reads
            ``"2 nodes x 2 processes"``.

    Raises:
        ValueError: ``world_size`` or ``num_nodes`` is not a positive integer, or ``num_nodes``
            does not divide ``world_size``.

    Example::

        collect_fingerprint(trainer.world_size, trainer.num_nodes)["node_layout"]
    """
    for name, value in (("world_size", world_size), ("num_nodes", num_nodes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"`{name}` must be a positive integer, got {value!r}")
    if world_size % num_nodes:
        raise ValueError(
            f"`num_nodes` must divide `world_size` (every node runs as many processes), got num_nodes={num_nodes!r}"
            f" and world_size={world_size!r}"
        )

    from deepep_lightning._version import __version__

    try:
        import lightning

        lightning_version = lightning.__version__
    except ImportError:  # pragma: no cover - lightning is a hard dependency of the callback
        lightning_version = "none"
    cuda = torch.cuda.is_available()
    nccl = "none"
    if cuda and hasattr(torch.cuda, "nccl"):
        try:
            nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
        except (RuntimeError, AttributeError):
            nccl = "none"
    gpu_count = torch.cuda.device_count() if cuda else 0
    record = {
        "deepep_lightning": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": lightning_version,
        "cuda": str(torch.version.cuda),
        "cudnn": str(torch.backends.cudnn.version()) if torch.backends.cudnn.is_available() else "none",
        "nccl": nccl,
        "gpu_name": torch.cuda.get_device_name(0) if gpu_count else "none",
        "gpu_count": str(gpu_count),
        "driver": _driver_version() if cuda else "none",
        "world_size": str(int(world_size)),
        "num_nodes": str(int(num_nodes)),
        "node_layout": describe_layout(num_nodes, world_size // num_nodes),
        "deterministic_algorithms": str(torch.are_deterministic_algorithms_enabled()),
        "deterministic_warn_only": str(torch.is_deterministic_algorithms_warn_only_enabled()),
        "fill_uninitialized_memory": str(bool(torch.utils.deterministic.fill_uninitialized_memory)),  # type: ignore[attr-defined]
        "cudnn_deterministic": str(torch.backends.cudnn.deterministic),
        "cudnn_benchmark": str(torch.backends.cudnn.benchmark),
        "matmul_precision": torch.get_float32_matmul_precision(),
        "hostname": platform.node(),
    }
    from deepep_lightning.determinism.configuration import last_configure_record

    configured = last_configure_record()
    configured_env = configured.env if configured is not None else {}
    for name in DETERMINISM_ENV_VARS:
        # a variable configure() set and prime_cublas_and_release_env() removed still counts as set
        record[f"env.{name}"] = os.environ.get(name, configured_env.get(name, "<unset>"))
    # plain str: torch.__version__ is a TorchVersion, which torch.load(weights_only=True) refuses
    return {key: str.__str__(str(value)) for key, value in record.items()}


def diff_fingerprints(saved: Mapping[str, str], current: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    """Fields whose values differ, as ``{field: (saved, current)}``; volatile fields are ignored.

    A field present on one side only (a checkpoint from an older version) is not a difference.
    """
    differences = {}
    for key in sorted(set(saved) & set(current)):
        if key in _VOLATILE_FIELDS:
            continue
        if str(saved[key]) != str(current[key]):
            differences[key] = (str(saved[key]), str(current[key]))
    return differences


def format_fingerprint(record: Mapping[str, str]) -> str:
    """A Markdown table of the record, for TensorBoard's text plugin."""
    rows = ["| field | value |", "|---|---|"]
    rows.extend(f"| {key} | {value} |" for key, value in sorted(record.items()))
    return "\n".join(rows)
