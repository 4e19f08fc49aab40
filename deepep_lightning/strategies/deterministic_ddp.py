"""DeterministicDDPStrategy: DDP whose runs repeat bit for bit (same stack, hardware and world size).

What it adds to Lightning's ``DDPStrategy``:

* **Communication**: the NCCL profile of :mod:`~deepep_lightning.determinism.nccl_profile` set
  before ``init_process_group`` (NVLS off, pinned algorithm/protocol); a fixed ``bucket_cap_mb``
  (PyTorch issue 30509: the bucket size changes the gradients' bits), ``gradient_as_bucket_view``
  (no copy, same numerics) and ``static_graph`` off unless asked for (it is safe only when every
  step uses the same parameters, as in a recurrent agent such as DeepEP in eager mode).
* **Data**: the ``DistributedSampler`` Lightning injects gets a seed derived from the run seed
  instead of ``PL_GLOBAL_SEED``, so a shard is a pure function of (seed, epoch, rank, world size)
  (:meth:`DeterministicDDPStrategy.shard`, :mod:`~deepep_lightning.strategies.train_data`).
* **Per-rank seeds**: after the process group starts, each rank seeds torch/numpy/random from
  ``derive_seed(seed, "rank", rank)`` (derived, not equal: augmentation and rollouts differ between
  ranks; DDP broadcasts rank 0's parameters at wrap time), and before every training step from
  ``derive_seed(seed, "micro", rank, global_step)`` (``reseed_every_step``); a module may draw from
  its own streams too (DeepEP's rollouts use ``derive_seed(seed, "rollout", rank, step)``).
* **Gradient sums in a fixed order** (``gradient_reduction="ordered"``, the default from three
  ranks on): DDP's all-reduce is replaced by :func:`~deepep_lightning.strategies.ordered_reduction.ordered_mean_hook`,
  which adds the ranks' gradients in rank order, so the bits depend on neither DDP's bucket layout
  (another one on the first step after every start and resume) nor the ring, hence not on the node
  layout either.
* **Multi-node**: seeds, shards, virtual ranks and the per-rank checkpoint entries are keyed by
  the *global* rank, so 2 nodes x 2 processes and 1 node x 4 processes are the same run; the
  fingerprint and the checkpoint record the node layout (``ddp.num_nodes``, ``ddp.node_layout``).
* **World-size invariance** (``virtual_world_size=K``, a power of two): a fixed micro-batch
  partition over virtual ranks, the micro-batch gradients added in virtual-rank order; 1, 2, ...,
  ``K`` processes give bitwise-equal weights (:mod:`~deepep_lightning.strategies.virtual_shards`,
  :mod:`~deepep_lightning.strategies.micro_batch_gradients`).
* **Clean exit**: the process group is destroyed at interpreter exit for every backend (Lightning
  does it for NCCL only); a gloo group left to finalization can abort a finished run with SIGABRT
  (:mod:`~deepep_lightning.strategies.process_group_exit`).
* **Checkpoints**: world size, seeds and the fingerprint (:mod:`~deepep_lightning.strategies.ddp_fingerprint`)
  go under ``checkpoint["deterministic_ddp"]`` with every rank's own copy of the rank-local keys
  (``per_rank_checkpoint_keys``, which Lightning takes from rank 0 alone:
  :mod:`~deepep_lightning.strategies.rank_state`). Another world size is refused; another layout of
  the same size continues the run (:mod:`~deepep_lightning.strategies.resume_layout`).

Scope of the promise: same stack, same hardware, same world size (or any world size dividing
``virtual_world_size``); across node layouts of one world size with ``gradient_reduction="ordered"``
(or with two ranks); never across GPU models or NCCL/PyTorch versions.

The health callbacks agree on their decisions across ranks (``reduce_boolean_decision``, an
all-reduce of the earliest bad step): a NaN on one rank makes every rank roll back in lockstep.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from deepep_lightning import _lightning_compat
from deepep_lightning.determinism.fingerprint import describe_layout
from deepep_lightning.determinism.nccl_profile import NcclAlgorithm, NcclProtocol, apply_nccl_profile
from deepep_lightning.determinism.rng import seed_everything_from, unseeded_draws_before_first_seed
from deepep_lightning.determinism.seed_source import resolve_seed
from deepep_lightning.determinism.streams import derive_seed
from deepep_lightning.protocols import ROLLOUT_STATE_KEY
from deepep_lightning.strategies.ddp_arguments import validate_arguments
from deepep_lightning.strategies.ddp_fingerprint import ddp_fingerprint, log_fingerprint
from deepep_lightning.strategies.gradient_reduction import (
    GradientReduction,
    install_gradient_reduction,
    resolve_gradient_reduction,
)
from deepep_lightning.strategies.micro_batch_gradients import MicroBatchGradients
from deepep_lightning.strategies.process_group_exit import destroy_process_group_at_exit
from deepep_lightning.strategies.rank_state import CHECKPOINT_KEY, apply_rank_state, build_rank_state
from deepep_lightning.strategies.resume_layout import check_resume_layout, warn_if_seed_differs, warn_without_record
from deepep_lightning.strategies.train_data import check_partition, distributed_shard, shard_train_loader
from deepep_lightning.strategies.virtual_shards import sampler_seed

__all__ = ["DESCRIPTION", "STRATEGY_NAME", "DeterministicDDPStrategy"]

#: Name and description of the registry entry.
STRATEGY_NAME = "ddp_deterministic"
DESCRIPTION = "DDP with pinned NCCL profile, seeded shards and per-rank seeds (deepep_lightning)"

log = logging.getLogger(__name__)


class DeterministicDDPStrategy(DDPStrategy):
    """DDP with a pinned communication profile, seeded shards, per-rank seeds and world-size checks.

    Args:
        seed: run seed; ``None`` takes ``PL_GLOBAL_SEED`` (``seed_everything``), else the seed of
            :func:`deepep_lightning.configure`, else 0.
        bucket_cap_mb: DDP bucket size, fixed and recorded (25 = PyTorch's default).
        gradient_as_bucket_view: gradients are views into the buckets (saves a copy, same bits).
        static_graph: DDP's static-graph mode; only when every step uses the same parameters.
        find_unused_parameters: DDP's flag (``True`` costs a graph traversal per step).
        nccl_algorithm: ``NCCL_ALGO`` of the profile: ``"Ring"`` or ``"Tree"``.
        nccl_protocol: ``NCCL_PROTO`` of the profile: ``"Simple"``, ``"LL"`` or ``"LL128"``.
        allow_world_size_change: resume from a checkpoint of another world size with a warning
            instead of an error (the resumed run is then not a continuation of the same one).
        per_rank_checkpoint_keys: top-level checkpoint keys each rank keeps its own copy of: the
            callbacks' states and the module's rollout state (``ROLLOUT_STATE_KEY``, written by a
            :class:`~deepep_lightning.protocols.RolloutStateful` module) by default.
        reseed_every_step: before every training step (micro-batch), reseed torch/numpy/random from
            ``derive_seed(seed, "micro", virtual_rank, global_step)``: the step's randomness is a
            pure function of its position, also in rollback replays and after a resume.
        gradient_reduction: how DDP averages the gradients. ``"ordered"``: gather every rank's
            bucket and add them in rank order (bits independent of the bucket layout, restarts and
            the node layout; ``world_size / 2`` times the all-reduce traffic). ``"allreduce"``:
            DDP's own all-reduce (exact across restarts only up to two ranks). ``"auto"``:
            ``"ordered"`` from three ranks on, ``"allreduce"`` below (where both are exact), or
            the ``ddp_comm_hook`` you pass.
        virtual_world_size: world-size-invariant mode (``None``: off). The data is split over this
            many virtual ranks whatever the number of processes ``W``; each process accumulates
            ``virtual_world_size / W`` micro-batches (set ``accumulate_grad_batches`` to that). With
            ``virtual_world_size=4``, 1, 2 and 4 processes give bitwise-equal weights (a plain module
            under automatic optimisation; see :mod:`~deepep_lightning.strategies.virtual_shards`; DeepEP
            runs its rollouts per virtual rank, :mod:`~deepep_lightning.deepep.virtual_ranks`).
        **kwargs: passed to :class:`~lightning.pytorch.strategies.DDPStrategy` (and DDP).

    Raises:
        MisconfigurationException: an argument has a wrong type or value.

    Example::

        import deepep_lightning  # the import registers "ddp_deterministic"
        Trainer(accelerator="gpu", devices=2, strategy="ddp_deterministic")
        Trainer(strategy=DeterministicDDPStrategy(bucket_cap_mb=50, static_graph=True))
    """

    strategy_name = STRATEGY_NAME

    def __init__(
        self,
        *,
        seed: int | None = None,
        bucket_cap_mb: float = 25.0,
        gradient_as_bucket_view: bool = True,
        static_graph: bool = False,
        find_unused_parameters: bool = False,
        nccl_algorithm: NcclAlgorithm = "Ring",
        nccl_protocol: NcclProtocol = "Simple",
        allow_world_size_change: bool = False,
        per_rank_checkpoint_keys: Sequence[str] = ("callbacks", ROLLOUT_STATE_KEY),
        reseed_every_step: bool = True,
        gradient_reduction: GradientReduction = "auto",
        virtual_world_size: int | None = None,
        **kwargs: Any,
    ) -> None:
        comm_hook = kwargs.get("ddp_comm_hook")
        keys = validate_arguments(
            seed,
            bucket_cap_mb,
            nccl_algorithm,
            nccl_protocol,
            gradient_reduction,
            comm_hook,
            per_rank_checkpoint_keys,
            virtual_world_size,
            flags={
                "gradient_as_bucket_view": gradient_as_bucket_view,
                "static_graph": static_graph,
                "find_unused_parameters": find_unused_parameters,
                "allow_world_size_change": allow_world_size_change,
                "reseed_every_step": reseed_every_step,
            },
        )
        super().__init__(
            bucket_cap_mb=bucket_cap_mb,
            gradient_as_bucket_view=gradient_as_bucket_view,
            static_graph=static_graph,
            find_unused_parameters=find_unused_parameters,
            **kwargs,
        )
        self._seed_arg = seed
        self.nccl_algorithm: NcclAlgorithm = nccl_algorithm
        self.nccl_protocol: NcclProtocol = nccl_protocol
        self.allow_world_size_change = allow_world_size_change
        self.per_rank_checkpoint_keys = keys
        self.reseed_every_step = reseed_every_step
        self.virtual_world_size = virtual_world_size
        self.gradient_reduction: GradientReduction = gradient_reduction
        self.seed: int | None = seed
        self.rank_seed: int | None = None
        self.nccl_env: dict[str, str] = {}
        self._micro_gradients: MicroBatchGradients | None = None
        self._micro_index = 0

    # ---------------------------------------------------------------- registration
    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``"ddp_deterministic"`` (idempotent: an existing entry is replaced by the same).

        Runs once, when :mod:`deepep_lightning.strategies` is imported (``import deepep_lightning``
        does it), so ``Trainer(strategy="ddp_deterministic")`` works after that import.
        """
        strategy_registry.register(cls.strategy_name, cls, description=DESCRIPTION, override=True)

    # ---------------------------------------------------------------- process group
    @override
    def setup_distributed(self) -> None:
        self.seed = resolve_seed(self._seed_arg)[0]
        if "nccl" in _lightning_compat.requested_process_group_backend(self):
            self.nccl_env, _ = apply_nccl_profile(self.nccl_algorithm, self.nccl_protocol)
        super().setup_distributed()  # Lightning's reset_seed(), ranks, init_process_group
        destroy_process_group_at_exit()  # a gloo group left to finalization can abort the process
        if unseeded_draws_before_first_seed():
            # the per-rank seeds below come too late for weights drawn already; DeterminismCallback
            # (strict=True) refuses the run at its setup, as it does in one process
            rank_zero_warn(
                "ddp_deterministic: torch's default generator drew numbers (the model's initial weights, most"
                " likely) before any seed was set, so two runs start from different weights. HINT: call"
                " `lightning.pytorch.seed_everything(seed)` before building the model."
            )
        self.rank_seed = seed_everything_from(self.seed, "rank", self.global_rank)
        log.debug("rank %d seeded with %d", self.global_rank, self.rank_seed)

    @property
    def run_seed(self) -> int:
        """The run seed: settled when the process group starts, before that the callback's rule
        (the ``seed`` argument, else ``PL_GLOBAL_SEED``, else :func:`configure`'s seed, else 0)."""
        return self.seed if self.seed is not None else resolve_seed(self._seed_arg)[0]

    @property
    def rank_seeds(self) -> list[int]:
        """The seed of every rank (a pure function of the run seed and the rank)."""
        return [derive_seed(self.run_seed, "rank", rank) for rank in range(self.world_size)]

    @property
    def node_layout(self) -> str:
        """``"<nodes> node(s) x <processes> process(es)"``: how the world size is laid out over machines."""
        return describe_layout(self.num_nodes, self.num_processes)

    @property
    def resolved_gradient_reduction(self) -> str:
        """``gradient_reduction`` with ``"auto"`` decided: ``"ordered"``, ``"allreduce"`` or ``"ddp_comm_hook"``."""
        hook = _lightning_compat.ddp_comm_hook(self)
        return resolve_gradient_reduction(self.gradient_reduction, hook, self.world_size)

    @override
    def configure_ddp(self) -> None:
        super().configure_ddp()  # Lightning registers a ddp_comm_hook on CUDA only
        if not isinstance(self.model, DistributedDataParallel):
            return
        micro_gradients = install_gradient_reduction(
            self.model,
            self.lightning_module,
            micro_batches_per_step=self.micro_batches_per_step,
            world_size=self.world_size,
            resolved=self.resolved_gradient_reduction,
        )
        if micro_gradients is not None:
            self._micro_gradients = micro_gradients

    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        super().post_backward(closure_loss)
        if self._micro_gradients is None:
            return
        self._micro_gradients.keep(self._micro_index)
        if self._micro_index == self.micro_batches_per_step - 1:
            self._micro_gradients.reduce_into_grads()

    @property
    def sampler_seed(self) -> int:
        """``seed`` given to ``DistributedSampler`` (it draws epoch ``e`` from ``sampler_seed + e``)."""
        return sampler_seed(self.run_seed)

    # ---------------------------------------------------------------- per-step streams, virtual ranks
    @property
    def micro_batches_per_step(self) -> int:
        """Micro-batches each process accumulates per optimizer step (1 unless world-size invariant)."""
        if self.virtual_world_size is None:
            return 1
        return max(self.virtual_world_size // self.world_size, 1)

    def virtual_rank(self, batch_idx: int) -> int:
        """The virtual rank whose micro-batch ``batch_idx`` is (the rank itself by default)."""
        per_process = self.micro_batches_per_step
        return self.global_rank * per_process + batch_idx % per_process

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        self.check_partition(trainer)
        super().setup(trainer)

    def check_partition(self, trainer: "pl.Trainer") -> None:
        """World-size-invariant mode: ``virtual_world_size`` fits the world size and the accumulation.

        Raises:
            MisconfigurationException: it does not.
        """
        if self.virtual_world_size is not None:
            check_partition(self.virtual_world_size, self.world_size, trainer.accumulate_grad_batches)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        trainer = _lightning_compat.attached_trainer(self.lightning_module)
        batch_idx = args[1] if len(args) > 1 and isinstance(args[1], int) else kwargs.get("batch_idx", 0)
        self._micro_index = batch_idx % self.micro_batches_per_step
        if self.reseed_every_step and trainer is not None:
            seed_everything_from(self.seed or 0, "micro", self.virtual_rank(batch_idx), trainer.global_step)
        return super().training_step(*args, **kwargs)

    # ---------------------------------------------------------------- data
    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {**super().distributed_sampler_kwargs, "seed": self.sampler_seed}

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        trainer = _lightning_compat.attached_trainer(self.lightning_module)
        loader = shard_train_loader(
            dataloader,
            training=trainer is not None and trainer.training,
            virtual_world_size=self.virtual_world_size,
            micro_batches_per_step=self.micro_batches_per_step,
            world_size=self.world_size,
            rank=self.global_rank,
            seed=self.seed or 0,
        )
        return super().process_dataloader(loader)

    #: The indices ``rank`` sees in ``epoch`` (:func:`~deepep_lightning.strategies.train_data.distributed_shard`).
    shard = staticmethod(distributed_shard)

    # ---------------------------------------------------------------- fingerprint
    def fingerprint(self) -> dict[str, str]:
        """Everything about the communication and data layout that changes bits, as strings."""
        return ddp_fingerprint(self)

    @override
    def on_train_start(self) -> None:
        """Log the fingerprint (rank 0); a resume from an epoch-end checkpoint starts the next epoch.

        With ``max_steps`` set, Lightning re-enters the finished epoch of a checkpoint written in
        ``on_train_epoch_end`` and trains one extra batch, stepping on it alone: a batch the
        uninterrupted run never trains, and in world-size-invariant mode a step of one micro-batch
        instead of ``virtual_world_size / world_size``
        (:func:`~deepep_lightning._lightning_compat.finish_restored_epoch`).
        """
        super().on_train_start()
        trainer = _lightning_compat.attached_trainer(self.lightning_module)
        if trainer is not None and _lightning_compat.finish_restored_epoch(trainer):
            log.debug("resumed at an epoch's end: epoch %d starts", trainer.current_epoch)
        if trainer is None or not trainer.is_global_zero:
            return
        log_fingerprint(trainer, self.fingerprint())

    # ---------------------------------------------------------------- checkpoints
    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        # every rank runs this (Trainer.save_checkpoint), so the gather inside is collective
        checkpoint[CHECKPOINT_KEY] = build_rank_state(
            checkpoint,
            self.per_rank_checkpoint_keys,
            self.world_size,
            num_nodes=self.num_nodes,
            processes_per_node=self.num_processes,
            gradient_reduction=self.resolved_gradient_reduction,
            seed=self.seed,
            sampler_seed=self.sampler_seed,
            rank_seeds=self.rank_seeds,
            fingerprint=self.fingerprint(),
        )
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def check_resume(self, state: dict[str, Any]) -> None:
        """Refuse (or, with ``allow_world_size_change``, warn about) a checkpoint of another world size.

        Another node layout of the same world size resumes the same run (seeds, shards and per-rank
        state are keyed by the global rank); only NCCL's own all-reduce (``gradient_reduction=
        "allreduce"`` from three ranks on) may then sum in another ring order, which is said in a warning.

        Raises:
            WorldSizeMismatchError: the saved world size differs from this run's.
        """
        check_resume_layout(
            state,
            world_size=self.world_size,
            num_nodes=self.num_nodes,
            node_layout=self.node_layout,
            allow_world_size_change=self.allow_world_size_change,
            ring_dependent=self.resolved_gradient_reduction != "ordered" and self.world_size > 2,
            backend=str(_lightning_compat.process_group_backend(self)),
        )

    @override
    def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        # *args/**kwargs: Lightning 2.6 passes ``weights_only``; older versions do not
        checkpoint = super().load_checkpoint(checkpoint_path, *args, **kwargs)
        state = checkpoint.get(CHECKPOINT_KEY)
        if state is None:
            warn_without_record()
            return checkpoint
        self.check_resume(state)
        warn_if_seed_differs(state.get("seed"), self.run_seed)
        apply_rank_state(checkpoint, state, self.global_rank, self.world_size)
        return checkpoint
