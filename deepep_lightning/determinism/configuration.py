"""``configure(seed)``: the first line of a reproducible script, before anything starts CUDA.

Some settings are read once, when CUDA or cuBLAS starts (``CUBLAS_WORKSPACE_CONFIG`` is checked by
PyTorch at the first cuBLAS call under deterministic mode and read when a workspace is sized), so
they must be in the environment before the first CUDA call; the rest (seeds, flags) can be set at
any time. :func:`configure` sets both, records what it set and whether it was too late, and the
:class:`~deepep_lightning.determinism.callback.DeterminismCallback` checks that record in ``setup``.

Defaults and why (their cost is measured by ``benchmarks/bench_determinism_tax.py``; figures in
``BENCHMARKS.md``):

* ``use_deterministic_algorithms(True)``: swaps in deterministic kernels (``index_add_``,
  ``scatter_add_``) and raises on ops that have none (``grid_sample`` backward), which is how a
  user learns *which* op breaks reproducibility.
* ``fill_uninitialized_memory=False``: NaN-filling every fresh allocation costs one extra kernel
  per ``empty`` and only matters for code that reads memory it never wrote; that is a bug the NaN
  tools find, not a source of run-to-run noise in correct code.
* ``cublas_workspace_config=":4096:8"``: PyTorch's deterministic mode refuses cuBLAS without it
  (checked once, at the first cuBLAS call). It is not what makes a GEMM reproducible in one
  stream: PyTorch gives every (device, stream) its own workspace. What it costs is host time per
  GEMM, because some PyTorch versions re-read the variable on every cuBLAS call; GPU time is
  unchanged. :func:`prime_cublas_and_release_env` (``DeterminismCallback(release_cublas_env=True)``,
  the default) keeps the deterministic-mode check satisfied (it is evaluated once) and removes the
  per-call cost. On sm90 the default workspace equals ``:4096:8``, so no kernel choice changes.
* ``distributed=True``: the NCCL profile of :mod:`~deepep_lightning.determinism.nccl_profile`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Literal, get_args

import torch

from deepep_lightning import _checks, _lightning_compat
from deepep_lightning.determinism.nccl_profile import NCCL_DETERMINISTIC_ENV
from deepep_lightning.determinism.rng import seed_everything_from

__all__ = [
    "ConfigureRecord",
    "CublasWorkspaceConfig",
    "configure",
    "last_configure_record",
    "NCCL_DETERMINISTIC_ENV",
    "prime_cublas_and_release_env",
]

log = logging.getLogger(__name__)

#: The two ``CUBLAS_WORKSPACE_CONFIG`` values PyTorch's deterministic mode accepts.
CublasWorkspaceConfig = Literal[":4096:8", ":16:8"]
_CUBLAS_DETERMINISTIC_CONFIGS: tuple[str, ...] = get_args(CublasWorkspaceConfig)

_last_record: "ConfigureRecord | None" = None


@dataclasses.dataclass(frozen=True)
class ConfigureRecord:
    """What :func:`configure` set, and what could no longer take effect."""

    seed: int
    env: dict[str, str]
    deterministic_algorithms: bool
    warn_only: bool
    fill_uninitialized_memory: bool
    cudnn_deterministic: bool
    cudnn_benchmark: bool
    inductor_deterministic: bool | None
    cuda_initialized_before: bool
    too_late: tuple[str, ...]
    set_by_configure: tuple[str, ...] = ()


def validate_arguments(seed: Any, cublas_workspace_config: Any, flags: dict[str, Any]) -> None:
    """Check the arguments :func:`configure` takes (``DeterminismCallback`` forwards them).

    Raises:
        MisconfigurationException: an argument has a wrong type or value.
    """
    _checks.non_negative_int(None, "seed", seed)
    _checks.choice(
        None,
        "cublas_workspace_config",
        cublas_workspace_config,
        _CUBLAS_DETERMINISTIC_CONFIGS,
        allow_none=True,
        hint="PyTorch's deterministic mode accepts only these two",
    )
    for name, value in flags.items():
        _checks.strict_bool(None, name, value)


def configure(
    seed: int = 0,
    *,
    deterministic_algorithms: bool = True,
    warn_only: bool = False,
    fill_uninitialized_memory: bool = False,
    cublas_workspace_config: CublasWorkspaceConfig | None = ":4096:8",
    cudnn_benchmark: bool = False,
    distributed: bool = False,
    inductor: bool = True,
    patch_refused_ops: bool = False,
) -> ConfigureRecord:
    """Make this process reproducible; call it before anything creates a CUDA context.

    Args:
        seed: run seed; torch/numpy/random are seeded from ``derive_seed(seed, "global")``.
        deterministic_algorithms: ``torch.use_deterministic_algorithms``.
        warn_only: ops without a deterministic kernel warn instead of raising.
        fill_uninitialized_memory: NaN-fill fresh allocations under deterministic mode (default off:
            it costs a kernel per allocation and does not change results of correct code).
        cublas_workspace_config: value for ``CUBLAS_WORKSPACE_CONFIG`` (kept if already set);
            ``None`` leaves it unset (then use ``warn_only=True`` on CUDA, PyTorch insists on it).
        cudnn_benchmark: ``torch.backends.cudnn.benchmark`` (autotuning picks kernels by timing).
        distributed: also set :data:`NCCL_DETERMINISTIC_ENV` (kept where already set).
        inductor: set ``torch._inductor.config.deterministic`` as well.
        patch_refused_ops: route the CUDA kernels that deterministic mode refuses or runs
            non-deterministically without a word (``nll_loss2d``, pooling and padding backwards,
            ``grid_sample`` including cuDNN's sampler, ``interpolate``, the ``index_reduce``/``scatter``
            family, ...) to the extension's deterministic kernels while deterministic mode is on
            (:func:`deepep_lightning.ops.patch_refused_ops`); other cases keep PyTorch's behaviour.

    Returns:
        A :class:`ConfigureRecord`; ``too_late`` names settings CUDA had already fixed.

    Raises:
        MisconfigurationException: an argument has a wrong type or value.

    Example::

        from deepep_lightning import configure
        configure(7)  # first line of train.py
    """
    global _last_record
    validate_arguments(
        seed,
        cublas_workspace_config,
        {
            "deterministic_algorithms": deterministic_algorithms,
            "warn_only": warn_only,
            "fill_uninitialized_memory": fill_uninitialized_memory,
            "cudnn_benchmark": cudnn_benchmark,
            "distributed": distributed,
            "inductor": inductor,
            "patch_refused_ops": patch_refused_ops,
        },
    )
    cuda_started = torch.cuda.is_available() and torch.cuda.is_initialized()
    cublas_may_have_started = cuda_started and _cuda_memory_in_use()
    wanted = {
        "PYTHONHASHSEED": str(seed),  # for child processes; this one hashed already
        # Lightning's own worker seeding (pl_worker_init_function) for loaders the callback does not
        # rebuild (validation, custom samplers), and the seed its DDP children reset to
        "PL_SEED_WORKERS": "1",
        "PL_GLOBAL_SEED": str(seed),
    }
    if cublas_workspace_config is not None:
        wanted["CUBLAS_WORKSPACE_CONFIG"] = cublas_workspace_config
    if distributed:
        wanted.update(NCCL_DETERMINISTIC_ENV)
    env: dict[str, str] = {}
    set_here: list[str] = []
    too_late: list[str] = []
    ours = set(_last_record.set_by_configure) if _last_record is not None else set()
    for name, value in wanted.items():
        current = os.environ.get(name)
        if current is None or (name in ours and current != value):  # never override a user's export
            os.environ[name] = value
            env[name] = value
            set_here.append(name)
            if (cuda_started and name.startswith("NCCL")) or (cublas_may_have_started and name.startswith("CUBLAS")):
                too_late.append(name)
        else:
            env[name] = current
            if name in ours:  # set by an earlier configure() call: still ours to change or release
                set_here.append(name)
    if cublas_may_have_started and cublas_workspace_config is not None:
        if os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in _CUBLAS_DETERMINISTIC_CONFIGS:
            too_late.append("CUBLAS_WORKSPACE_CONFIG")
    seed_everything_from(seed, "global")
    torch.use_deterministic_algorithms(deterministic_algorithms, warn_only=warn_only)
    if patch_refused_ops:
        from deepep_lightning.ops.routing import patch_refused_ops as install_routing

        install_routing(True)
    torch.utils.deterministic.fill_uninitialized_memory = fill_uninitialized_memory  # type: ignore[attr-defined]
    torch.backends.cudnn.deterministic = deterministic_algorithms
    torch.backends.cudnn.benchmark = cudnn_benchmark
    inductor_flag = _lightning_compat.set_inductor_deterministic(deterministic_algorithms) if inductor else None
    if inductor and inductor_flag is None:
        log.debug("torch._inductor.config.deterministic is not available")
    _last_record = ConfigureRecord(
        seed=seed,
        env=env,
        deterministic_algorithms=deterministic_algorithms,
        warn_only=warn_only,
        fill_uninitialized_memory=fill_uninitialized_memory,
        cudnn_deterministic=deterministic_algorithms,
        cudnn_benchmark=cudnn_benchmark,
        inductor_deterministic=inductor_flag,
        cuda_initialized_before=cuda_started,
        too_late=tuple(dict.fromkeys(too_late)),
        set_by_configure=tuple(set_here),
    )
    return _last_record


def _cuda_memory_in_use() -> bool:
    """True when the caching allocator holds memory on a device, i.e. a cuBLAS workspace may exist.

    ``CUBLAS_WORKSPACE_CONFIG`` is read when a workspace is sized, at the first cuBLAS call on a
    (handle, stream); PyTorch takes those workspaces from the caching allocator. A started CUDA
    context that holds no memory (what ``Trainer`` leaves after ``torch.cuda.set_device``, before the
    model moves) has run no cuBLAS call, so the variable still takes effect.
    """
    return any(torch.cuda.memory_reserved(index) > 0 for index in range(torch.cuda.device_count()))


def last_configure_record() -> ConfigureRecord | None:
    """The record of the last :func:`configure` call in this process, if any."""
    return _last_record


def prime_cublas_and_release_env(device: torch.device | str | int | None = None) -> bool:
    """Let PyTorch check ``CUBLAS_WORKSPACE_CONFIG`` once, then remove it if :func:`configure` set it.

    PyTorch reads the variable in two places: the deterministic-mode check (evaluated once, at the
    first cuBLAS call, then cached) and the workspace sizing, which some versions re-parse with a
    ``std::regex`` on every cuBLAS call (the host cost ``benchmarks/bench_determinism_tax.py``
    measures, ``BENCHMARKS.md``). Determinism within a stream does not need the variable: PyTorch gives every
    (device, stream) its own workspace. This runs one forward and backward GEMM (so the autograd
    thread's handle is created too) with the variable set, then unsets it. On sm90 the default
    workspace equals ``:4096:8`` (32 MiB), so kernel choice is unchanged there.

    Returns ``True`` when the variable was removed. A value the user exported is never removed.
    """
    record = _last_record
    value = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if not torch.cuda.is_available() or value is None or record is None:
        return False
    if record.env.get("CUBLAS_WORKSPACE_CONFIG") != value or "CUBLAS_WORKSPACE_CONFIG" not in record.set_by_configure:
        return False
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    weight = torch.ones(16, 16, device=device, requires_grad=True)
    (torch.nn.functional.linear(weight, weight, weight[0]) @ weight).sum().backward()
    torch.cuda.synchronize(device)
    del os.environ["CUBLAS_WORKSPACE_CONFIG"]
    return True
