"""DeepEPModule: the DeepEP agent trained on-policy by Lightning.

The class holds the Lightning hooks and the logging; its collaborators own the rest: the rollout state of
one rank (:class:`~deepep_lightning.deepep.rollout_state.RolloutState`) or of this process's virtual ranks
(:class:`~deepep_lightning.deepep.virtual_ranks.VirtualRollouts`), one rollout and its loss as a function
(:func:`~deepep_lightning.deepep.rollout_loss.rollout_and_loss`), the CUDA-graph step
(:class:`~deepep_lightning.deepep.graph_training.GraphTraining`), the learning-rate stairs
(:func:`~deepep_lightning.deepep.lr_decay.lr_stairs`) and the argument checks
(:mod:`~deepep_lightning.deepep.module_arguments`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import math
import time
from collections.abc import Iterator
from typing import Any, cast

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.data import AttributeDict
from lightning.pytorch.core.optimizer import LightningOptimizer
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from deepep_lightning.deepep.agent import DeepEPAgent
from deepep_lightning.deepep.episode_return import EpisodeReturnMean, RollingEpisodeReturn
from deepep_lightning.deepep.graph_training import GraphTraining
from deepep_lightning.deepep.lr_decay import lr_stairs
from deepep_lightning.deepep.module_arguments import check_arguments
from deepep_lightning.deepep.rollout_loss import fused_bptt_on, fused_rollout_on, rollout_and_loss
from deepep_lightning.deepep.rollout_state import RolloutState
from deepep_lightning.deepep.virtual_ranks import VirtualRollouts, check_virtual_support, ordered_mean, virtual_layout
from deepep_lightning.determinism.streams import derive_seed
from deepep_lightning.protocols import ROLLOUT_STATE_KEY, AuditLevel, attached_trainer

__all__ = ["DeepEPModule"]

log = logging.getLogger(__name__)

#: Episodes in the rolling mean return (``train/episode_return_100``), the usual CartPole criterion.
RETURN_WINDOW = 100


class _StepIndices(Dataset):
    """``steps_per_epoch`` integers: a training "batch" is only the index of a rollout."""

    def __init__(self, steps_per_epoch: int) -> None:
        self.steps_per_epoch = steps_per_epoch

    def __len__(self) -> int:
        return self.steps_per_epoch

    def __getitem__(self, index: int) -> int:
        return index


class DeepEPModule(pl.LightningModule):
    """Deep Expected Policy gradient on batched environments, one rollout per training step.

    Rollouts run **inside** ``training_step`` rather than in a DataLoader: they need the current
    policy and the environments live on the module's device, so a loader could only ship them
    across processes and devices. The loader yields rollout indices (:class:`_StepIndices`), which
    keeps Lightning's epoch/step bookkeeping, and all rollout randomness comes from a generator
    reseeded every step from ``derive_seed(seed, "rollout", rank, rollout_step)``: the data of any
    step is a pure function of (seed, rank, step) plus the checkpointed environment and recurrent
    state, so resuming seeks instead of replaying and no global RNG is touched.

    With ``DeterministicDDPStrategy(virtual_world_size=K)`` (``accumulate_grad_batches = K / W``) a
    process owns ``K / W`` virtual ranks, each with its own environments, recurrent state and streams
    keyed by the virtual rank; a training step is one virtual rank's rollout, and the logged scalars
    are the ordered means over the ``K`` virtual ranks, so 1, 2, ..., ``K`` processes give the same
    bits (:mod:`~deepep_lightning.deepep.virtual_ranks`; eager only: not with ``cuda_graph``,
    ``compile_step`` or ``target_entropy``).

    Args:
        env: ``"cartpole"`` (CartPole, 500-step episodes) or ``"memory"`` (cue recall, see ``env_kwargs``).
        num_envs: environments stepped together (B).
        rollout_length: timesteps per training step (T); BPTT runs over them.
        hidden_size: recurrent state and MLP width.
        value_hidden_size: value-head width H (default: ``hidden_size``).
        steps_per_epoch: training steps (rollouts) per epoch.
        seed: seeds the environments and the rollout streams (rank-aware).
        learning_rate: Adam's learning rate (critic, recurrent cell).
        policy_learning_rate: the policy network's learning rate (None: ``learning_rate``). A
            slower actor than critic (two time-scale actor-critic) keeps the all-action gradient from
            chasing the critic's errors on actions it has stopped taking.
        recurrent_learning_rate: the recurrent cell's learning rate (None: ``learning_rate``). The policy
            reads the recurrent state as a feature, and the critic trains the cell: at the critic's rate a
            change of the value level (the first failures after a long run of full-length episodes) moves
            the policy's inputs, and so its actions, within a few steps however slow its own rate is.
        optimizer: ``"adam"`` (default) or ``"sgd"`` (plain SGD; with a large learning rate it really
            diverges to Inf/NaN, which ``configs/nan_demo.yaml`` uses to show detection and recovery).
        gamma: discount.
        reward_scale: rewards are multiplied by this for learning (episode returns are logged
            unscaled); keeps the critic's targets O(1) so Adam can fit them in a few hundred steps.
        gae_lambda: λ of the critic's λ-return targets.
        value_coef: weight of the critic loss.
        entropy_coef: weight of the entropy bonus; with ``target_entropy``, its floor and starting value.
        target_entropy: mean policy entropy (nats, in ``[0, log A]``) that an adaptive entropy coefficient
            holds the policy to: every step ``log α`` moves by ``entropy_coef_rate·(target − entropy)``,
            within ``[entropy_coef, entropy_coef_max]``. It keeps the softmax from saturating onto one
            action, where the all-action gradient ``π(Q − V)`` vanishes and the policy cannot recover.
            None: the fixed ``entropy_coef``.
        entropy_coef_max: the adaptive coefficient's ceiling (``>= entropy_coef``).
        entropy_coef_rate: the adaptive coefficient's step on ``log α`` per nat of entropy deficit.
        target_tau: Polyak rate τ of the target networks, slow copies that lag the online ones by about
            ``1/τ`` steps: the target critic bootstraps the critic's λ-returns, and with ``kl_coef > 0``
            the target policy anchors a per-state KL trust region. None: no target networks (the online
            critic bootstraps itself; ``kl_coef`` must be 0).
        kl_coef: weight of ``KL(π_target(·|s) ‖ π(·|s))``, averaged over the rollout's states: it bounds
            how fast the policy can move away from its own recent average (actions are enumerable, so
            the KL is exact), which stops a run of same-signed Adam steps on a near-flat critic from
            carrying the policy onto one action within a few dozen steps. 0: off.
        expected_value_coef: weight (relative to the taken-action regression) of a second critic
            regression, of the expected value ``Σ_a π Q`` onto the same λ-returns: it moves the Q of every
            action with the value level, so the Q of actions the policy takes less does not go stale
            while values change fast (``agent.loss.deepep_loss``). 0: off.
        policy_adam_eps: Adam's ``eps`` for the policy network (None: Adam's default, 1e-8). Adam divides
            each gradient by its running RMS, so a tiny but consistently signed policy gradient (the
            critic's state-independent error on an action the policy hardly takes) still moves every
            policy weight by the full learning rate each step. An ``eps`` at the scale of that gradient
            makes such steps proportional to the gradient (``lr·g / eps``, SGD with momentum) while large
            gradients keep Adam's normalised steps. Needs ``optimizer="adam"``.
        logit_bound: squash the policy logits to ``c·tanh(z / c)``, ``c = logit_bound``: every action keeps
            a probability of at least ``1 / (1 + (A − 1)·e^{2c})``, so it keeps being tried and its Q trained
            (``agent.network.DeepEPAgent``). None: unbounded logits.
        policy_reads_hidden: the policy reads ``[obs; h]`` (True) or the observation alone (False, for fully
            observed environments such as ``"cartpole"``): the recurrent state is the critic's, trained at its
            faster rate, and its changes move a policy that reads it. The critic, the value feedback and the
            recurrent cell are the same either way.
        chrono_horizon: chrono initialisation of the GRU's update gate for memory over up to this many
            steps (``>= 2``); None: PyTorch's default initialisation.
        lr_decay_steps: decay every learning rate over this many training steps, stepwise and linearly, to
            ``1/lr_decay_stages`` of it (:mod:`~deepep_lightning.deepep.lr_decay`); None: constant rates.
        lr_decay_stages: the decay's stairs (each one re-captures the CUDA-graph step).
        max_grad_norm: clip the gradients' global norm to this (None: no clipping). Works on both
            paths, inside the graph for ``cuda_graph=True`` (where Lightning's ``gradient_clip_val``,
            an automatic-optimisation feature, is unavailable); eager runs may use either.
        detach_feedback: feed the value estimate back into the recurrent state without gradient.
        bptt_truncation: cut BPTT every this many steps (None: through the whole rollout).
        fused_bptt: run the rollout's timesteps without autograd and its backward through time as one recurrent
            op, two kernels per timestep (:mod:`~deepep_lightning.deepep.agent.fused_bptt`): the same actions and
            gradients, to fp32 rounding. None: on where it pays, a CUDA device with the extension's CUDA kernels
            (resolved at the first step, when the device is known), off otherwise, so CPU runs keep the op-by-op
            autograd path; True also on CPU (the compiled CPU kernel or its PyTorch reference). Needs
            ``detach_feedback=True``; works eagerly, with ``cuda_graph`` (the graph captures the backward's loop
            of launches), with ``compile_step`` (the no-gradient timestep is compiled) and with virtual ranks.
        fused_value_head: use the compiled ``deepep::all_action_q`` op for the value head; ``None``
            uses it when the extension loads.
        atomic_value_head: run the compiled op's atomic (``deterministic=False``) CUDA backward, not
            bitwise reproducible: a negative control for ``deepep-audit`` (its ``fused_atomic``
            variant). Needs the fused head; no effect on CPU, where the kernel is deterministic.
        cuda_graph: capture the whole training step as one CUDA graph (GPU only; manual optimisation).
        compile_step: ``torch.compile`` the rollout's timestep (agent step, env step and state reset, forward
            and backward) into fused kernels (:class:`~deepep_lightning.deepep.agent.compiled_step.CompiledTimestep`);
            with ``cuda_graph`` the graph's warm-up compiles and the capture holds the generated kernels.
            Where torch.compile is unavailable (no C++ compiler, no triton) the timestep runs eagerly after
            one warning.
        fused_rollout: with ``fused_bptt``, run the rollout's no-gradient timesteps on CartPole as one
            ``deepep::cartpole_rollout`` launch (:mod:`~deepep_lightning.deepep.agent.fused_rollout`: the agent's
            step, the sample and CartPole's step of every timestep in one kernel, the same random draws; actions
            and states equal the op-by-op loop's to rounding). None: on with CUDA where the kernel runs it (the
            extension's CUDA kernels, CartPole, float32/float64, ``compile_step=False``), resolved at each rollout;
            off otherwise, on CUDA after one warning naming why. True: also on CPU (the CPU kernel), and a
            rollout it cannot run raises naming why. False: the op-by-op timesteps, without a warning.
            Needs ``fused_bptt`` not False and ``compile_step=False``.
        env_kwargs: extra environment arguments, e.g. ``{"horizon": 512}`` for ``"memory"``.
        log_throughput: log ``perf/env_steps_per_s`` at the steps Lightning writes. Off by default: a
            wall-clock figure differs between two bitwise-identical runs (the configs turn it on;
            ``deepep-compare`` and ``deepep-audit l4`` leave ``perf/`` tags out).

    Logged (``train/``): ``loss``, ``policy_loss``, ``value_loss``, ``entropy``, ``grad_norm`` and
    ``episode_return_100`` (mean return of the last 100 finished episodes, a device-side rolling
    window) at every step as device tensors, so a step reads nothing back: Lightning reads them
    when it writes, every ``log_every_n_steps``. ``episode_return`` (the epoch's mean per finished
    episode) at each epoch end, ``entropy_coef`` with ``target_entropy``. At the steps Lightning
    writes, the module also reads ``loss`` and ``return_100`` once to the host for the progress
    bar and, with ``log_throughput``, logs ``perf/env_steps_per_s`` (environment steps per second
    since the previous write).

    Example::

        model = DeepEPModule(env="cartpole", num_envs=32, rollout_length=32)
        pl.Trainer(max_steps=200).fit(model)
    """

    # What save_hyperparameters() and register_buffer() set, typed for attribute access.
    hparams: AttributeDict
    log_entropy_coef: torch.Tensor

    def __init__(
        self,
        env: str = "cartpole",
        num_envs: int = 32,
        rollout_length: int = 32,
        hidden_size: int = 64,
        value_hidden_size: int | None = None,
        steps_per_epoch: int = 50,
        seed: int = 0,
        learning_rate: float = 3e-3,
        policy_learning_rate: float | None = 1e-4,
        recurrent_learning_rate: float | None = None,
        optimizer: str = "adam",
        gamma: float = 0.99,
        reward_scale: float = 0.05,
        gae_lambda: float = 0.95,
        value_coef: float = 0.5,
        entropy_coef: float = 0.001,
        target_entropy: float | None = None,
        entropy_coef_max: float = 0.05,
        entropy_coef_rate: float = 0.2,
        target_tau: float | None = None,
        kl_coef: float = 0.0,
        expected_value_coef: float = 0.0,
        policy_adam_eps: float | None = None,
        logit_bound: float | None = None,
        policy_reads_hidden: bool = True,
        chrono_horizon: int | None = None,
        lr_decay_steps: int | None = None,
        lr_decay_stages: int = 10,
        max_grad_norm: float | None = None,
        detach_feedback: bool = True,
        bptt_truncation: int | None = None,
        fused_bptt: bool | None = None,
        fused_value_head: bool | None = None,
        atomic_value_head: bool = False,
        cuda_graph: bool = False,
        compile_step: bool = False,
        fused_rollout: bool | None = None,
        env_kwargs: dict[str, Any] | None = None,
        log_throughput: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        probe = check_arguments(self.hparams)  # raises on a bad argument, before anything is built
        if fused_value_head is None:
            fused_value_head = _extension_loads()
        self.automatic_optimization = not cuda_graph
        # Initial weights are a pure function of `seed`, whatever the global RNG holds (which is left untouched).
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(seed, "init"))
            self.agent = DeepEPAgent(
                probe.obs_dim,
                probe.num_actions,
                hidden_size,
                value_hidden_size,
                detach_feedback,
                bool(fused_value_head),
                atomic_value_head,
                target_critic=target_tau is not None,
                target_policy=kl_coef > 0,
                chrono_horizon=chrono_horizon,
                logit_bound=logit_bound,
                policy_reads_hidden=policy_reads_hidden,
            )
        # log α of the adaptive entropy coefficient: a buffer, so checkpoints and rollbacks carry it.
        self.register_buffer("log_entropy_coef", torch.tensor(math.log(entropy_coef) if entropy_coef > 0 else 0.0))
        self.episode_return = EpisodeReturnMean()
        self.episode_return_100 = RollingEpisodeReturn(RETURN_WINDOW)
        self._throughput_mark: tuple[float, int] | None = None  # (perf_counter, rollout step) at the last write
        self._rollout: RolloutState | None = None  # the active (virtual) rank's, built by ensure_rollout_state()
        self._virtual: VirtualRollouts | None = None  # DeterministicDDPStrategy(virtual_world_size=K)
        self._pending_rollout_state: dict[str, Any] | None = None  # loaded before the build
        self._graph: GraphTraining | None = None  # cuda_graph=True, built with the rollout state
        self._uncaptured = False  # set by uncaptured_steps()

    # ---------------------------------------------------------------- rollout state
    def ensure_rollout_state(self, virtual_ranks: tuple[int, int] | None = None) -> None:
        """Build the rollout state once on the module's device, restoring a state loaded before the build.

        Args:
            virtual_ranks: ``(first virtual rank, virtual ranks per process)`` to build
                :class:`~deepep_lightning.deepep.virtual_ranks.VirtualRollouts`; None: the attached trainer's
                strategy decides (``virtual_world_size``), one :class:`RolloutState` of this rank without one.
        """
        if self._rollout is not None:
            return
        trainer = attached_trainer(self)
        if virtual_ranks is None and trainer is not None:
            virtual_ranks = virtual_layout(trainer.strategy)
        hp = self.hparams
        env = (hp.env, hp.num_envs, hp.env_kwargs)
        build = functools.partial(RolloutState.build, self.agent, *env, self.device, hp.seed)
        pending, self._pending_rollout_state = self._pending_rollout_state, None
        if virtual_ranks is not None:
            check_virtual_support(hp)
            self._virtual = VirtualRollouts.build(build, *virtual_ranks)
            self._rollout = self._virtual.select(0)
            if pending:
                self._virtual.load_state_dict(pending)
        else:
            rank = trainer.global_rank if trainer is not None else 0
            self._rollout = build(rank, saved=pending)
        if hp.cuda_graph:
            self._graph = GraphTraining(self.rollout_and_loss, self.parameters, self._rollout, hp.max_grad_norm)

    @property
    def rollout_state(self) -> RolloutState:
        """The rollout state of the (virtual) rank whose rollout runs now.

        Raises:
            RuntimeError: before :meth:`ensure_rollout_state` (a fit calls it at ``on_fit_start``).
        """
        if self._rollout is None:
            raise RuntimeError("DeepEPModule: no rollout state yet. HINT: call `ensure_rollout_state()` first")
        return self._rollout

    @property
    def virtual_rollouts(self) -> VirtualRollouts | None:
        """This process's virtual ranks (``DeterministicDDPStrategy(virtual_world_size=K)``); None without them."""
        return self._virtual

    @property
    def rollout_step(self) -> int:
        """The index of the next training step's rollout (0 before the rollout state exists)."""
        return self._rollout.step if self._rollout is not None else 0

    @property
    def graph_training(self) -> GraphTraining | None:
        """The CUDA-graph step (``cuda_graph=True``, once the rollout state exists); None otherwise."""
        return self._graph

    @property
    def fused_bptt_on(self) -> bool:
        """``fused_bptt`` resolved for the module's device (None: on with CUDA and the extension's CUDA kernels)."""
        return fused_bptt_on(self.hparams, self.device)

    @property
    def fused_rollout_on(self) -> bool:
        """``fused_rollout`` resolved for the next rollout on the module's device (may warn once, see
        :func:`~deepep_lightning.deepep.rollout_loss.fused_rollout_on`)."""
        return fused_rollout_on(self.hparams, self.agent, self.rollout_state, self.device)

    def select_virtual_rank(self, index: int) -> None:
        """Make virtual rank ``index`` of this process the one whose rollout runs next."""
        assert self._virtual is not None
        self._rollout = self._virtual.select(index)

    def seed_rollout(self) -> None:
        """Seed the active rollout state's generator for its step: ``derive_seed(seed, "rollout", rank, step)``."""
        self.rollout_state.seed_rollout(self.hparams.seed)

    def rollout_and_loss(self, first_of_step: bool = True) -> tuple[Any, Any]:
        """One rollout of the active rollout state and its loss terms (:func:`~.rollout_loss.rollout_and_loss`).

        Without virtual ranks its finished episodes feed ``episode_return_100`` here (inside the CUDA graph
        on that path); with them :meth:`training_step` adds the ``K`` virtual ranks' in order.
        """
        state, hparams = self.rollout_state, self.hparams
        rollout, terms = rollout_and_loss(self.agent, state, hparams, self.log_entropy_coef, first_of_step)
        if self._virtual is None:
            self.episode_return_100.update(rollout.episode_returns, rollout.dones)
        return rollout, terms

    def rollout_state_dict(self) -> dict[str, Any]:
        """Environment states, recurrent state and the step counter (CPU tensors and ints)."""
        if self._rollout is None:
            return dict(self._pending_rollout_state) if self._pending_rollout_state else {}
        return self._virtual.state_dict() if self._virtual is not None else self._rollout.state_dict()

    def load_rollout_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`rollout_state_dict` returned, in place (graph-safe); before the build, keep it."""
        if not state:
            return
        if self._rollout is None:
            self._pending_rollout_state = state
        elif self._virtual is not None or "virtual" in state:
            if self._virtual is None:
                raise ValueError(
                    f"DeepEPModule: the rollout state holds virtual ranks {sorted(state['virtual'])!r}, this process"
                    " trains virtual ranks None. HINT: resume with the virtual_world_size of the checkpoint"
                )
            self._virtual.load_state_dict(state)
        else:
            self._rollout.load_state_dict(state)

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
        """L2 audits one timestep (``rollout_length=1``), L3 one whole rollout."""
        config = {k: v for k, v in config.items() if k != "seed_everything"}
        return {**config, "rollout_length": 1} if level == "L2" else config

    @classmethod
    def audit_describe(cls, config: dict[str, Any], level: AuditLevel) -> str:
        if level == "L2":
            return "one timestep"
        default = inspect.signature(cls).parameters["rollout_length"].default
        return f"rollout of T={int(config.get('rollout_length', default))}"

    @classmethod
    def audit_variants(cls) -> dict[str, dict[str, Any]]:
        """The value heads: PyTorch reference, the extension's op, and its atomic backward (negative control)."""
        return {
            "reference": {"fused_value_head": False},
            "fused": {"fused_value_head": True},
            "fused_atomic": {"fused_value_head": True, "atomic_value_head": True},
        }

    # ---------------------------------------------------------------- training
    @override
    def train_dataloader(self) -> DataLoader:
        trainer = attached_trainer(self)
        virtual_world_size = getattr(trainer.strategy, "virtual_world_size", None) if trainer is not None else None
        if virtual_world_size is not None:  # one index per micro-batch of every virtual rank: the strategy shards them
            return DataLoader(_StepIndices(self.hparams.steps_per_epoch * virtual_world_size), batch_size=1)
        return DataLoader(_StepIndices(self.hparams.steps_per_epoch), batch_size=None, shuffle=False)

    @override
    def configure_optimizers(self) -> Any:
        """Adam (or SGD) with the critic's, the policy's and the recurrent cell's rates as param groups.

        Returns:
            The optimizer; with ``lr_decay_steps``, a dict with it and its stairs
            (:func:`~deepep_lightning.deepep.lr_decay.lr_stairs`, stepped after every optimizer step).
        """
        hp = self.hparams
        policy_params = list(self.agent.policy_net.parameters())
        policy_ids = {id(p) for p in policy_params}
        # the recurrent cell is a group of its own (the third) only with its own rate, so the default groups stay
        recurrent_params = list(self.agent.rnn_cell.parameters()) if hp.recurrent_learning_rate is not None else []
        own_ids = policy_ids | {id(p) for p in recurrent_params}
        other_params = [p for p in self.parameters() if id(p) not in own_ids and p.requires_grad]
        groups = [
            {"params": other_params, "lr": hp.learning_rate},
            {"params": policy_params, "lr": hp.policy_learning_rate or hp.learning_rate},
        ]
        if recurrent_params:
            groups.append({"params": recurrent_params, "lr": hp.recurrent_learning_rate})
        if hp.policy_adam_eps is not None:
            groups[1]["eps"] = hp.policy_adam_eps
        if hp.optimizer == "sgd":
            optimizer: torch.optim.Optimizer = torch.optim.SGD(groups, lr=hp.learning_rate)
        else:
            optimizer = torch.optim.Adam(groups, lr=hp.learning_rate, capturable=hp.cuda_graph)
        if hp.lr_decay_steps is None:
            return optimizer
        scheduler = lr_stairs(optimizer, hp.lr_decay_steps, hp.lr_decay_stages)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def _lightning_writes_logs_after(self, step: int) -> bool:
        """Whether Lightning writes the logged values at the end of optimizer step ``step`` (0-based).

        Lightning writes when ``(batches_that_stepped + 1) % log_every_n_steps == 0``; with one optimizer
        step per batch that count is the ``global_step`` at the start of the step.
        """
        trainer = attached_trainer(self)
        # log_every_n_steps is set by Lightning's logger connector, outside Trainer.__init__ (mypy misses it)
        every = trainer.log_every_n_steps if trainer is not None else 0  # type: ignore[attr-defined]
        return every > 0 and (step + 1) % every == 0

    def _log_progress(self, loss: torch.Tensor) -> None:
        """At a step Lightning writes: loss and rolling return for the progress bar (host values), throughput."""
        hp = self.hparams
        host = torch.stack([loss.detach().float(), self.episode_return_100.compute()]).cpu()  # one read
        self.log("loss", host[0], on_step=True, on_epoch=False, prog_bar=True, logger=False, batch_size=1)
        self.log("return_100", host[1], on_step=True, on_epoch=False, prog_bar=True, logger=False, batch_size=1)
        if not hp.log_throughput:
            return
        now = time.perf_counter()
        if self._throughput_mark is not None and self.rollout_step > self._throughput_mark[1]:
            start, first_step = self._throughput_mark
            env_steps = (self.rollout_step - first_step) * hp.num_envs * hp.rollout_length
            rate = torch.tensor(env_steps / max(now - start, 1e-9))
            self.log("perf/env_steps_per_s", rate, on_step=True, on_epoch=False, batch_size=1)
        self._throughput_mark = (now, self.rollout_step)

    @override
    def on_train_start(self) -> None:
        self._throughput_mark = (time.perf_counter(), self.rollout_step)

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | dict[str, torch.Tensor]:
        trainer = attached_trainer(self)
        writes_logs = trainer is not None and self._lightning_writes_logs_after(trainer.global_step)
        self.ensure_rollout_state()
        if self._virtual is not None:
            return self._virtual_training_step(batch_idx, writes_logs)
        self.seed_rollout()
        if self._graph is not None:
            outputs = self._graph.step(cast(LightningOptimizer, self.optimizers()), self._uncaptured)
            scheduler = self.lr_schedulers() if trainer is not None else None
            if isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):  # manual optimisation steps it here
                scheduler.step()
        else:
            rollout, terms = self.rollout_and_loss()
            outputs = {
                "loss": terms.loss,
                "policy_loss": terms.policy_loss,
                "value_loss": terms.value_loss,
                "entropy": terms.entropy,
                "episode_return_sum": (rollout.episode_returns).sum(),
                "episodes": rollout.dones.sum(),
            }
            self.last_rollout = rollout
        self.rollout_state.step += 1
        # device tensors, no prog_bar: Lightning converts progress-bar values to numbers at every step's end
        for name in ("loss", "policy_loss", "value_loss", "entropy"):
            self.log(f"train/{name}", outputs[name].detach().clone(), on_step=True, on_epoch=False)
        if self.hparams.target_entropy is not None:
            self.log("train/entropy_coef", self.log_entropy_coef.exp(), on_step=True, on_epoch=False)
        self.episode_return.update(outputs["episode_return_sum"], outputs["episodes"])
        self.log("train/episode_return", self.episode_return, on_step=False, on_epoch=True)
        self.log("train/episode_return_100", self.episode_return_100.compute(), on_step=True, on_epoch=False)
        if writes_logs:
            self._log_progress(outputs["loss"])
        if self._graph is not None:
            # The graph's outputs are overwritten by the next replay: hand on clones. Manual optimisation
            # passes this dict to the callbacks' on_train_batch_end (NumericalHealthCallback checks
            # "loss" and reads "grad_norm" in place of the gradients, which no hook sees inside the graph).
            checked = {"loss": outputs["loss"].detach().clone(), "grad_norm": outputs["grad_norm"].detach().clone()}
            self.log("train/grad_norm", checked["grad_norm"], on_step=True, on_epoch=False)
            return checked
        return outputs["loss"]

    def _virtual_training_step(self, batch_idx: int, writes_logs: bool) -> torch.Tensor:
        """The rollout and loss of one virtual rank: micro-batch ``batch_idx % (K / W)`` of the optimizer step.

        At the step's last micro-batch the ``K`` virtual ranks' scalars are logged as their ordered means and
        their episodes feed the rolling return in virtual-rank order: the same bits whatever ``W``.
        """
        assert self._virtual is not None
        index = batch_idx % len(self._virtual)
        self.select_virtual_rank(index)
        self.seed_rollout()
        rollout, terms = self.rollout_and_loss(first_of_step=index == 0)
        self.last_rollout = rollout
        scalars = torch.stack([terms.loss, terms.policy_loss, terms.value_loss, terms.entropy]).detach().float()
        self._virtual.record(scalars, rollout.episode_returns.detach().float(), rollout.dones.float())
        # epoch mean, summed over processes by the metric: exact in any order while returns are integers (CartPole)
        self.episode_return.update(rollout.episode_returns.sum(), rollout.dones.sum())
        self.log("train/episode_return", self.episode_return, on_step=False, on_epoch=True)
        if index == len(self._virtual) - 1:
            all_scalars, returns, dones = self._virtual.end_step()
            for episode_returns, done in zip(returns, dones, strict=True):
                self.episode_return_100.update(episode_returns, done > 0)
            means = ordered_mean(all_scalars)
            for position, name in enumerate(("loss", "policy_loss", "value_loss", "entropy")):
                self.log(f"train/{name}", means[position].clone(), on_step=True, on_epoch=False)
            self.log("train/episode_return_100", self.episode_return_100.compute(), on_step=True, on_epoch=False)
            if writes_logs:
                self._log_progress(means[0])
        return terms.loss

    @override
    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        if grads:
            self.log("train/grad_norm", torch.nn.utils.get_total_norm(grads), on_step=True, on_epoch=False)
        if self.hparams.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.parameters(), self.hparams.max_grad_norm, foreach=True)

    # ---------------------------------------------------------------- CUDA graph path
    @contextlib.contextmanager
    def uncaptured_steps(self) -> Iterator[None]:
        """Inside this block, ``cuda_graph=True`` training steps run without the CUDA graph.

        The same step (:meth:`GraphTraining.whole_step`: rollout, loss, backward, clipping, optimizer step)
        runs eagerly on the current stream, on the same tensors the graph uses, so it is one ordinary
        training step and the graph carries on after the block. Dispatch modes see every op of it,
        which is why :class:`~deepep_lightning.NaNRollbackCallback`'s non-finite locator diagnoses a
        graph-path step in here. It is also the way to step through the graph path in a debugger
        and, given a non-capturable optimizer (the CPU tests override ``configure_optimizers``), to
        run the graph path's code on a CPU. No effect when ``cuda_graph=False``.

        Example::

            with model.uncaptured_steps():
                trainer.fit(model)  # every step eager, as the graph would compute it
        """
        previous, self._uncaptured = self._uncaptured, True
        try:
            yield
        finally:
            self._uncaptured = previous


def _extension_loads() -> bool:
    try:
        from deepep_lightning.ops import extension_available
    except ImportError:
        return False
    return bool(extension_available())
