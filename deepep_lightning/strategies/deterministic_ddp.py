"""DeterministicDDPStrategy: DDP whose runs repeat bit for bit (same stack, hardware and world size).

What it adds to Lightning's ``DDPStrategy``:

* **Communication**: the NCCL profile of :mod:`~deepep_lightning.determinism.nccl_profile` set
  before ``init_process_group`` (NVLS off, pinned algorithm/protocol); a fixed ``bucket_cap_mb``
  (PyTorch issue 30509: the bucket size changes the gradients' bits), ``gradient_as_bucket_view``
  (no copy, same numerics) and ``static_graph`` off unless asked for (it is safe only when every
  step uses the same parameters, as in a recurrent agent such as DeepEP in eager mode).
* **Data**: the ``DistributedSampler`` Lightning injects gets ``seed=derive_seed(seed, "sampler")``
  instead of ``PL_GLOBAL_SEED``, so a shard is a pure function of (seed, epoch, rank, world size)
  (:meth:`DeterministicDDPStrategy.shard`); Lightning calls ``set_epoch`` every epoch.
* **Per-rank seeds**: after the process group starts, each rank seeds torch/numpy/random from
  ``derive_seed(seed, "rank", rank)`` (derived, not equal: augmentation and rollouts differ between
  ranks; parameters are still equal, DDP broadcasts rank 0's at wrap time), and before every
  training step from ``derive_seed(seed, "micro", rank, global_step)`` (``reseed_every_step``): a
  step's randomness is then a pure function of its position, in rollback replays and resumes too.
  A module may also draw from its own streams (DeepEP's rollouts use
  ``derive_seed(seed, "rollout", rank, step)``).
* **Gradient sums in a fixed order** (``gradient_reduction="ordered"``, the default from three
  ranks on): DDP's all-reduce is replaced by :func:`~deepep_lightning.strategies.ordered_reduction.ordered_mean_hook`,
  which adds the ranks' gradients in rank order. A ring all-reduce of three or more ranks sums an
  element in an order set by its offset in DDP's bucket, and DDP reduces the first step after it
  wraps the model (after every start and resume) with another bucket layout than later steps, so
  without it a resumed run of 3+ ranks differs from the uninterrupted one from its first step. With
  it the bits depend on neither the bucket layout nor the ring, hence not on the node layout either.
* **Multi-node**: seeds, shards, virtual ranks and the per-rank checkpoint entries are keyed by
  the *global* rank, so 2 nodes x 2 processes and 1 node x 4 processes are the same run; the
  fingerprint and the checkpoint record the node layout (``ddp.num_nodes``, ``ddp.node_layout``).
* **World-size invariance** (``virtual_world_size=K``, a power of two): a fixed micro-batch
  partition over virtual ranks, and the micro-batch gradients added in virtual-rank order; 1, 2, ...,
  ``K`` processes give bitwise-equal weights (:mod:`~deepep_lightning.strategies.virtual_shards`).
  With ``K`` processes it is the default layout; fewer processes pay the extra micro-batches and,
  when they accumulate, a flat copy of the gradients per micro-batch
  (:mod:`~deepep_lightning.strategies.micro_batch_gradients`).
* **Checkpoints**: world size, seeds and the fingerprint are stored with the data state under
  ``checkpoint["deterministic_ddp"]``, together with every rank's own copy of the rank-local keys
  (``per_rank_checkpoint_keys``: callback states and the module's rollout state under
  :data:`~deepep_lightning.protocols.ROLLOUT_STATE_KEY`), which Lightning would
  otherwise take from rank 0 alone (:mod:`~deepep_lightning.strategies.rank_state`). A resume with
  a different world size is refused with a message naming both node layouts; a resume on another
  layout of the same world size (2 nodes x 2 -> 1 node x 4) continues the same run.

Scope of the promise: same stack, same hardware, same world size (or any world size dividing
``virtual_world_size``); across node layouts of one world size with ``gradient_reduction="ordered"``
(or with two ranks); never across GPU models or NCCL/PyTorch versions.

Health and rollback decisions are agreed across ranks by the health callbacks through
:meth:`reduce_boolean_decision` and an all-reduce of the earliest bad step, so a NaN on one rank
makes every rank restore the same snapshot and replay in lockstep.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any, Literal, cast

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from deepep_lightning import _checks, _lightning_compat
from deepep_lightning.determinism.fingerprint import describe_layout
from deepep_lightning.determinism.nccl_profile import (
    ALLOWED_ALGORITHMS,
    ALLOWED_PROTOCOLS,
    NcclAlgorithm,
    NcclProtocol,
    apply_nccl_profile,
)
from deepep_lightning.determinism.rng import seed_everything_from
from deepep_lightning.determinism.streams import derive_seed
from deepep_lightning.protocols import ROLLOUT_STATE_KEY
from deepep_lightning.strategies.micro_batch_gradients import MicroBatchGradients
from deepep_lightning.strategies.ordered_reduction import ordered_mean_hook
from deepep_lightning.strategies.rank_state import (
    CHECKPOINT_KEY,
    apply_rank_state,
    build_rank_state,
    check_world_size,
    resolve_run_seed,
)
from deepep_lightning.strategies.virtual_shards import VirtualShardSampler, sampler_seed

__all__ = ["DESCRIPTION", "GRADIENT_REDUCTIONS", "STRATEGY_NAME", "DeterministicDDPStrategy"]

#: Name and description of the registry entry.
STRATEGY_NAME = "ddp_deterministic"
DESCRIPTION = "DDP with pinned NCCL profile, seeded shards and per-rank seeds (deepep_lightning)"

log = logging.getLogger(__name__)

GradientReduction = Literal["auto", "ordered", "allreduce"]
#: Values of ``gradient_reduction``.
GRADIENT_REDUCTIONS: tuple[str, ...] = ("auto", "ordered", "allreduce")


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
        owner = "DeterministicDDPStrategy"
        _checks.non_negative_int(owner, "seed", seed, allow_none=True)
        _checks.number(owner, "bucket_cap_mb", bucket_cap_mb, minimum=0, exclusive_minimum=True)
        _checks.choice(
            owner,
            "nccl_algorithm",
            nccl_algorithm,
            ALLOWED_ALGORITHMS,
            hint="NVLS and CollNet reduce inside the switch in an unspecified order",
        )
        _checks.choice(owner, "nccl_protocol", nccl_protocol, ALLOWED_PROTOCOLS)
        _checks.choice(owner, "gradient_reduction", gradient_reduction, GRADIENT_REDUCTIONS)
        if gradient_reduction == "ordered" and kwargs.get("ddp_comm_hook") is not None:
            raise MisconfigurationException(
                f"`DeterministicDDPStrategy(gradient_reduction='ordered')` registers its own DDP communication hook,"
                f" so it cannot take `ddp_comm_hook={kwargs['ddp_comm_hook']!r}` too. HINT: pass"
                " gradient_reduction='auto' to use your hook."
            )
        keys = _checks.str_sequence(owner, "per_rank_checkpoint_keys", per_rank_checkpoint_keys)
        _checks.positive_int(owner, "virtual_world_size", virtual_world_size, allow_none=True)
        for name, flag in (
            ("gradient_as_bucket_view", gradient_as_bucket_view),
            ("static_graph", static_graph),
            ("find_unused_parameters", find_unused_parameters),
            ("allow_world_size_change", allow_world_size_change),
            ("reseed_every_step", reseed_every_step),
        ):
            _checks.strict_bool(owner, name, flag)
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
        self.seed = resolve_run_seed(self._seed_arg)
        if "nccl" in _lightning_compat.requested_process_group_backend(self):
            self.nccl_env, _ = apply_nccl_profile(self.nccl_algorithm, self.nccl_protocol)
        super().setup_distributed()  # Lightning's reset_seed(), ranks, init_process_group
        self.rank_seed = seed_everything_from(self.seed, "rank", self.global_rank)
        log.debug("rank %d seeded with %d", self.global_rank, self.rank_seed)

    @property
    def rank_seeds(self) -> list[int]:
        """The seed of every rank (a pure function of the run seed and the rank)."""
        seed = resolve_run_seed(self._seed_arg) if self.seed is None else self.seed
        return [derive_seed(seed, "rank", rank) for rank in range(self.world_size)]

    @property
    def node_layout(self) -> str:
        """``"<nodes> node(s) x <processes> process(es)"``: how the world size is laid out over machines."""
        return describe_layout(self.num_nodes, self.num_processes)

    @property
    def resolved_gradient_reduction(self) -> str:
        """``gradient_reduction`` with ``"auto"`` decided: ``"ordered"``, ``"allreduce"`` or ``"ddp_comm_hook"``."""
        if self.gradient_reduction != "auto":
            return self.gradient_reduction
        if _lightning_compat.ddp_comm_hook(self) is not None:
            return "ddp_comm_hook"
        return "ordered" if self.world_size > 2 else "allreduce"

    @override
    def configure_ddp(self) -> None:
        super().configure_ddp()  # Lightning registers a ddp_comm_hook on CUDA only
        if not isinstance(self.model, DistributedDataParallel):
            return
        module = self.lightning_module
        if self.micro_batches_per_step > 1 and module is not None and module.automatic_optimization:
            # world-size-invariant accumulation: the micro-batches are added in virtual-rank order by
            # MicroBatchGradients, so DDP's own all-reduce stays off (no_sync restores this flag)
            self._micro_gradients = MicroBatchGradients(
                list(module.parameters()), self.micro_batches_per_step, self.world_size
            )
            self.model.require_backward_grad_sync = False
        elif self.resolved_gradient_reduction == "ordered":
            self.model.register_comm_hook(None, ordered_mean_hook)

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
        seed = resolve_run_seed(self._seed_arg) if self.seed is None else self.seed
        return sampler_seed(seed)

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
        if self.virtual_world_size is None:
            return
        if self.virtual_world_size % self.world_size:
            raise MisconfigurationException(
                f"`DeterministicDDPStrategy(virtual_world_size={self.virtual_world_size!r})` must be a multiple of the"
                f" world size {self.world_size}"
            )
        if trainer.accumulate_grad_batches != self.micro_batches_per_step:
            raise MisconfigurationException(
                f"`Trainer(accumulate_grad_batches=...)` must be virtual_world_size / world_size ="
                f" {self.micro_batches_per_step} in world-size-invariant mode, got {trainer.accumulate_grad_batches!r}"
                f" (HINT: the global batch is {self.virtual_world_size} micro-batches whatever the device count)"
            )

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
        sampler = getattr(dataloader, "sampler", None)
        if self._needs_virtual_shards(dataloader):
            return super().process_dataloader(self._virtual_shard_loader(dataloader))
        self._check_virtual_sampler(sampler)
        if isinstance(sampler, torch.utils.data.DistributedSampler) and self.world_size > 1:
            if sampler.num_replicas != self.world_size or sampler.rank != self.global_rank:
                raise MisconfigurationException(
                    f"DeterministicDDPStrategy: a DistributedSampler with num_replicas={sampler.num_replicas!r},"
                    f" rank={sampler.rank!r} runs on rank {self.global_rank} of {self.world_size}."
                    " HINT: let Lightning create the sampler (return a plain DataLoader), or build it from"
                    " `trainer.strategy.distributed_sampler_kwargs`."
                )
        return super().process_dataloader(dataloader)

    def _check_virtual_sampler(self, sampler: Any) -> None:
        """World-size-invariant mode splits only Lightning's own ``DistributedSampler`` over the virtual ranks.

        Another sampler (e.g. the ``SeekableSampler`` of ``DeterminismCallback(seekable_data=True)``)
        would be split over the processes instead, so the global batch would change with their number.
        """
        trainer = _lightning_compat.attached_trainer(self.lightning_module)
        if self.virtual_world_size is None or trainer is None or not trainer.training or sampler is None:
            return
        if isinstance(sampler, VirtualShardSampler) or type(sampler) is torch.utils.data.DistributedSampler:
            return
        raise MisconfigurationException(
            f"`DeterministicDDPStrategy(virtual_world_size={self.virtual_world_size!r})` splits the train data over"
            f" virtual ranks through Lightning's DistributedSampler, but the train loader's sampler is a"
            f" {type(sampler).__name__}, whose shards would follow the {self.world_size} process(es) instead."
            " HINT: return a plain DataLoader (Lightning adds the sampler); with DeterminismCallback, pass"
            " seekable_data=False."
        )

    def _needs_virtual_shards(self, dataloader: Any) -> bool:
        trainer = _lightning_compat.attached_trainer(self.lightning_module)
        return (
            self.micro_batches_per_step > 1
            and type(getattr(dataloader, "sampler", None)) is torch.utils.data.DistributedSampler  # Lightning's
            and trainer is not None
            and trainer.training
        )

    def _virtual_shard_loader(self, dataloader: Any) -> Any:
        assert self.virtual_world_size is not None  # _needs_virtual_shards
        if dataloader.batch_size is None:
            raise MisconfigurationException(
                "DeterministicDDPStrategy(virtual_world_size=...) needs a DataLoader with a batch_size,"
                " got batch_size=None"
            )
        try:
            sampler = VirtualShardSampler(
                dataloader.dataset,
                virtual_world_size=self.virtual_world_size,
                num_replicas=self.world_size,
                rank=self.global_rank,
                batch_size=dataloader.batch_size,
                seed=self.seed or 0,
                shuffle=dataloader.sampler.shuffle,
            )
        except ValueError as error:
            raise MisconfigurationException(f"DeterministicDDPStrategy: {error}") from error
        return _lightning_compat.update_dataloader(dataloader, sampler)

    @staticmethod
    def shard(
        num_samples: int,
        seed: int,
        epoch: int,
        rank: int,
        world_size: int,
        shuffle: bool = True,
        drop_last: bool = False,
    ) -> list[int]:
        """The indices ``rank`` sees in ``epoch``: what the injected ``DistributedSampler`` yields.

        ``seed`` is the run seed (the sampler's own seed is derived from it).
        """
        sampler: torch.utils.data.DistributedSampler[int] = torch.utils.data.DistributedSampler(
            cast("torch.utils.data.Dataset[int]", range(num_samples)),
            num_replicas=world_size,
            rank=rank,
            shuffle=shuffle,
            seed=sampler_seed(seed),
            drop_last=drop_last,
        )
        sampler.set_epoch(epoch)
        return list(sampler)

    # ---------------------------------------------------------------- fingerprint
    def fingerprint(self) -> dict[str, str]:
        """Everything about the communication and data layout that changes bits, as strings."""
        kwargs = _lightning_compat.ddp_kwargs(self)
        comm_hook = _lightning_compat.ddp_comm_hook(self)
        record = {
            "ddp.strategy": type(self).__name__,
            "ddp.backend": str(_lightning_compat.process_group_backend(self) or "<not started>"),
            "ddp.world_size": str(self.world_size),
            "ddp.num_nodes": str(self.num_nodes),
            "ddp.node_layout": self.node_layout,
            "ddp.cluster_environment": type(self.cluster_environment).__name__,
            "ddp.gradient_reduction": self.resolved_gradient_reduction,
            "ddp.bucket_cap_mb": str(kwargs.get("bucket_cap_mb")),
            "ddp.gradient_as_bucket_view": str(kwargs.get("gradient_as_bucket_view")),
            "ddp.static_graph": str(kwargs.get("static_graph")),
            "ddp.find_unused_parameters": str(kwargs.get("find_unused_parameters")),
            "ddp.broadcast_buffers": str(kwargs.get("broadcast_buffers", True)),
            "ddp.comm_hook": getattr(comm_hook, "__qualname__", str(comm_hook)),
            "ddp.nccl_algorithm": self.nccl_algorithm,
            "ddp.nccl_protocol": self.nccl_protocol,
            "ddp.seed": str(self.seed),
            "ddp.sampler_seed": str(self.sampler_seed),
            "ddp.rank_seeds": json.dumps(self.rank_seeds),
            "ddp.reseed_every_step": str(self.reseed_every_step),
            "ddp.virtual_world_size": str(self.virtual_world_size),
            "torch": str.__str__(str(torch.__version__)),
        }
        for name, value in self.nccl_env.items():
            record[f"env.{name}"] = value
        return record

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
        record = self.fingerprint()
        rank_zero_info("DeterministicDDPStrategy: " + ", ".join(f"{k}={v}" for k, v in record.items()))
        from lightning.pytorch.loggers import TensorBoardLogger

        text = "\n".join(["| field | value |", "|---|---|", *(f"| {k} | {v} |" for k, v in sorted(record.items()))])
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_text("ddp/fingerprint", text, global_step=trainer.global_step)

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
        check_world_size(state, self.world_size, self.allow_world_size_change, num_nodes=self.num_nodes)
        saved_nodes = state.get("num_nodes")
        same_size = int(state.get("world_size", 0)) == self.world_size
        if saved_nodes is None or int(saved_nodes) == self.num_nodes or not same_size:
            return
        saved_layout = describe_layout(int(saved_nodes), self.world_size // int(saved_nodes))
        message = f"DeterministicDDPStrategy: resuming a run of {saved_layout} on {self.node_layout}"
        ring_dependent = self.resolved_gradient_reduction != "ordered" and self.world_size > 2
        if ring_dependent and "nccl" in str(_lightning_compat.process_group_backend(self)):
            rank_zero_warn(
                message + ": NCCL's all-reduce may build another ring on another topology, so the gradients' bits"
                " may differ from the uninterrupted run. HINT: `gradient_reduction='ordered'` sums in rank order."
            )
        else:
            rank_zero_info(message + " (same world size: the same run continues)")

    @override
    def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        # *args/**kwargs: Lightning 2.6 passes ``weights_only``; older versions do not
        checkpoint = super().load_checkpoint(checkpoint_path, *args, **kwargs)
        state = checkpoint.get(CHECKPOINT_KEY)
        if state is None:
            rank_zero_warn(
                "DeterministicDDPStrategy: the checkpoint has no world-size record (not written by this strategy);"
                " a world-size change cannot be detected and rank-local state comes from rank 0."
            )
            return checkpoint
        self.check_resume(state)
        saved_seed = state.get("seed")
        current_seed = resolve_run_seed(self._seed_arg) if self.seed is None else self.seed
        if saved_seed is not None and saved_seed != current_seed:
            rank_zero_warn(
                f"DeterministicDDPStrategy: the checkpoint's seed is {saved_seed!r}, this run's is {current_seed!r}"
            )
        apply_rank_state(checkpoint, state, self.global_rank, self.world_size)
        return checkpoint
