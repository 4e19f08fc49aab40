"""DeepEPModule: the DeepEP agent trained on-policy by Lightning.

The class holds the Lightning hooks and the logging; its collaborators own the rest: the configuration
(:mod:`~deepep_lightning.deepep.config`), this process's rollout states
(:class:`~deepep_lightning.deepep.virtual_ranks.ProcessRollouts`), one rollout and its loss as a function
(:func:`~deepep_lightning.deepep.rollout_loss.rollout_and_loss`), the CUDA-graph step
(:class:`~deepep_lightning.deepep.graph_training.GraphTraining`), the optimizer
(:func:`~deepep_lightning.deepep.optimizer.deepep_optimizer`) and the progress bar's values
(:class:`~deepep_lightning.deepep.progress.ProgressLog`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from collections.abc import Iterator
from typing import Any, cast

import lightning.pytorch as pl
import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from torch.utils.data import DataLoader
from typing_extensions import override

from deepep_lightning.deepep.config import (
    DeepEPConfig,
    EnvConfig,
    ExecutionConfig,
    LossConfig,
    NetworkConfig,
    OptimConfig,
    group_fields,
)
from deepep_lightning.deepep.envs.registry import make_env
from deepep_lightning.deepep.episode_return import EpisodeReturnMean, RollingEpisodeReturn
from deepep_lightning.deepep.graph_training import GraphTraining
from deepep_lightning.deepep.greedy_evaluation import greedy_returns
from deepep_lightning.deepep.optimizer import deepep_optimizer
from deepep_lightning.deepep.progress import ProgressLog
from deepep_lightning.deepep.rollout_loss import fused_bptt_on, fused_rollout_on, rollout_and_loss
from deepep_lightning.deepep.rollout_state import RolloutState, step_indices
from deepep_lightning.deepep.virtual_ranks import (
    ProcessRollouts,
    check_virtual_support,
    ordered_mean,
    virtual_layout,
)
from deepep_lightning.protocols import ROLLOUT_STATE_KEY, AuditLevel, attached_trainer, monitored_metrics

__all__ = ["DeepEPModule"]

log = logging.getLogger(__name__)

#: The loss terms logged as ``train/<name>`` at every step.
SCALARS = ("loss", "policy_loss", "value_loss", "entropy")

#: Episodes in the rolling mean return (``train/episode_return_100``), the usual CartPole criterion.
RETURN_WINDOW = 100


class DeepEPModule(pl.LightningModule):
    """Deep Expected Policy gradient on batched environments, one rollout per training step.

    Rollouts run **inside** ``training_step``, not in a DataLoader: they need the current policy, and the
    environments live on the module's device. The loader yields rollout indices
    (:func:`~.rollout_state.step_indices`) for Lightning's bookkeeping; a step's randomness comes from a
    generator seeded by ``derive_seed(seed, "rollout", rank, rollout_step)``, so the data of a step is a pure
    function of (seed, rank, step) and the checkpointed environment and recurrent state: a resume seeks.

    With ``DeterministicDDPStrategy(virtual_world_size=K)`` a process owns ``K / W`` virtual ranks, each with
    its own environments and streams; a step is one virtual rank's rollout, and the logged scalars are ordered
    means over the ``K`` ranks, so 1, 2, ..., ``K`` processes give the same bits
    (:mod:`~deepep_lightning.deepep.virtual_ranks`; eager only).

    Args:
        env: the environments and rollouts (:class:`~deepep_lightning.deepep.config.EnvConfig`).
        network: the agent's networks (:class:`~deepep_lightning.deepep.config.NetworkConfig`).
        loss: returns, critic, entropy and target networks (:class:`~deepep_lightning.deepep.config.LossConfig`).
        optim: the optimizer, its rates and their decay (:class:`~deepep_lightning.deepep.config.OptimConfig`).
        execution: fused kernels, compiled timesteps, the CUDA graph
            (:class:`~deepep_lightning.deepep.config.ExecutionConfig`).
        seed: seeds the initial weights, the environments and the rollout streams (rank-aware).
        log_throughput: log ``perf/env_steps_per_s`` (wall-clock, so off by default; see
            :class:`~deepep_lightning.deepep.config.DeepEPConfig`).

    A group may also be a dict of its fields (as a checkpoint's hyperparameters hold it). The whole
    configuration is :attr:`config`, checked before anything is built.

    Logged (``train/``), as device tensors: ``episode_return_100`` (the mean return of the last 100 finished
    episodes) at every step; ``loss``, ``policy_loss``, ``value_loss``, ``entropy``, ``grad_norm`` and
    ``entropy_coef`` with ``target_entropy`` at the steps Lightning writes (``log_every_n_steps``), each epoch's
    last step and the fit's last step (:meth:`~deepep_lightning.deepep.progress.ProgressLog.logs_step`; between
    them ``trainer.callback_metrics`` holds the last logged values), and at every step those that a callback
    monitors (a ``RegressionTrigger``, ``ModelCheckpoint(monitor=...)``:
    :func:`~deepep_lightning.protocols.monitored_metrics`); ``episode_return`` (the epoch's mean per finished
    episode) at each epoch end; the progress bar's values and the throughput at the steps Lightning writes
    (:class:`~deepep_lightning.deepep.progress.ProgressLog`).

    Example::

        model = DeepEPModule(env=EnvConfig(num_envs=32, rollout_length=32), optim=OptimConfig(learning_rate=1e-3))
        pl.Trainer(max_steps=200).fit(model)
    """

    # What register_buffer() sets, typed for attribute access.
    log_entropy_coef: torch.Tensor

    def __init__(
        self,
        env: EnvConfig = EnvConfig(),
        network: NetworkConfig = NetworkConfig(),
        loss: LossConfig = LossConfig(),
        optim: OptimConfig = OptimConfig(),
        execution: ExecutionConfig = ExecutionConfig(),
        seed: int = 0,
        log_throughput: bool = False,
    ) -> None:
        super().__init__()
        self.config = DeepEPConfig(env, network, loss, optim, execution, seed, log_throughput)  # checks every field
        self.save_hyperparameters(self.config.as_dict())
        config = self.config
        self.automatic_optimization = not config.execution.cuda_graph
        self.agent = config.build_agent()
        # log α of the adaptive entropy coefficient: a buffer, so checkpoints and rollbacks carry it.
        entropy_coef = config.loss.entropy_coef
        self.register_buffer("log_entropy_coef", torch.tensor(math.log(entropy_coef) if entropy_coef > 0 else 0.0))
        self.episode_return = EpisodeReturnMean()
        self.episode_return_100 = RollingEpisodeReturn(RETURN_WINDOW)
        self.progress = ProgressLog(config.env.num_envs * config.env.rollout_length, config.log_throughput)
        self.rollouts = ProcessRollouts()  # built by ensure_rollout_state()
        self.graph_training: GraphTraining | None = None  # the CUDA-graph step, built with the rollout state
        self._uncaptured = False  # set by uncaptured_steps()
        self._logs_step = True  # ProgressLog.logs_step of the running step (set by training_step)
        self._monitored: frozenset[str] = frozenset()  # what the callbacks read at any step, logged at every step
        self._evaluated_at = -1  # the optimizer step of the last greedy evaluation (on_train_batch_end)

    # ---------------------------------------------------------------- rollout state
    def ensure_rollout_state(self, virtual_ranks: tuple[int, int] | None = None) -> None:
        """Build the rollout state once on the module's device, restoring a state loaded before the build.

        Args:
            virtual_ranks: ``(first virtual rank, virtual ranks per process)`` to build
                :class:`~deepep_lightning.deepep.virtual_ranks.VirtualRollouts`; None: the attached trainer's
                strategy decides (``virtual_world_size``), one :class:`RolloutState` of this rank without one.
        """
        if self.rollouts.active is not None:
            return
        trainer = attached_trainer(self)
        if virtual_ranks is None and trainer is not None:
            virtual_ranks = virtual_layout(trainer.strategy)
        config = self.config
        if virtual_ranks is not None:
            check_virtual_support(config)
        env = (config.env.name, config.env.num_envs, config.env.kwargs)
        build = functools.partial(RolloutState.build, self.agent, *env, self.device, config.seed)
        state = self.rollouts.build(build, trainer.global_rank if trainer is not None else 0, virtual_ranks)
        if config.execution.cuda_graph:
            self.graph_training = GraphTraining(
                self.rollout_and_loss, self.parameters, state, config.optim.max_grad_norm
            )

    @property
    def rollout_state(self) -> RolloutState:
        """The rollout state of the (virtual) rank whose rollout runs now; RuntimeError before the build."""
        if self.rollouts.active is None:
            raise RuntimeError("DeepEPModule: no rollout state yet. HINT: call `ensure_rollout_state()` first")
        return self.rollouts.active

    @property
    def rollout_step(self) -> int:
        """The index of the next training step's rollout (0 before the rollout state exists)."""
        return self.rollouts.active.step if self.rollouts.active is not None else 0

    @property
    def fused_bptt_on(self) -> bool:
        """``fused_bptt`` resolved for the module's device (None: on with CUDA and the extension's CUDA kernels)."""
        return fused_bptt_on(self.config, self.device)

    @property
    def fused_rollout_on(self) -> bool:
        """``fused_rollout`` resolved for the next rollout on the module's device (may warn once, see
        :func:`~deepep_lightning.deepep.rollout_loss.fused_rollout_on`)."""
        return fused_rollout_on(self.config, self.agent, self.rollout_state.env, self.device)

    def seed_rollout(self) -> None:
        """Seed the active rollout state's generator for its step: ``derive_seed(seed, "rollout", rank, step)``."""
        self.rollout_state.seed_rollout(self.config.seed)

    def rollout_and_loss(self, first_of_step: bool = True) -> tuple[Any, Any]:
        """One rollout of the active rollout state and its loss terms (:func:`~.rollout_loss.rollout_and_loss`).

        Without virtual ranks its finished episodes feed ``episode_return_100`` here (inside the CUDA graph
        on that path); with them :meth:`training_step` adds the ``K`` virtual ranks' in order.
        """
        state = self.rollout_state
        rollout, terms = rollout_and_loss(self.agent, state, self.config, self.log_entropy_coef, first_of_step)
        if self.rollouts.virtual is None:
            self.episode_return_100.update(rollout.episode_returns, rollout.dones)
        return rollout, terms

    def rollout_state_dict(self) -> dict[str, Any]:
        """Environment states, recurrent state and the step counter (CPU tensors and ints)."""
        return self.rollouts.state_dict()

    def load_rollout_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`rollout_state_dict` returned, in place (graph-safe); before the build, keep it."""
        self.rollouts.load_state_dict(state)

    @override
    def on_fit_start(self) -> None:
        # Create the environments now (after the checkpoint restore and the move to the device), so
        # the snapshot NaNRollbackCallback takes at train start already holds the rollout state.
        self.ensure_rollout_state()

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint[ROLLOUT_STATE_KEY] = self.rollout_state_dict()

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # also read "deepep_rollout", the key older checkpoints carry, so they resume
        self.load_rollout_state_dict(checkpoint.get(ROLLOUT_STATE_KEY, checkpoint.get("deepep_rollout", {})))

    # ---------------------------------------------------------------- audit (protocols.SequenceAuditable)
    seed_argument = "seed"  # train.py and deepep-audit l4 link LightningCLI's seed_everything to it

    @classmethod
    def audit_config(cls, config: dict[str, Any], level: AuditLevel) -> dict[str, Any]:
        """L2 audits one timestep (``env.rollout_length=1``), L3 one whole rollout."""
        config = {k: v for k, v in config.items() if k != "seed_everything"}
        return {**config, "env": {**group_fields(config.get("env")), "rollout_length": 1}} if level == "L2" else config

    @classmethod
    def audit_describe(cls, config: dict[str, Any], level: AuditLevel) -> str:
        if level == "L2":
            return "one timestep"
        return f"rollout of T={int(group_fields(config.get('env')).get('rollout_length', EnvConfig.rollout_length))}"

    @classmethod
    def audit_variants(cls) -> dict[str, dict[str, Any]]:
        """The value heads: PyTorch reference, the extension's op, and its atomic backward (negative control)."""
        return {
            "reference": {"execution": {"fused_value_head": False}},
            "fused": {"execution": {"fused_value_head": True}},
            "fused_atomic": {"execution": {"fused_value_head": True, "atomic_value_head": True}},
        }

    # ---------------------------------------------------------------- training
    @override
    def train_dataloader(self) -> DataLoader:
        trainer = attached_trainer(self)
        virtual_world_size = getattr(trainer.strategy, "virtual_world_size", None) if trainer is not None else None
        return step_indices(self.config.env.steps_per_epoch, virtual_world_size)

    @override
    def configure_optimizers(self) -> Any:
        """Adam (or SGD), a param group per learning rate (:func:`~.optimizer.deepep_optimizer`)."""
        return deepep_optimizer(self.agent, self.config.optim, capturable=self.config.execution.cuda_graph)

    @override
    def on_train_start(self) -> None:
        self.progress.start(self.rollout_step)
        trainer = attached_trainer(self)
        self._monitored = monitored_metrics(trainer) if trainer is not None else frozenset()

    def _logs(self, tag: str) -> bool:
        """Whether ``tag`` is logged in this step: at the steps :meth:`ProgressLog.logs_step` names, or always when
        a callback reads it (:func:`~deepep_lightning.protocols.monitored_metrics`)."""
        return self._logs_step or tag in self._monitored

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | dict[str, torch.Tensor]:
        trainer = attached_trainer(self)
        writes_logs = trainer is not None and self.progress.writes_after(trainer, trainer.global_step)
        step = trainer.global_step if trainer is not None else 0
        self._logs_step = self.progress.logs_step(trainer, step, batch_idx)
        self.ensure_rollout_state()
        if self.rollouts.virtual is not None:
            return self._virtual_training_step(batch_idx, writes_logs)
        self.seed_rollout()
        if self.graph_training is not None:
            outputs = self.graph_training.step(cast(LightningOptimizer, self.optimizers()), self._uncaptured)
            scheduler = self.lr_schedulers() if trainer is not None else None
            if isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):  # manual optimisation steps it here
                scheduler.step()
        else:
            rollout, terms = self.rollout_and_loss()
            outputs = {name: getattr(terms, name) for name in SCALARS}
            outputs.update(episode_return_sum=rollout.episode_returns.sum(), episodes=rollout.dones.sum())
            self.last_rollout = rollout
        self.rollout_state.step += 1
        self.episode_return.update(outputs["episode_return_sum"], outputs["episodes"])
        # device tensors, no prog_bar: Lightning converts progress-bar values to numbers at every step's end
        for name in SCALARS:
            if self._logs(f"train/{name}"):
                self.log(f"train/{name}", outputs[name].detach().clone(), on_step=True, on_epoch=False)
        if self.config.loss.target_entropy is not None and self._logs("train/entropy_coef"):
            self.log("train/entropy_coef", self.log_entropy_coef.exp(), on_step=True, on_epoch=False)
        if self._logs("train/episode_return"):
            self.log("train/episode_return", self.episode_return, on_step=False, on_epoch=True)
        self.log("train/episode_return_100", self.episode_return_100.compute(), on_step=True, on_epoch=False)
        if writes_logs:
            self.progress.log(self, outputs["loss"], self.episode_return_100.compute(), self.rollout_step)
        if self.graph_training is not None:
            # The graph's outputs are overwritten by the next replay: hand on clones. Manual optimisation
            # passes this dict to the callbacks' on_train_batch_end (NumericalHealthCallback checks
            # "loss" and reads "grad_norm" in place of the gradients, which no hook sees inside the graph).
            checked = {"loss": outputs["loss"].detach().clone(), "grad_norm": outputs["grad_norm"].detach().clone()}
            if self._logs("train/grad_norm"):
                self.log("train/grad_norm", checked["grad_norm"], on_step=True, on_epoch=False)
            return checked
        return outputs["loss"]

    @override
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Every ``env.eval_every_n_steps`` optimizer steps, at a step whose logs Lightning writes: the greedy
        policy's mean return over ``env.eval_envs`` fresh environments, ``eval/greedy_return``
        (:func:`~deepep_lightning.deepep.greedy_evaluation.greedy_returns`)."""
        env = self.config.env
        trainer = attached_trainer(self)
        if not env.eval_envs or trainer is None:
            return
        steps = trainer.global_step
        if (
            steps % env.eval_every_n_steps
            or steps == self._evaluated_at
            or not self.progress.writes_after(trainer, steps - 1)
        ):
            return
        self._evaluated_at = steps
        evaluation_env = make_env(env.name, env.eval_envs, self.device, **(env.kwargs or {}))
        fused = fused_bptt_on(self.config, self.device) and fused_rollout_on(
            self.config, self.agent, evaluation_env, self.device
        )  # the evaluation runs as one kernel launch where the training's rollout does
        returns = greedy_returns(self.agent, evaluation_env, self.config.seed, fused=fused)
        value = returns.mean()
        # Written once, at this step: a value given to self.log would be written again at the epoch's later writes.
        # callback_metrics holds it for monitors (ModelCheckpoint, RegressionTrigger) until the next evaluation.
        self.log("eval/greedy_return", value, on_step=True, on_epoch=False, logger=False, batch_size=1)
        for logger in trainer.loggers:
            logger.log_metrics({"eval/greedy_return": float(value)}, step=steps - 1)  # Lightning's step label

    def _virtual_training_step(self, batch_idx: int, writes_logs: bool) -> torch.Tensor:
        """The rollout and loss of one virtual rank: micro-batch ``batch_idx % (K / W)`` of the optimizer step.

        At the step's last micro-batch the ``K`` virtual ranks' scalars are logged as their ordered means and
        their episodes feed the rolling return in virtual-rank order: the same bits whatever ``W``.
        """
        virtual = self.rollouts.virtual
        assert virtual is not None
        index = batch_idx % len(virtual)
        self.rollouts.select(index)
        self.seed_rollout()
        rollout, terms = self.rollout_and_loss(first_of_step=index == 0)
        self.last_rollout = rollout
        scalars = torch.stack([getattr(terms, name) for name in SCALARS]).detach().float()
        virtual.record(scalars, rollout.episode_returns.detach().float(), rollout.dones.float())
        # epoch mean, summed over processes by the metric: exact in any order while returns are integers (CartPole)
        self.episode_return.update(rollout.episode_returns.sum(), rollout.dones.sum())
        if self._logs("train/episode_return"):
            self.log("train/episode_return", self.episode_return, on_step=False, on_epoch=True)
        if index == len(virtual) - 1:
            all_scalars, returns, dones = virtual.end_step()
            for episode_returns, done in zip(returns, dones, strict=True):
                self.episode_return_100.update(episode_returns, done > 0)
            means = ordered_mean(all_scalars)
            for position, name in enumerate(SCALARS):
                if self._logs(f"train/{name}"):
                    self.log(f"train/{name}", means[position].clone(), on_step=True, on_epoch=False)
            self.log("train/episode_return_100", self.episode_return_100.compute(), on_step=True, on_epoch=False)
            if writes_logs:
                self.progress.log(self, means[0], self.episode_return_100.compute(), self.rollout_step)
        return terms.loss

    @override
    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        if grads and self._logs("train/grad_norm"):
            self.log("train/grad_norm", torch.nn.utils.get_total_norm(grads), on_step=True, on_epoch=False)
        if self.config.optim.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.parameters(), self.config.optim.max_grad_norm, foreach=True)

    # ---------------------------------------------------------------- CUDA graph path
    @contextlib.contextmanager
    def uncaptured_steps(self) -> Iterator[None]:
        """Inside this block, ``cuda_graph=True`` training steps run without the CUDA graph.

        The same step (:meth:`GraphTraining.whole_step`) runs eagerly on the same tensors the graph uses, so
        dispatch modes see every op of it (the non-finite locator of
        :class:`~deepep_lightning.NaNRollbackCallback` diagnoses a graph-path step in here), a debugger steps
        through it, and with a non-capturable optimizer it runs on a CPU. No effect when ``cuda_graph=False``.
        """
        previous, self._uncaptured = self._uncaptured, True
        try:
            yield
        finally:
            self._uncaptured = previous
