"""DeterminismCallback: bitwise run-to-run reproducibility and exact (mid-epoch) resume for any module.

What it does, in hook order:

* ``__init__``: validates its arguments; nothing global changes (no seeding, no flags, no
  environment variables), so constructing the callback is free of side effects.
* ``setup``: settles the seed (the ``seed`` argument, else Lightning's global seed ``PL_GLOBAL_SEED``
  from ``seed_everything``, else an earlier :func:`~deepep_lightning.determinism.configuration.configure`
  call, else 0) and says which; checks that the model was not initialised from an unseeded generator;
  calls ``configure`` unless the user already did with the same settings (then it only reseeds
  torch/numpy/random from the seed, as ``configure`` does), and checks that it was in
  time for CUDA (``strict``: raise, naming what to move; otherwise warn); wraps the train DataLoader
  source so plain map-style loaders (torch ``DataLoader`` or torchdata ``StatefulDataLoader``) become
  :class:`~deepep_lightning.determinism.data.SeekableDataLoader`; any other ``StatefulDataLoader``
  keeps its own state, which Lightning checkpoints (the plugin interoperates, never refuses it).
* ``on_train_batch_start``: reseeds torch/numpy/random from ``(seed, "train", rank, epoch,
  batch_idx)``, so the training stream at any batch is a pure function of its position: nothing
  that runs between two batches (validation, sanity check, logging, a loader's ``base_seed``) can
  shift it, and a resume needs no replay. On the first batch after a resume it first restores the
  checkpointed RNG states (the only mechanism when ``reseed_every_step=False``).
* ``state_dict``: every RNG state (torch CPU, each CUDA device, numpy, python) as
  ``weights_only``-loadable values, plus the stack fingerprint.
* ``on_after_backward`` / ``on_before_optimizer_step``: track whether an accumulation window is
  open (a backward since the last optimizer step: ``accumulate_grad_batches > 1``, or a manually
  optimised module that steps every few batches).
* ``on_save_checkpoint``: moves the positions of the loaders it built out of Lightning's
  ``combined_loader`` list into its own state, so that plain Lightning (no DeterminismCallback)
  resumes the checkpoint without "CombinedLoader has 0 stateful loaders" and
  ``load_from_checkpoint`` needs nothing from the plugin; stores the gradients of an open
  accumulation window (:mod:`~deepep_lightning.determinism.accumulation`; one process, or a
  strategy that keeps every rank's callback state);
  then SHA-256 digests of its own state and of the model's ``state_dict``.
* ``on_load_checkpoint``: verifies those digests (a mismatch raises
  :class:`~deepep_lightning.determinism.checkpoint_integrity.CheckpointIntegrityError` naming the file)
  and warns when the checkpoint holds no state of this callback (written without it: the resume is
  not guaranteed exact); puts its loaders' positions back where Lightning's loop restore reads them.
  A file that cannot be read at all raises the same error, naming it.
* ``load_state_dict``: compares the saved fingerprint with the current one.
"""

from __future__ import annotations

import logging
import os
import weakref
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import CombinedLoader
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from deepep_lightning import _checks, _lightning_compat
from deepep_lightning.determinism.accumulation import capture_gradients, restore_gradients
from deepep_lightning.determinism.checkpoint_integrity import (
    CheckpointIntegrityError,
    digest,
    model_digest,
    readable_checkpoint_loader,
)
from deepep_lightning.determinism.configuration import (
    ConfigureRecord,
    CublasWorkspaceConfig,
    configure,
    last_configure_record,
    prime_cublas_and_release_env,
    validate_arguments,
)
from deepep_lightning.determinism.data import make_seekable, put_back_loader_states, take_loader_states
from deepep_lightning.determinism.fingerprint import collect_fingerprint, diff_fingerprints, format_fingerprint
from deepep_lightning.determinism.results import capture_logged_state, merge_epoch_results, restore_metric_modules
from deepep_lightning.determinism.rng import (
    capture_rng_state,
    default_generator_is_unseeded,
    restore_rng_state,
    seed_everything_from,
)
from deepep_lightning.ops.routing import patch_refused_ops
from deepep_lightning.trainer_deterministic import warn_if_trainer_deterministic_conflicts

__all__ = ["CheckpointIntegrityError", "DeterminismCallback", "FingerprintMismatchError"]

log = logging.getLogger(__name__)

_STATE_VERSION = 1


def _deterministic_flags() -> tuple[bool, bool]:
    """(deterministic algorithms on, warn_only) as torch has them now."""
    return torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()


class FingerprintMismatchError(RuntimeError):
    """A checkpoint was written on a different stack than the one resuming it (strict mode)."""


class DeterminismCallback(Callback):
    """Reproducible runs and exact resume for any LightningModule.

    Args:
        seed: run seed; ``None`` takes Lightning's global seed (``PL_GLOBAL_SEED``, set by
            ``seed_everything`` and LightningCLI's ``seed_everything:``), else the seed of an earlier
            :func:`configure` call, else 0. Settled at ``setup``; a seed that disagrees with
            ``PL_GLOBAL_SEED`` warns. The checkpoint records the seed used.
        strict: raise (instead of warning) when CUDA started before :func:`configure`, when the
            model was initialised from an unseeded generator, when the checkpoint's fingerprint
            differs, or when a train loader cannot be made seekable.
        deterministic_algorithms, warn_only, fill_uninitialized_memory, cublas_workspace_config:
            passed to :func:`configure` (see there for the defaults and their cost).
        release_cublas_env: at train start on CUDA, let PyTorch check ``CUBLAS_WORKSPACE_CONFIG``
            once and then unset it (:func:`prime_cublas_and_release_env`): some PyTorch versions
            re-read the variable on every cuBLAS call, which costs host time per GEMM (GPU time and
            bits unchanged; figures in ``BENCHMARKS.md``). Only a value :func:`configure` set is
            removed; the fingerprint still records it.
        seekable_data: rebuild plain map-style train loaders (torch ``DataLoader``, torchdata
            ``StatefulDataLoader``) as seekable ones (order = pure function of (seed, epoch, rank);
            per-sample streams from (seed, epoch, index)). ``False`` leaves every loader as it is.
        reseed_every_step: reseed the global RNGs from the batch position before every batch.
        isolate_evaluation: validation and sanity checks run on their own stream and never shift
            the training stream (matters when ``reseed_every_step=False``).
        log_fingerprint: write the fingerprint to TensorBoard's text plugin.
        patch_refused_ops: during fit, route the aten ops whose CUDA kernels PyTorch refuses in
            deterministic mode (``nll_loss2d_forward``, adaptive/3-D pooling and padding backwards,
            bilinear ``grid_sampler_2d_backward`` / ``upsample_bilinear2d_backward``, ...) to deterministic
            CUDA kernels at the dispatcher (:func:`deepep_lightning.ops.patch_refused_ops`); every other
            case keeps PyTorch's behaviour.

    Raises:
        MisconfigurationException: an argument has a wrong type or value (at construction); at
            ``setup`` under ``strict``: CUDA was in use before :func:`configure`, or the model was
            initialised from torch's unseeded start-up generator.
        CheckpointIntegrityError: on resume, the checkpoint cannot be read or does not match its digests.

    Example::

        pl.seed_everything(7)  # before the model is built: its initial weights are seeded
        trainer = Trainer(callbacks=[DeterminismCallback()])  # seed 7, from seed_everything
    """

    def __init__(
        self,
        seed: int | None = None,
        *,
        strict: bool = True,
        deterministic_algorithms: bool = True,
        warn_only: bool = False,
        fill_uninitialized_memory: bool = False,
        cublas_workspace_config: CublasWorkspaceConfig | None = ":4096:8",
        release_cublas_env: bool = True,
        seekable_data: bool = True,
        reseed_every_step: bool = True,
        isolate_evaluation: bool = True,
        log_fingerprint: bool = True,
        patch_refused_ops: bool = True,
    ) -> None:
        _checks.non_negative_int(None, "seed", seed, allow_none=True)
        flags = {
            "strict": strict,
            "release_cublas_env": release_cublas_env,
            "seekable_data": seekable_data,
            "reseed_every_step": reseed_every_step,
            "isolate_evaluation": isolate_evaluation,
            "log_fingerprint": log_fingerprint,
            "patch_refused_ops": patch_refused_ops,
        }
        for name, value in flags.items():
            _checks.strict_bool(None, name, value)
        validate_arguments(
            seed or 0,
            cublas_workspace_config,
            {
                "deterministic_algorithms": deterministic_algorithms,
                "warn_only": warn_only,
                "fill_uninitialized_memory": fill_uninitialized_memory,
            },
        )
        self._seed_argument = seed
        self.seed, self._seed_source = self._resolve_seed()  # settled again at setup
        self._seed_announced = False
        self.strict = strict
        self.release_cublas_env = release_cublas_env
        self.seekable_data = seekable_data
        self.reseed_every_step = reseed_every_step
        self.isolate_evaluation = isolate_evaluation
        self.log_fingerprint = log_fingerprint
        self.patch_refused_ops = patch_refused_ops
        self._routing_was_on: bool | None = None
        self._configure_kwargs: dict[str, Any] = {
            "deterministic_algorithms": deterministic_algorithms,
            "warn_only": warn_only,
            "fill_uninitialized_memory": fill_uninitialized_memory,
            "cublas_workspace_config": cublas_workspace_config,
        }
        # Read, not set: a change between here and setup is Trainer(deterministic=...) (built after its callbacks)
        self._deterministic_flags_at_init = _deterministic_flags()
        self._pending_rng: dict[str, Any] | None = None
        self._pending_logged: dict[str, Any] | None = None
        self._pending_results: dict[str, Any] = {}
        self._saved_train_rng: dict[str, Any] | None = None
        self._pending_gradients: dict[str, Any] | None = None
        self._window_open = False  # a backward ran since the last optimizer step
        self._warned_window_under_ddp = False
        self._own_loaders: weakref.WeakSet[Any] = weakref.WeakSet()  # the SeekableDataLoaders made here
        self._original_source: Any = None
        self._wrapped_loader_of: Any = None
        self._rank = 0
        self._world_size = 1
        self._num_nodes = 1

    def _resolve_seed(self) -> tuple[int, str]:
        """The seed to use and where it comes from (the ``seed`` argument, Lightning, ``configure``, default)."""
        if self._seed_argument is not None:
            return self._seed_argument, "the `seed` argument"
        global_seed = _lightning_global_seed()
        if global_seed is not None:
            return global_seed, "Lightning's global seed (PL_GLOBAL_SEED, set by `seed_everything`)"
        record = last_configure_record()
        if record is not None:
            return record.seed, "the last `configure(seed)` call"
        return 0, "the default: no `seed` argument, no `seed_everything`, no `configure`"

    def _settle_seed(self) -> None:
        self.seed, self._seed_source = self._resolve_seed()
        global_seed = _lightning_global_seed()
        if self._seed_argument is not None and global_seed is not None and global_seed != self.seed:
            rank_zero_warn(
                f"DeterminismCallback: seed={self.seed!r} disagrees with Lightning's global seed"
                f" PL_GLOBAL_SEED={global_seed!r} (set by `seed_everything` or an earlier `configure`); the"
                f" callback uses seed={self.seed!r}. HINT: pass the same value to both, or leave `seed` unset"
                " to follow `seed_everything`."
            )
        if not self._seed_announced:
            rank_zero_info(f"DeterminismCallback: seed {self.seed} (from {self._seed_source})")
            self._seed_announced = True

    def _check_seeded_before_model(self) -> None:
        if last_configure_record() is not None or not default_generator_is_unseeded():
            return
        message = (
            "DeterminismCallback: torch's default generator drew numbers (the model's initial weights,"
            " most likely) before any seed was set, so they differ in every fresh process and two runs"
            " cannot be equal. HINT: call `lightning.pytorch.seed_everything(seed)` or"
            " `deepep_lightning.configure(seed)` before building the model."
        )
        if self.strict:
            raise MisconfigurationException(message + " (strict=True refuses; strict=False only warns)")
        rank_zero_warn(message)

    def _record_matches(self, record: ConfigureRecord | None) -> bool:
        if record is None or record.seed != self.seed:
            return False
        kwargs = self._configure_kwargs
        return (
            record.deterministic_algorithms == kwargs["deterministic_algorithms"]
            and record.warn_only == kwargs["warn_only"]
            and record.fill_uninitialized_memory == kwargs["fill_uninitialized_memory"]
        )

    # ---------------------------------------------------------------- setup / teardown
    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        self._rank, self._world_size = trainer.global_rank, trainer.world_size
        self._num_nodes = trainer.num_nodes
        self._settle_seed()
        self._check_seeded_before_model()
        flags = _deterministic_flags()
        if flags != self._deterministic_flags_at_init:  # set by Trainer(deterministic=...) or code since __init__
            warn_if_trainer_deterministic_conflicts(
                "warn" if flags == (True, True) else flags[0],
                self._configure_kwargs["deterministic_algorithms"],
                self._configure_kwargs["warn_only"],
            )
        record = last_configure_record()
        if record is None or not self._record_matches(record):
            record = configure(self.seed, **self._configure_kwargs)
        else:  # what configure() seeds: the stream at fit start is a function of the seed, not of the process
            seed_everything_from(self.seed, "global")
        if record.too_late:
            message = (
                f"DeterminismCallback: CUDA was in use (device memory allocated, so cuBLAS may have started)"
                f" before configure() set {', '.join(record.too_late)}: settings read when CUDA/cuBLAS start"
                " may not take effect. HINT: call"
                " `deepep_lightning.configure(seed)` before anything touches CUDA: before `model.cuda()`,"
                " `torch.randn(..., device='cuda')`, `torch.cuda.*` queries and `trainer.fit(...)` (the"
                " Trainer starts CUDA before this callback's `setup`); or export CUBLAS_WORKSPACE_CONFIG"
                " in the shell."
            )
            if self.strict:
                raise MisconfigurationException(message)
            rank_zero_warn(message)
        if torch.are_deterministic_algorithms_enabled() != record.deterministic_algorithms:
            rank_zero_warn("DeterminismCallback: deterministic-algorithms flag changed after configure(); re-applied")
            torch.use_deterministic_algorithms(record.deterministic_algorithms, warn_only=record.warn_only)
        if self.patch_refused_ops and self._routing_was_on is None:
            self._routing_was_on = patch_refused_ops(True)
        if stage == "fit" and not getattr(trainer.strategy.load_checkpoint, "__deepep_readable__", False):
            # instance attribute over the class method; teardown deletes it
            trainer.strategy.load_checkpoint = readable_checkpoint_loader(trainer.strategy.load_checkpoint)  # type: ignore[method-assign]
            self._wrapped_loader_of = trainer.strategy
        if stage == "fit" and self.seekable_data:
            original = _lightning_compat.wrap_train_dataloader_source(trainer, self._make_seekable)
            if original is not None:
                self._original_source = original

    @override
    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if self._routing_was_on is not None:
            patch_refused_ops(self._routing_was_on)
            self._routing_was_on = None
        if self._original_source is not None:
            _lightning_compat.unwrap_train_dataloader_source(trainer, self._original_source)
            self._original_source = None
        if self._wrapped_loader_of is not None:
            vars(self._wrapped_loader_of).pop("load_checkpoint", None)
            self._wrapped_loader_of = None

    def _make_seekable(self, loaders: Any) -> Any:
        def convert(loader: Any) -> Any:
            new, reason = make_seekable(loader, seed=self.seed, rank=self._rank, world_size=self._world_size)
            if new is not loader:
                self._own_loaders.add(new)
            if reason is not None and hasattr(loader, "state_dict") and hasattr(loader, "load_state_dict"):
                rank_zero_info(
                    f"DeterminismCallback: the train loader ({type(loader).__name__}) is not rebuilt as a seekable"
                    f" one because {reason}; Lightning checkpoints its own state_dict, and a mid-epoch resume is"
                    " as exact as that state (a worker's RNG state is not part of a StatefulDataLoader's)."
                )
            elif reason is not None:
                message = (
                    f"DeterminismCallback: the train loader cannot be made seekable because {reason};"
                    " a mid-epoch resume will not be exact. HINT: use a plain DataLoader over a map-style"
                    " dataset, or a `SeekableSampler`, or pass seekable_data=False to silence this."
                )
                if self.strict:
                    raise MisconfigurationException(message)
                rank_zero_warn(message)
            return new

        if isinstance(loaders, CombinedLoader):
            loaders.flattened = [convert(loader) for loader in loaders.flattened]
            return loaders
        if isinstance(loaders, torch.utils.data.DataLoader):
            return convert(loaders)
        combined = CombinedLoader(loaders, "max_size_cycle")
        combined.flattened = [convert(loader) for loader in combined.flattened]
        return combined

    # ---------------------------------------------------------------- training stream
    @override
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        # Before the first train iterator exists: a loader built early (estimated_stepping_batches in
        # configure_optimizers) gets its checkpointed position too.
        _lightning_compat.load_pending_loader_states(trainer)
        if self.release_cublas_env and pl_module.device.type == "cuda":
            prime_cublas_and_release_env(pl_module.device)
        if not (self.log_fingerprint and trainer.is_global_zero):
            return
        text = format_fingerprint(collect_fingerprint(trainer.world_size, trainer.num_nodes))
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_text("determinism/fingerprint", text, global_step=trainer.global_step)

    @override
    def on_train_batch_start(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any, batch_idx: int
    ) -> None:
        if self._pending_rng is not None:
            skipped = restore_rng_state(self._pending_rng)
            if skipped:
                rank_zero_warn(f"DeterminismCallback: could not restore {', '.join(skipped)}")
            self._pending_rng = None
        if self._pending_gradients is not None:  # the resume lands inside an accumulation window
            gradients, self._pending_gradients = self._pending_gradients, None
            missing = restore_gradients(pl_module, gradients)
            if missing:
                rank_zero_warn(f"DeterminismCallback: no parameter named {missing} to restore the gradient of")
            self._window_open = True
        if self._pending_logged is not None:
            logged, self._pending_logged = self._pending_logged, None
            if logged.get("epoch") == trainer.current_epoch:  # mid-epoch resume: continue the epoch's sums
                missing = restore_metric_modules(pl_module, logged)
                if missing:
                    rank_zero_warn(f"DeterminismCallback: no Metric module named {missing} to restore")
                self._pending_results = dict(logged.get("results", {}))
        if self.reseed_every_step:
            seed_everything_from(self.seed, "train", self._rank, trainer.current_epoch, batch_idx)

    @override
    def on_after_backward(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._window_open = True

    @override
    def on_before_optimizer_step(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", optimizer: torch.optim.Optimizer
    ) -> None:
        self._window_open = False  # the step consumes the window; the next window starts with zero_grad

    def on_replay_batch_start(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any, batch_idx: int, epoch: int
    ) -> None:
        """Before each replayed step (:class:`~deepep_lightning.protocols.ReplayAware`): the original step's reseed."""
        if self.reseed_every_step:
            seed_everything_from(self.seed, "train", self._rank, epoch, batch_idx)

    @override
    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._pending_results:
            merge_epoch_results(trainer, self._pending_results)
        if self.isolate_evaluation and not self.reseed_every_step:
            # validation may follow; its loader draws a base_seed before on_validation_start runs
            self._saved_train_rng = capture_rng_state()

    # ---------------------------------------------------------------- evaluation isolation
    @override
    def on_sanity_check_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self.isolate_evaluation:
            self._saved_train_rng = capture_rng_state()

    @override
    def on_sanity_check_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._put_back_train_rng()

    @override
    def on_validation_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self.isolate_evaluation:
            seed_everything_from(self.seed, "validation", self._rank, trainer.global_step)

    @override
    def on_validation_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if not trainer.sanity_checking:
            self._put_back_train_rng()

    def _put_back_train_rng(self) -> None:
        if self.isolate_evaluation and self._saved_train_rng is not None:
            restore_rng_state(self._saved_train_rng)
        self._saved_train_rng = None

    # ---------------------------------------------------------------- checkpoint
    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "version": _STATE_VERSION,
            "seed": self.seed,
            "rng": capture_rng_state(),
            "fingerprint": collect_fingerprint(self._world_size, self._num_nodes),
            "reseed_every_step": self.reseed_every_step,
            "logged": {},  # filled by on_save_checkpoint, which sees the trainer
        }

    @override
    def on_save_checkpoint(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", checkpoint: dict[str, Any]
    ) -> None:
        # state_dict() has no access to the trainer: take the logging snapshot here and store it
        logged = capture_logged_state(trainer, pl_module)
        state = checkpoint.get("callbacks", {}).get(self.state_key)
        if state is not None:
            state["logged"] = logged
            if trainer.train_dataloader is not None and len(self._own_loaders):
                flattened = CombinedLoader(trainer.train_dataloader, "max_size_cycle").flattened
                taken = take_loader_states(checkpoint, flattened, lambda loader: loader in self._own_loaders)
                if taken is not None:
                    state["train_loaders"] = taken
            if self._window_open:
                self._save_window_gradients(trainer, pl_module, state)
            state["digest"] = {
                "state": digest({k: v for k, v in state.items() if k != "digest"}),
                "model": model_digest(checkpoint.get("state_dict")),
            }

    @override
    def on_load_checkpoint(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", checkpoint: dict[str, Any]
    ) -> None:
        path = trainer.ckpt_path
        state = checkpoint.get("callbacks", {}).get(self.state_key)
        if state is None:
            rank_zero_warn(
                f"DeterminismCallback: the checkpoint {str(path)!r} holds no DeterminismCallback state (it was"
                " written without the plugin, or with save_weights_only): training resumes, but not bitwise"
                " equal to an uninterrupted run (no RNG states, no mid-epoch loader position, no seed check)."
            )
            return
        self._verify_digests(path, state, checkpoint)
        if state.get("train_loaders"):  # read by Lightning's loop restore, which runs after this hook
            put_back_loader_states(checkpoint, state["train_loaders"])

    def _save_window_gradients(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", state: dict[str, Any]
    ) -> None:
        """Store the open accumulation window's gradients in ``state``: one process, or one state per rank.

        Each rank accumulates its own gradients until the step; Lightning writes rank 0's callback
        states only, unless the strategy keeps every rank's (``per_rank_checkpoint_keys`` holding
        ``"callbacks"``, as :class:`~deepep_lightning.strategies.DeterministicDDPStrategy` does).
        """
        if trainer.world_size == 1 or "callbacks" in getattr(trainer.strategy, "per_rank_checkpoint_keys", ()):
            state["accumulated_gradients"] = capture_gradients(pl_module)
        elif not self._warned_window_under_ddp:
            self._warned_window_under_ddp = True
            rank_zero_warn(
                "DeterminismCallback: a checkpoint inside a gradient-accumulation window holds no gradients"
                f" with {trainer.world_size} processes (each rank accumulates its own until the step, and this"
                " strategy keeps rank 0's callback state only), so a resume from it is not exact. HINT:"
                " checkpoint at optimizer steps (ModelCheckpoint's every_n_train_steps does), or use"
                " strategy='ddp_deterministic', which keeps every rank's."
            )

    def _verify_digests(self, path: Any, state: dict[str, Any], checkpoint: dict[str, Any]) -> None:
        saved = state.get("digest")
        if not isinstance(saved, dict):
            return  # written before digests existed
        problems = []
        if saved.get("state") != digest({k: v for k, v in state.items() if k != "digest"}):
            problems.append("the DeterminismCallback state (RNG states, logged values)")
        current_model = model_digest(checkpoint.get("state_dict"))
        if saved.get("model") is not None and current_model is not None and saved["model"] != current_model:
            problems.append("the model's state_dict (weights)")
        if problems:
            raise CheckpointIntegrityError(
                f"DeterminismCallback: the checkpoint {str(path)!r} is corrupt: {' and '.join(problems)} no longer"
                " match the digest written with it. HINT: resume from an earlier checkpoint; for a checkpoint"
                " edited on purpose, delete checkpoint['callbacks']['DeterminismCallback']['digest']."
            )

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved_seed = state_dict.get("seed", self.seed)
        if saved_seed != self.seed:
            message = (
                f"DeterminismCallback: the checkpoint was written with seed={saved_seed!r}, resuming with {self.seed!r}"
            )
            if self.strict:
                raise MisconfigurationException(message + " (HINT: resume with the same seed)")
            rank_zero_warn(message)
        saved_fingerprint = state_dict.get("fingerprint")
        if saved_fingerprint:
            differences = diff_fingerprints(saved_fingerprint, collect_fingerprint(self._world_size, self._num_nodes))
            if differences:
                detail = "; ".join(f"{key}: {old!r} -> {new!r}" for key, old, new in _rows(differences))
                message = (
                    "DeterminismCallback: the checkpoint was written on a different stack, so the resumed run"
                    f" may not be bitwise equal to an uninterrupted one. Fields that differ: {detail}"
                )
                if self.strict:
                    raise FingerprintMismatchError(message)
                rank_zero_warn(message)
        if state_dict.get("logged"):
            self._pending_logged = state_dict["logged"]
        self._pending_gradients = state_dict.get("accumulated_gradients")
        if "rng" in state_dict:
            self._pending_rng = state_dict["rng"]
        else:
            rank_zero_info("DeterminismCallback: the checkpoint holds no RNG state; the RNGs are not restored")


def _lightning_global_seed() -> int | None:
    """``PL_GLOBAL_SEED`` as an int, or ``None`` when unset or not a non-negative integer."""
    value = os.environ.get("PL_GLOBAL_SEED")
    if value is None:
        return None
    try:
        seed = int(value)
    except ValueError:
        rank_zero_warn(f"DeterminismCallback: ignoring PL_GLOBAL_SEED={value!r}, which is not an integer")
        return None
    return seed if seed >= 0 else None


def _rows(differences: dict[str, tuple[str, str]]) -> list[tuple[str, str, str]]:
    return [(key, old, new) for key, (old, new) in differences.items()]
