"""Every read or write of a Lightning, torchmetrics or torch private internal, in one place.

The plugin needs a few things that Lightning and PyTorch expose only under private names (the fit
loop's train-data source, the epoch's logging accumulators, DDP's constructor arguments, a
``Metric``'s state names, the CUDA fork check). Each access is a small named function here, with a
docstring saying what it reads and why, so that a Lightning or torch upgrade that renames one
breaks in this file only, and ``grep _lightning_compat`` lists every dependency on internals.

Lightning is imported lazily inside the functions that need it: :mod:`deepep_lightning.determinism.rng`
and :func:`deepep_lightning.configure` use this module too and must not pay for a Lightning import.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.core.optimizer import LightningOptimizer
    from torchmetrics import Metric

__all__ = [
    "attached_trainer",
    "cluster_environment",
    "counted_optimizer_step",
    "cuda_in_bad_fork",
    "current_autograd_node",
    "ddp_comm_hook",
    "ddp_kwargs",
    "epoch_result_collection",
    "finish_restored_epoch",
    "is_last_batch",
    "metric_state_names",
    "metric_update_count",
    "module_tracker",
    "optimizer_step_progress",
    "privateuse1_backend_name",
    "process_group_backend",
    "random_sampler_num_samples",
    "requested_process_group_backend",
    "run_optimization_step",
    "set_inductor_deterministic",
    "set_metric_update_count",
    "unwrap_train_dataloader_source",
    "update_dataloader",
    "wrap_train_dataloader_source",
]


# ---------------------------------------------------------------- LightningModule / Trainer
def attached_trainer(module: "pl.LightningModule | None") -> "pl.Trainer | None":
    """The Trainer a module is attached to, or ``None``.

    Reads ``LightningModule._trainer``: the public ``module.trainer`` raises when no Trainer is
    attached, and strategies run some hooks (``training_step`` in tests, ``on_train_start``) where
    that must be checked first.
    """
    return None if module is None else module._trainer


def cluster_environment(trainer: "pl.Trainer") -> Any:
    """The cluster environment the Trainer chose (``trainer._accelerator_connector.cluster_environment``).

    Lightning's signal connector installs its SLURM requeue handler from this object, for every
    strategy (a single-device strategy has no ``cluster_environment`` of its own).
    """
    return trainer._accelerator_connector.cluster_environment


@functools.cache
def _transformed_source_type() -> type:
    from lightning.pytorch.trainer.connectors.data_connector import _DataLoaderSource

    class _TransformedSource(_DataLoaderSource):
        """The fit loop's train-data source, passing the loaders it returns through ``transform``."""

        def __init__(self, instance: Any, name: str, transform: Callable[[Any], Any]) -> None:
            super().__init__(instance, name)
            self.transform = transform

        def dataloader(self) -> Any:
            return self.transform(super().dataloader())

    return _TransformedSource


def wrap_train_dataloader_source(trainer: "pl.Trainer", transform: Callable[[Any], Any]) -> Any | None:
    """Make the fit loop pass every train loader it builds through ``transform``.

    Writes ``trainer.fit_loop._data_source`` (a private ``_DataLoaderSource``): it is the one place
    where the fit loop asks for the train loaders, after Lightning has re-wrapped them for DDP, so a
    loader replaced here is the one the loop iterates, in every epoch and after a reload. Returns the
    original source for :func:`unwrap_train_dataloader_source`, or ``None`` when it is wrapped already.
    """
    source = trainer.fit_loop._data_source
    wrapper = _transformed_source_type()
    if isinstance(source, wrapper):
        return None
    trainer.fit_loop._data_source = wrapper(source.instance, source.name, transform)
    return source


def unwrap_train_dataloader_source(trainer: "pl.Trainer", original: Any) -> None:
    """Put back the source :func:`wrap_train_dataloader_source` replaced (``trainer.fit_loop._data_source``).

    The instance is carried over: Lightning may have replaced the module or datamodule meanwhile.
    """
    original.instance = trainer.fit_loop._data_source.instance
    trainer.fit_loop._data_source = original


def epoch_result_collection(trainer: "pl.Trainer") -> dict[str, Any]:
    """The running epoch accumulators behind ``self.log(..., on_epoch=True)`` in training.

    Reads ``trainer.fit_loop.epoch_loop._results`` (a ``_ResultCollection``), which Lightning does
    not checkpoint: a mid-epoch resume must save and merge it to get the same epoch value.
    Empty when the loop has none yet.
    """
    return getattr(trainer.fit_loop.epoch_loop, "_results", {}) or {}


def finish_restored_epoch(trainer: "pl.Trainer") -> bool:
    """Close the epoch a checkpoint written in ``on_train_epoch_end`` belongs to; returns whether one was closed.

    With ``max_steps`` set, Lightning's fit loop restarts even when the checkpoint's epoch ran all its
    batches (``FitLoop.restarting`` is forced for iteration-based training): it re-enters that epoch,
    whose epoch loop is not done until validation ran, and trains one more batch from a fresh loader
    iterator, stepping on it alone as the epoch's last. Without ``max_steps`` the fit loop does not
    restart and starts the next epoch. This gives the ``max_steps`` resume that path: it marks the
    epoch completed (``fit_loop.epoch_progress``), clears the restart stages of the fit and epoch loops
    and their ``restarting`` flag (children included, through ``_Loop.restarting``'s setter, which
    ``FitLoop`` overrides to keep it on), so the epoch loop resets its batch counters for the next
    epoch. Only the epoch-end stage is touched (``fit_loop.restarted_on_epoch_end`` with the epoch
    loop ``restarted_on_last``); any other checkpoint resumes as Lightning restores it. Runs after
    ``FitLoop.reset`` (it decides the stages), before the first epoch starts: ``on_train_start``.
    """
    from lightning.pytorch.loops.loop import _Loop

    fit_loop = trainer.fit_loop
    epoch_loop = fit_loop.epoch_loop
    if not (fit_loop.restarting and fit_loop.restarted_on_epoch_end and epoch_loop.restarted_on_last):
        return False
    fit_loop.epoch_progress.increment_completed()
    fit_loop.reset_restart_stage()
    epoch_loop.reset_restart_stage()
    loop_restarting: Any = _Loop.restarting  # the base setter, which FitLoop's override would turn back on
    loop_restarting.fset(fit_loop, False)
    return True


def load_pending_loader_states(trainer: "pl.Trainer") -> bool:
    """Apply checkpointed train-loader states that Lightning restored but did not hand to the loaders.

    The fit loop gives a resumed checkpoint's loader states to its ``CombinedLoader`` in
    ``setup_data``, which does nothing when the loader already exists. Reading
    ``trainer.estimated_stepping_batches`` in ``configure_optimizers`` (Lightning's recommended way to
    size ``OneCycleLR``) builds it before the checkpoint is restored, so the states are dropped and
    the resumed epoch starts from its first batch (Lightning issue #20550). Calls
    ``fit_loop._load_combined_loader_states()``, which applies pending states once and is a no-op
    otherwise. Returns whether states were pending.
    """
    fit_loop = trainer.fit_loop
    pending = bool(getattr(fit_loop, "_combined_loader_states_to_load", None))
    fit_loop._load_combined_loader_states()
    return pending


def update_dataloader(dataloader: Any, sampler: Any) -> Any:
    """Rebuild ``dataloader`` with another sampler, keeping every other argument.

    Calls ``lightning.pytorch.utilities.data._update_dataloader``, the rebuild Lightning itself uses
    when it injects a ``DistributedSampler`` (it re-creates custom DataLoader subclasses too).
    """
    from lightning.pytorch.utilities.data import _update_dataloader

    return _update_dataloader(dataloader, sampler)


# ---------------------------------------------------------------- DDPStrategy
def ddp_kwargs(strategy: Any) -> dict[str, Any]:
    """The keyword arguments a ``DDPStrategy`` passes to ``DistributedDataParallel`` (``_ddp_kwargs``).

    They decide the gradients' bits (bucket size, bucket views, static graph), so the fingerprint
    records them as DDP will see them.
    """
    return dict(strategy._ddp_kwargs)


def ddp_comm_hook(strategy: Any) -> Any:
    """The communication hook a ``DDPStrategy`` registers on DDP, or ``None`` (``_ddp_comm_hook``)."""
    return strategy._ddp_comm_hook


def process_group_backend(strategy: Any) -> str | None:
    """The backend the process group was started with, ``None`` before setup (``_process_group_backend``)."""
    return strategy._process_group_backend


def requested_process_group_backend(strategy: Any) -> str:
    """The backend a ``DDPStrategy`` will start (``_get_process_group_backend()``: ``"nccl"`` on CUDA).

    Known before ``init_process_group``, when the NCCL environment must already be set.
    """
    return strategy._get_process_group_backend()


# ---------------------------------------------------------------- torchmetrics
def metric_state_names(metric: "Metric") -> list[str]:
    """Names of the states a ``Metric`` declared with ``add_state`` (``Metric._defaults``).

    They are not persistent by default, so a mid-epoch checkpoint must capture them itself.
    """
    return list(metric._defaults)


def metric_update_count(metric: "Metric") -> int:
    """How many times ``update`` ran since the last reset (``Metric._update_count``)."""
    return int(metric._update_count)


def set_metric_update_count(metric: "Metric", count: int) -> None:
    """Restore ``Metric._update_count`` and drop the cached ``compute()`` result (``Metric._computed``).

    Without the count, ``compute()`` on a restored metric warns that ``update`` never ran; a stale
    cached value would hide the restored states.
    """
    metric._update_count = int(count)
    metric._computed = None


# ---------------------------------------------------------------- torch
def privateuse1_backend_name() -> str:
    """The name of torch's out-of-tree device backend slot (``torch._C._get_privateuse1_backend_name``).

    ``torch.manual_seed`` also seeds that backend when a module of that name is registered on torch.
    """
    return torch._C._get_privateuse1_backend_name()


def cuda_in_bad_fork() -> bool:
    """``torch.cuda._is_in_bad_fork()``: CUDA started in a parent of this forked process.

    Queuing a CUDA seed there would raise when CUDA is touched; seeding must skip CUDA instead.
    """
    return bool(torch.cuda._is_in_bad_fork())


def set_inductor_deterministic(enabled: bool) -> bool | None:
    """Set ``torch._inductor.config.deterministic`` (compiled kernels avoid atomics and autotuning).

    Returns the value set, or ``None`` when this torch build has no such setting.
    """
    try:
        import torch._inductor.config as inductor_config

        inductor_config.deterministic = enabled  # type: ignore[attr-defined,unused-ignore]
    except (ImportError, AttributeError):  # pragma: no cover - depends on the torch build
        return None
    return enabled


def random_sampler_num_samples(sampler: torch.utils.data.RandomSampler) -> int | None:
    """The ``num_samples`` a ``RandomSampler`` was built with, ``None`` for the default (``_num_samples``).

    The public ``num_samples`` property fills in the dataset length, which hides a custom value.
    """
    return sampler._num_samples


# ---------------------------------------------------------------- fit loop (health: snapshots and replays)
def optimizer_step_progress(trainer: "pl.Trainer") -> tuple[Any, Any]:
    """The optimizer-step counters behind ``trainer.global_step``: automatic and manual optimisation's.

    Reads ``fit_loop.epoch_loop.automatic_optimization.optim_progress`` and
    ``manual_optimization.optim_step_progress`` (loop internals): a rollback rewinds them for a
    replay and puts them back after it, so ``global_step`` never counts a replayed step twice.
    """
    epoch_loop = trainer.fit_loop.epoch_loop
    return epoch_loop.automatic_optimization.optim_progress, epoch_loop.manual_optimization.optim_step_progress


def is_last_batch(trainer: "pl.Trainer") -> bool:
    """Whether the batch the fit loop is on is its epoch's last (``fit_loop.epoch_loop.batch_progress``).

    The health check and the rollback's snapshot are due at an epoch's end; after the last batch the
    epoch loop steps ``interval="epoch"`` schedulers, which a replay of that batch must do too.
    """
    return bool(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)


@contextlib.contextmanager
def counted_optimizer_step(lightning_optimizer: "LightningOptimizer") -> Iterator[None]:
    """Lightning's bookkeeping of one optimizer step around a step taken without ``LightningOptimizer.step``.

    Calls ``LightningOptimizer._on_before_step`` before the block and ``_on_after_step`` after it (not
    when the block raises, as ``LightningOptimizer.step`` does): the manual-optimisation loop counts
    ``global_step`` through these, so a step replayed from a CUDA graph is counted like an eager one.
    """
    lightning_optimizer._on_before_step()
    yield
    lightning_optimizer._on_after_step()


def run_optimization_step(
    trainer: "pl.Trainer", batch: Any, batch_idx: int, optimizer: torch.optim.Optimizer | None
) -> Any:
    """Run one training step through the fit loop's own optimisation object; returns its outputs.

    Calls ``epoch_loop._build_kwargs`` and ``automatic_optimization.run`` (``optimizer`` given) or
    ``manual_optimization.run`` (``optimizer=None``): the objects the loop itself calls, so closure,
    backward, precision plugin, clipping, ``optimizer_step`` and every callback hook run exactly as
    in the original step.
    """
    from collections import OrderedDict

    epoch_loop = trainer.fit_loop.epoch_loop
    kwargs = epoch_loop._build_kwargs(OrderedDict(), batch, batch_idx)
    if optimizer is not None:
        return epoch_loop.automatic_optimization.run(optimizer, batch_idx, kwargs)
    return epoch_loop.manual_optimization.run(kwargs)


# ---------------------------------------------------------------- autograd and dispatch (audit locators)
def current_autograd_node() -> Any:
    """The autograd node whose backward is running now, or None in forward (``torch._C._current_autograd_node``)."""
    return torch._C._current_autograd_node()


def module_tracker() -> Any:
    """A ``torch.distributed._tools.mod_tracker.ModTracker`` (module paths in forward and backward), or None.

    A private PyTorch tool; imported lazily (``torch.distributed`` is slow to import) and optional:
    without it the locators report no module path.
    """
    try:
        from torch.distributed._tools.mod_tracker import ModTracker
    except Exception:  # pragma: no cover - depends on the torch build
        return None
    return ModTracker()
