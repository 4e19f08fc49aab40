"""DeterminismCallback: bitwise run-to-run reproducibility and exact (mid-epoch) resume for any module.

What it does, in hook order:

* ``__init__``: validates its arguments; nothing global changes (no seeding, no flags, no
  environment variables), so constructing the callback is free of side effects.
* ``setup``: settles the seed and says where it comes from
  (:mod:`~deepep_lightning.determinism.seed_source`); checks that the model was not initialised from
  an unseeded generator; calls ``configure`` unless the user already did with the same settings, and
  checks that it was in time for CUDA (:mod:`~deepep_lightning.determinism.configure_at_setup`;
  ``strict``: raise, naming what to move; otherwise warn); wraps the train DataLoader source so plain
  map-style loaders (torch ``DataLoader`` or torchdata ``StatefulDataLoader``) become
  :class:`~deepep_lightning.determinism.data.SeekableDataLoader`; any other ``StatefulDataLoader``
  keeps its own state, which Lightning checkpoints (:mod:`~deepep_lightning.determinism.train_loaders`).
* ``on_train_batch_start``: reseeds torch/numpy/random from ``(seed, "train", rank, epoch,
  batch_idx)``, so the training stream at any batch is a pure function of its position: nothing
  that runs between two batches (validation, sanity check, logging, a loader's ``base_seed``) can
  shift it, and a resume needs no replay. On the first batch after a resume it first restores the
  checkpointed RNG states (the only mechanism when ``reseed_every_step=False``).
* ``state_dict``: every RNG state (torch CPU, each CUDA device, numpy, python) as
  ``weights_only``-loadable values, plus the stack fingerprint and the device mesh (``None`` without one).
* ``on_after_backward`` / ``on_before_optimizer_step``: track whether an accumulation window is
  open (a backward since the last optimizer step: ``accumulate_grad_batches > 1``, or a manually
  optimised module that steps every few batches).
* ``on_save_checkpoint``: moves the positions of the loaders it built out of Lightning's
  ``combined_loader`` list into its own state, so that plain Lightning (no DeterminismCallback)
  resumes the checkpoint without "CombinedLoader has 0 stateful loaders" and
  ``load_from_checkpoint`` needs nothing from the plugin; stores the gradients of an open
  accumulation window (:mod:`~deepep_lightning.determinism.accumulation`; one process, or a
  strategy that keeps every rank's callback state);
  under a sharding strategy (``ModelParallelStrategy``: FSDP2, tensor parallel), every rank's RNG
  states, since rank 0 alone writes the callback states (:mod:`~deepep_lightning.determinism.sharded_resume`);
  then SHA-256 digests of its own state and of the model's ``state_dict`` (sharded: every rank's shards).
* ``on_load_checkpoint``: verifies those digests (a mismatch raises
  :class:`~deepep_lightning.determinism.checkpoint_integrity.CheckpointIntegrityError` naming the file)
  and warns when the checkpoint holds no state of this callback (written without it: the resume is
  not guaranteed exact); puts its loaders' positions back where Lightning's loop restore reads them.
  A file that cannot be read at all raises the same error, naming it. A checkpoint of another
  device mesh is refused first, naming both (:mod:`~deepep_lightning.determinism.sharded_resume`).
* ``load_state_dict``: compares the saved seed and fingerprint with the current ones
  (:mod:`~deepep_lightning.determinism.resume_checks`); a sharded checkpoint gives each rank its own RNG states.

Data order and per-batch streams follow the data-parallel rank (the ranks of one tensor-parallel
group see the same batch and the same random numbers).
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import CombinedLoader
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from deepep_lightning import _checks, _lightning_compat
from deepep_lightning._patches import patch_strategy_load_checkpoint, unpatch_strategy_load_checkpoint
from deepep_lightning.determinism.accumulation import window_gradients
from deepep_lightning.determinism.checkpoint_integrity import (
    gather_shard_digests,
    is_sharded_state,
    readable_checkpoint_loader,
)
from deepep_lightning.determinism.configuration import (
    CublasWorkspaceConfig,
    prime_cublas_and_release_env,
    validate_arguments,
)
from deepep_lightning.determinism.configure_at_setup import configure_at_setup, deterministic_flags
from deepep_lightning.determinism.data import put_back_loader_states, take_loader_states
from deepep_lightning.determinism.fingerprint import collect_fingerprint, format_fingerprint
from deepep_lightning.determinism.pending_resume import PendingResume
from deepep_lightning.determinism.results import capture_logged_state, merge_epoch_results
from deepep_lightning.determinism.resume_checks import (
    check_saved_fingerprint,
    check_saved_seed,
    stamp_digests,
    verify_digests,
    warn_without_state,
)
from deepep_lightning.determinism.rng import (
    capture_rng_state,
    restore_rng_state,
    seed_everything_from,
    unseeded_draws_before_first_seed,
)
from deepep_lightning.determinism.seed_source import check_seeded_before_model, resolve_seed, warn_if_seed_disagrees
from deepep_lightning.determinism.sharded_resume import (
    check_mesh_layout,
    data_parallel_position,
    gather_per_rank,
    mesh_layout,
    own_rank_value,
)
from deepep_lightning.determinism.train_loaders import make_train_loaders_seekable
from deepep_lightning.ops.routing import patch_refused_ops

__all__ = ["DeterminismCallback"]

log = logging.getLogger(__name__)

_STATE_VERSION = 1


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
        self.seed, self._seed_source = resolve_seed(seed)  # settled again at setup
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
        self._deterministic_flags_at_init = deterministic_flags()
        self._pending = PendingResume()  # filled by load_state_dict, put back at the first batch
        self._pending_results: dict[str, Any] = {}
        self._saved_train_rng: dict[str, Any] | None = None
        self._window_open = False  # a backward ran since the last optimizer step
        self._warned_window_under_ddp = False
        self._own_loaders: weakref.WeakSet[Any] = weakref.WeakSet()  # the SeekableDataLoaders made here
        self._original_source: Any = None
        self._wrapped_loader_of: Any = None
        self._rank = 0
        self._world_size = 1
        self._data_rank, self._data_size = 0, 1  # among the data-parallel replicas: what data and streams follow
        self._mesh: dict[str, int] | None = None
        self._num_nodes = 1
        self._drawn_unseeded_in_launcher = False

    def __getstate__(self) -> dict[str, Any]:
        # ddp_spawn pickles the callback (with the model) in the launching process: a spawned rank's fresh
        # generator cannot show that the weights were drawn there before any seed, so record it here
        state = self.__dict__.copy()
        state["_drawn_unseeded_in_launcher"] = self._drawn_unseeded_in_launcher or unseeded_draws_before_first_seed()
        state["_own_loaders"] = None  # a WeakSet does not pickle; each process makes its own loaders
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._own_loaders = weakref.WeakSet()

    def _settle_seed(self) -> None:
        self.seed, self._seed_source = resolve_seed(self._seed_argument)
        warn_if_seed_disagrees(self._seed_argument, self.seed)
        if not self._seed_announced:
            rank_zero_info(f"DeterminismCallback: seed {self.seed} (from {self._seed_source})")
            self._seed_announced = True

    # ---------------------------------------------------------------- setup / teardown
    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        self._rank, self._world_size = trainer.global_rank, trainer.world_size
        self._data_rank, self._data_size = data_parallel_position(trainer)
        self._mesh = mesh_layout(trainer)
        self._num_nodes = trainer.num_nodes
        self._settle_seed()
        check_seeded_before_model(self.strict, self._drawn_unseeded_in_launcher)
        configure_at_setup(
            self.seed, self._configure_kwargs, strict=self.strict, flags_at_init=self._deterministic_flags_at_init
        )
        if self.patch_refused_ops and self._routing_was_on is None:
            self._routing_was_on = patch_refused_ops(True)
        if stage == "fit" and not getattr(trainer.strategy.load_checkpoint, "__deepep_readable__", False):
            patch_strategy_load_checkpoint(trainer.strategy, readable_checkpoint_loader)  # teardown removes it
            self._wrapped_loader_of = trainer.strategy
        if stage == "fit" and self.seekable_data:
            original = _lightning_compat.wrap_train_dataloader_source(trainer, self._make_seekable)
            if original is not None:
                self._original_source = original

    @override
    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        self._undo_setup(trainer)

    @override
    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        # Lightning skips ``teardown`` when a stage raises: the routes, the loader source and the checkpoint
        # loader would stay patched in a process that goes on (a notebook, a sweep, the next test).
        self._undo_setup(trainer)

    def _undo_setup(self, trainer: "pl.Trainer") -> None:
        """Put back what :meth:`setup` changed in the process and the trainer (idempotent)."""
        if self._routing_was_on is not None:
            patch_refused_ops(self._routing_was_on)
            self._routing_was_on = None
        if self._original_source is not None:
            _lightning_compat.unwrap_train_dataloader_source(trainer, self._original_source)
            self._original_source = None
        if self._wrapped_loader_of is not None:
            unpatch_strategy_load_checkpoint(self._wrapped_loader_of)
            self._wrapped_loader_of = None

    def _make_seekable(self, loaders: Any) -> Any:
        return make_train_loaders_seekable(
            loaders,
            seed=self.seed,
            rank=self._data_rank,
            world_size=self._data_size,
            strict=self.strict,
            made=self._own_loaders,
            # the reseed before every batch overwrites what loading a batch leaves in the global RNGs
            restore_global_rng=not self.reseed_every_step,
        )

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
        window_restored, results = self._pending.apply(trainer, pl_module)
        if window_restored:
            self._window_open = True
        if results is not None:
            self._pending_results = results
        if self.reseed_every_step:
            seed_everything_from(self.seed, "train", self._data_rank, trainer.current_epoch, batch_idx)

    @property
    def window_open(self) -> bool:
        """Whether a gradient-accumulation window is open: a backward ran since the last optimizer step."""
        return self._window_open

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
            seed_everything_from(self.seed, "train", self._data_rank, epoch, batch_idx)

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
            seed_everything_from(self.seed, "validation", self._data_rank, trainer.global_step)

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
            "mesh": self._mesh,
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
                gradients = window_gradients(trainer, pl_module)
                if gradients is not None:
                    state["accumulated_gradients"] = gradients
                elif not self._warned_window_under_ddp:
                    self._warned_window_under_ddp = True
                    rank_zero_warn(
                        "DeterminismCallback: a checkpoint inside a gradient-accumulation window holds no"
                        f" gradients with {trainer.world_size} processes (each rank accumulates its own until the"
                        " step, and this strategy keeps rank 0's callback state only), so a resume from it is not"
                        " exact. HINT: checkpoint at optimizer steps (ModelCheckpoint's every_n_train_steps does),"
                        " or use strategy='ddp_deterministic', which keeps every rank's."
                    )
            if is_sharded_state(checkpoint.get("state_dict")):  # rank 0 alone writes the callback states
                state["rng_per_rank"] = gather_per_rank(state["rng"])
            stamp_digests(state, checkpoint, gather_shard_digests(checkpoint.get("state_dict")))

    @override
    def on_load_checkpoint(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", checkpoint: dict[str, Any]
    ) -> None:
        path = trainer.ckpt_path
        state = checkpoint.get("callbacks", {}).get(self.state_key)
        if state is None:
            warn_without_state(path)
            return
        check_mesh_layout(state.get("mesh"), self._mesh, self.strict)  # before the shards' digests: per mesh
        verify_digests(path, state, checkpoint, pl_module.state_dict(), trainer.global_rank, trainer.world_size)
        if state.get("train_loaders"):  # read by Lightning's loop restore, which runs after this hook
            put_back_loader_states(checkpoint, state["train_loaders"])

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        own_rng = own_rank_value(state_dict.get("rng_per_rank"), self._rank, self._world_size)
        if own_rng is not None:  # a sharded checkpoint: this rank's RNG, not rank 0's
            state_dict = {**state_dict, "rng": own_rng}
        check_saved_seed(state_dict.get("seed", self.seed), self.seed, self.strict)
        check_saved_fingerprint(state_dict.get("fingerprint"), self._world_size, self._num_nodes, self.strict)
        self._pending.load(state_dict)
