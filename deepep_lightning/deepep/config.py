"""DeepEPModule's hyperparameters as five typed groups and the run's seed: :class:`DeepEPConfig`.

Each group is a frozen dataclass that checks its own fields when it is built and raises naming the field,
the value and what is allowed (``EnvConfig(num_envs=...) must be a positive int, got 0``); the checks that
span groups (SGD with the CUDA graph, the fused kernels' needs) run when :class:`DeepEPConfig` is built.
LightningCLI shows and validates every field under its group: ``--model.optim.learning_rate 3e-3``, or in a
config file::

    model:
      env: {name: cartpole, num_envs: 32, rollout_length: 32}
      optim: {learning_rate: 0.003, policy_learning_rate: 0.0001}

:func:`grouped` builds the module's keyword arguments from fields named alone
(``DeepEPModule(**grouped(num_envs=8, cuda_graph=True))``), for code that sets a few fields of several groups.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from deepep_lightning import validation
from deepep_lightning.deepep.agent import DeepEPAgent
from deepep_lightning.deepep.envs import ENVIRONMENTS, BatchedEnv, make_env
from deepep_lightning.determinism.streams import derive_seed

__all__ = [
    "DeepEPConfig",
    "EnvConfig",
    "ExecutionConfig",
    "LossConfig",
    "NetworkConfig",
    "OptimConfig",
    "group_fields",
    "grouped",
]


def _positive_int(owner: str, name: str, value: Any, allow_none: bool = False) -> None:
    if allow_none and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        allowed = "a positive int or None" if allow_none else "a positive int"
        raise MisconfigurationException(f"`{owner}({name}=...)` must be {allowed}, got {value!r}")


def _in_range(owner: str, name: str, value: Any, low: float, high: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise MisconfigurationException(f"`{owner}({name}=...)` must be a number in [{low}, {high}], got {value!r}")


def _optional_bool(owner: str, name: str, value: Any) -> None:
    if value is not None:
        validation.strict_bool(owner, name, value)


@dataclass(frozen=True)
class EnvConfig:
    """The environments and the rollouts run on them.

    Args:
        name: ``"cartpole"`` (CartPole, 500-step episodes) or ``"memory"`` (cue recall, see ``kwargs``).
        num_envs: environments stepped together (B).
        rollout_length: timesteps per training step (T); BPTT runs over them.
        steps_per_epoch: training steps (rollouts) per epoch.
        kwargs: extra environment arguments, e.g. ``{"horizon": 512}`` for ``"memory"``.
        eval_envs: environments of the greedy evaluation, ``eval/greedy_return``
            (:func:`~deepep_lightning.deepep.greedy_evaluation.greedy_returns`); 0: none.
        eval_every_n_steps: optimizer steps between greedy evaluations. An evaluation runs only at a step whose
            logs Lightning writes: a multiple of the trainer's ``log_every_n_steps`` runs them all.
    """

    name: str = "cartpole"
    num_envs: int = 32
    rollout_length: int = 32
    steps_per_epoch: int = 50
    kwargs: dict[str, Any] | None = None
    eval_envs: int = 0
    eval_every_n_steps: int = 50

    def __post_init__(self) -> None:
        if self.name not in ENVIRONMENTS:
            raise MisconfigurationException(
                f"`EnvConfig(name=...)` must be one of {sorted(ENVIRONMENTS)}, got {self.name!r}"
            )
        for name in ("num_envs", "rollout_length", "steps_per_epoch", "eval_every_n_steps"):
            _positive_int("EnvConfig", name, getattr(self, name))
        if isinstance(self.eval_envs, bool) or not isinstance(self.eval_envs, int) or self.eval_envs < 0:
            raise MisconfigurationException(
                f"`EnvConfig(eval_envs=...)` must be a non-negative int (0: no greedy evaluation), "
                f"got {self.eval_envs!r}"
            )
        self.probe()  # the environment's own arguments

    def probe(self) -> BatchedEnv:
        """One environment on the CPU (its observation and action sizes), built from ``name`` and ``kwargs``.

        Raises:
            MisconfigurationException: ``kwargs`` the environment refuses.
        """
        try:
            return make_env(self.name, 1, "cpu", **(self.kwargs or {}))
        except ValueError as error:
            raise MisconfigurationException(f"`EnvConfig(kwargs=...)`: {error}") from error


@dataclass(frozen=True)
class NetworkConfig:
    """The agent's networks.

    Args:
        hidden_size: recurrent state and MLP width.
        value_hidden_size: value-head width H (default: ``hidden_size``).
        policy_reads_hidden: the policy reads ``[obs; h]`` (True) or the observation alone (False, for fully
            observed environments such as ``"cartpole"``): the recurrent state is the critic's, trained at its
            faster rate, and its changes move a policy that reads it. The critic, the value feedback and the
            recurrent cell are the same either way.
        logit_bound: squash the policy logits to ``c·tanh(z / c)``, ``c = logit_bound``: every action keeps
            a probability of at least ``1 / (1 + (A − 1)·e^{2c})``, so it keeps being tried and its Q trained
            (``agent.network.DeepEPAgent``). None: unbounded logits.
        chrono_horizon: chrono initialisation of the GRU's update gate for memory over up to this many
            steps (``>= 2``); None: PyTorch's default initialisation.
        detach_feedback: feed the value estimate back into the recurrent state without gradient.
    """

    hidden_size: int = 64
    value_hidden_size: int | None = None
    policy_reads_hidden: bool = True
    logit_bound: float | None = None
    chrono_horizon: int | None = None
    detach_feedback: bool = True

    def __post_init__(self) -> None:
        _positive_int("NetworkConfig", "hidden_size", self.hidden_size)
        _positive_int("NetworkConfig", "value_hidden_size", self.value_hidden_size, allow_none=True)
        validation.strict_bool("NetworkConfig", "policy_reads_hidden", self.policy_reads_hidden)
        validation.number(
            "NetworkConfig", "logit_bound", self.logit_bound, minimum=0, exclusive_minimum=True, finite=True,
            allow_none=True,
        )  # fmt: skip
        if self.chrono_horizon is not None:
            validation.int_at_least("NetworkConfig", "chrono_horizon", self.chrono_horizon, 2)
        validation.strict_bool("NetworkConfig", "detach_feedback", self.detach_feedback)


@dataclass(frozen=True)
class LossConfig:
    """The loss: returns, critic, entropy, target networks, truncation of BPTT.

    Args:
        gamma: discount.
        gae_lambda: λ of the critic's λ-return targets.
        reward_scale: rewards are multiplied by this for learning (episode returns are logged
            unscaled); keeps the critic's targets O(1) so Adam can fit them in a few hundred steps.
        value_coef: weight of the critic loss.
        expected_value_coef: weight (relative to the taken-action regression) of a second critic
            regression, of the expected value ``Σ_a π Q`` onto the same λ-returns: it moves the Q of every
            action with the value level, so the Q of actions the policy takes less does not go stale
            while values change fast (``agent.loss.deepep_loss``). 0: off.
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
        bptt_truncation: cut BPTT every this many steps (None: through the whole rollout).
    """

    gamma: float = 0.99
    gae_lambda: float = 0.95
    reward_scale: float = 0.05
    value_coef: float = 0.5
    expected_value_coef: float = 0.0
    entropy_coef: float = 0.001
    target_entropy: float | None = None
    entropy_coef_max: float = 0.05
    entropy_coef_rate: float = 0.2
    target_tau: float | None = None
    kl_coef: float = 0.0
    bptt_truncation: int | None = None

    def __post_init__(self) -> None:
        owner = "LossConfig"
        _in_range(owner, "gamma", self.gamma, 0.0, 1.0)
        _in_range(owner, "gae_lambda", self.gae_lambda, 0.0, 1.0)
        validation.number(owner, "reward_scale", self.reward_scale, minimum=0, exclusive_minimum=True, finite=True)
        for name in ("value_coef", "expected_value_coef", "entropy_coef", "kl_coef"):
            validation.number(owner, name, getattr(self, name), minimum=0.0, finite=True)
        validation.number(owner, "entropy_coef_max", self.entropy_coef_max, minimum=self.entropy_coef, finite=True)
        validation.number(owner, "entropy_coef_rate", self.entropy_coef_rate, minimum=0.0, exclusive_minimum=True)
        validation.number(
            owner, "target_tau", self.target_tau, minimum=0.0, maximum=1.0, exclusive_minimum=True, allow_none=True
        )
        if self.kl_coef > 0 and self.target_tau is None:
            raise MisconfigurationException(
                f"`LossConfig(kl_coef=...)` must be 0 without target networks, got {self.kl_coef!r} with "
                "target_tau=None (HINT: set target_tau, e.g. 0.05)"
            )
        if self.target_entropy is not None and self.entropy_coef <= 0:
            raise MisconfigurationException(
                f"`LossConfig(entropy_coef=...)` must be > 0 with target_entropy={self.target_entropy!r}, got"
                f" {self.entropy_coef!r} (HINT: the adaptive coefficient starts at entropy_coef and moves in log space)"
            )
        _positive_int(owner, "bptt_truncation", self.bptt_truncation, allow_none=True)


@dataclass(frozen=True)
class OptimConfig:
    """The optimizer, its learning rates and their decay, and gradient clipping.

    Args:
        optimizer: ``"adam"`` (default) or ``"sgd"`` (plain SGD; with a large learning rate it really
            diverges to Inf/NaN, which ``configs/nan_demo.yaml`` uses to show detection and recovery).
        learning_rate: the learning rate of the critic and the recurrent cell.
        policy_learning_rate: the policy network's learning rate (None: ``learning_rate``). A
            slower actor than critic (two time-scale actor-critic) keeps the all-action gradient from
            chasing the critic's errors on actions it has stopped taking.
        recurrent_learning_rate: the recurrent cell's learning rate (None: ``learning_rate``). The policy
            reads the recurrent state as a feature, and the critic trains the cell: at the critic's rate a
            change of the value level (the first failures after a long run of full-length episodes) moves
            the policy's inputs, and so its actions, within a few steps however slow its own rate is.
        policy_adam_eps: Adam's ``eps`` for the policy network (None: Adam's default, 1e-8). Adam divides
            each gradient by its running RMS, so a tiny but consistently signed policy gradient (the
            critic's state-independent error on an action the policy hardly takes) still moves every
            policy weight by the full learning rate each step. An ``eps`` at the scale of that gradient
            makes such steps proportional to the gradient (``lr·g / eps``, SGD with momentum) while large
            gradients keep Adam's normalised steps. Needs ``optimizer="adam"``.
        lr_decay_steps: decay every learning rate over this many training steps, stepwise and linearly, to
            ``1/lr_decay_stages`` of it (:mod:`~deepep_lightning.deepep.lr_decay`); None: constant rates.
        lr_decay_stages: the decay's stairs (each one re-captures the CUDA-graph step).
        max_grad_norm: clip the gradients' global norm to this (None: no clipping). Works on both
            paths, inside the graph for ``cuda_graph=True`` (where Lightning's ``gradient_clip_val``,
            an automatic-optimisation feature, is unavailable); eager runs may use either.
    """

    optimizer: str = "adam"
    learning_rate: float = 3e-3
    policy_learning_rate: float | None = 1e-4
    recurrent_learning_rate: float | None = None
    policy_adam_eps: float | None = None
    lr_decay_steps: int | None = None
    lr_decay_stages: int = 10
    max_grad_norm: float | None = None

    def __post_init__(self) -> None:
        owner = "OptimConfig"
        if self.optimizer not in ("adam", "sgd"):
            raise MisconfigurationException(f"`{owner}(optimizer=...)` must be 'adam' or 'sgd', got {self.optimizer!r}")
        validation.number(owner, "learning_rate", self.learning_rate, minimum=0, exclusive_minimum=True, finite=True)
        for name in ("policy_learning_rate", "recurrent_learning_rate", "policy_adam_eps"):
            validation.number(
                owner, name, getattr(self, name), minimum=0, exclusive_minimum=True, finite=True, allow_none=True
            )
        if self.policy_adam_eps is not None and self.optimizer != "adam":
            raise MisconfigurationException(
                f"`{owner}(policy_adam_eps=...)` must be None with optimizer={self.optimizer!r}, got"
                f" {self.policy_adam_eps!r} (HINT: it is Adam's eps for the policy group)"
            )
        _positive_int(owner, "lr_decay_steps", self.lr_decay_steps, allow_none=True)
        validation.int_at_least(owner, "lr_decay_stages", self.lr_decay_stages, 1)
        if self.max_grad_norm is not None:
            _in_range(owner, "max_grad_norm", self.max_grad_norm, 1e-12, float("inf"))


@dataclass(frozen=True)
class ExecutionConfig:
    """How a training step runs: fused kernels, compiled timesteps, the CUDA graph. Speed, not the maths.

    Args:
        fused_bptt: run the rollout's timesteps without autograd and its backward through time as one recurrent
            op, two kernels per timestep (:mod:`~deepep_lightning.deepep.agent.fused_bptt`): the same actions and
            gradients, to fp32 rounding. None: on where it pays, a CUDA device with the extension's CUDA kernels
            (resolved at the first step, when the device is known), off otherwise, so CPU runs keep the op-by-op
            autograd path; True also on CPU (the compiled CPU kernel or its PyTorch reference). Needs
            ``detach_feedback=True``; works eagerly, with ``cuda_graph`` (the graph captures the backward's loop
            of launches), with ``compile_step`` (the no-gradient timestep is compiled) and with virtual ranks.
        fused_rollout: with ``fused_bptt``, run the rollout's no-gradient timesteps on CartPole as one
            ``deepep::cartpole_rollout`` launch (:mod:`~deepep_lightning.deepep.agent.fused_rollout`: the agent's
            step, the sample and CartPole's step of every timestep in one kernel, the same random draws; actions
            and states equal the op-by-op loop's to rounding). None: on with CUDA where the kernel runs it (the
            extension's CUDA kernels, CartPole, float32/float64, ``compile_step=False``), resolved at each rollout;
            off otherwise, on CUDA after one warning naming why. True: also on CPU (the CPU kernel), and a
            rollout it cannot run raises naming why. False: the op-by-op timesteps, without a warning.
            Needs ``fused_bptt`` not False and ``compile_step=False``.
        fused_value_head: use the compiled ``deepep::all_action_q`` op for the value head; ``None``
            uses it when the extension loads.
        atomic_value_head: run the compiled op's atomic (``deterministic=False``) CUDA backward, not
            bitwise reproducible: a negative control for ``deepep-audit`` (its ``fused_atomic``
            variant). Needs the fused head; no effect on CPU, where the kernel is deterministic.
        compile_step: ``torch.compile`` the rollout's timestep (agent step, env step and state reset, forward
            and backward) into fused kernels (:class:`~deepep_lightning.deepep.agent.compiled_step.CompiledTimestep`);
            with ``cuda_graph`` the graph's warm-up compiles and the capture holds the generated kernels.
            Where torch.compile is unavailable (no C++ compiler, no triton) the timestep runs eagerly after
            one warning.
        cuda_graph: capture the whole training step as one CUDA graph (GPU only; manual optimisation).
    """

    fused_bptt: bool | None = None
    fused_rollout: bool | None = None
    fused_value_head: bool | None = None
    atomic_value_head: bool = False
    compile_step: bool = False
    cuda_graph: bool = False

    def __post_init__(self) -> None:
        owner = "ExecutionConfig"
        for name in ("fused_bptt", "fused_rollout", "fused_value_head"):
            _optional_bool(owner, name, getattr(self, name))
        for name in ("compile_step", "cuda_graph"):
            validation.strict_bool(owner, name, getattr(self, name))
        if not isinstance(self.atomic_value_head, bool) or (self.atomic_value_head and self.fused_value_head is False):
            raise MisconfigurationException(
                f"`{owner}(atomic_value_head=...)` must be a bool, True only with fused_value_head=True or None, "
                f"got {self.atomic_value_head!r} with fused_value_head={self.fused_value_head!r}"
            )
        if self.fused_rollout and (self.fused_bptt is False or self.compile_step):
            raise ValueError(
                f"`{owner}(fused_rollout=...)` must be None or False with fused_bptt={self.fused_bptt!r}, "
                f"compile_step={self.compile_step!r}, got {self.fused_rollout!r}: the kernel runs the no-gradient "
                "timesteps of the fused BPTT rollout, in place of the compiled timestep (HINT: leave fused_rollout "
                "at None)"
            )


#: The groups of :class:`DeepEPConfig`: the module's argument name and its dataclass.
GROUPS: dict[str, type] = {
    "env": EnvConfig,
    "network": NetworkConfig,
    "loss": LossConfig,
    "optim": OptimConfig,
    "execution": ExecutionConfig,
}


@dataclass(frozen=True)
class DeepEPConfig:
    """Every hyperparameter of :class:`~deepep_lightning.deepep.DeepEPModule`: the five groups and two run options.

    Building it checks what spans groups (each group checked its own fields).

    Args:
        seed: seeds the initial weights, the environments and the rollout streams (rank-aware).
        log_throughput: log ``perf/env_steps_per_s`` at the steps Lightning writes. Off by default: a
            wall-clock figure differs between two bitwise-identical runs (the configs turn it on;
            ``deepep-compare`` and ``deepep-audit l4`` leave ``perf/`` tags out).
    """

    env: EnvConfig = field(default_factory=EnvConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    execution: ExecutionConfig = field(default_factory=ExecutionConfig)
    seed: int = 0
    log_throughput: bool = False

    def __post_init__(self) -> None:
        for name, kind in GROUPS.items():
            value = getattr(self, name)
            if isinstance(value, dict):  # a checkpoint's hyperparameters hold each group as a dict
                object.__setattr__(self, name, kind(**value))
            elif not isinstance(value, kind):
                raise MisconfigurationException(
                    f"`DeepEPModule({name}=...)` must be of type {kind.__name__} or a dict of its fields, got {value!r}"
                )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise MisconfigurationException(f"`DeepEPModule(seed=...)` must be an int, got {self.seed!r}")
        validation.strict_bool("DeepEPModule", "log_throughput", self.log_throughput)
        run, network, loss = self.execution, self.network, self.loss
        if self.optim.optimizer == "sgd" and run.cuda_graph:
            raise MisconfigurationException(
                "`OptimConfig(optimizer='sgd')` cannot be used with cuda_graph=True"
                " (HINT: the graph needs Adam(capturable=True))"
            )
        if not network.detach_feedback and (run.fused_bptt or run.fused_rollout):
            switch = "fused_bptt" if run.fused_bptt else "fused_rollout"
            raise ValueError(
                f"`ExecutionConfig({switch}=...)` must be None or False with detach_feedback=False, got True:"
                " the fused backward follows the gradient through the recurrent state alone, and a fed-back value"
                f" with gradient adds paths through the cell's input (HINT: leave {switch} at None)"
            )
        if loss.target_entropy is not None:
            max_entropy = math.log(self.env.probe().num_actions)
            validation.number(
                "LossConfig",
                "target_entropy",
                loss.target_entropy,
                minimum=0.0,
                maximum=round(max_entropy, 6),
                allow_none=True,
            )

    def build_agent(self) -> DeepEPAgent:
        """The agent of this configuration; its initial weights are a pure function of ``seed``, whatever the
        global RNG holds (which is left untouched). ``fused_value_head=None`` takes the extension's op when it
        loads."""
        probe, network, run = self.env.probe(), self.network, self.execution
        fused_value_head = _extension_loads() if run.fused_value_head is None else run.fused_value_head
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(self.seed, "init"))
            return DeepEPAgent(
                probe.obs_dim,
                probe.num_actions,
                network.hidden_size,
                network.value_hidden_size,
                network.detach_feedback,
                fused_value_head,
                run.atomic_value_head,
                target_critic=self.loss.target_tau is not None,
                target_policy=self.loss.kl_coef > 0,
                chrono_horizon=network.chrono_horizon,
                logit_bound=network.logit_bound,
                policy_reads_hidden=network.policy_reads_hidden,
            )

    def as_dict(self) -> dict[str, Any]:
        """Each group as a dict of its fields: what the module saves as its hyperparameters."""
        return dataclasses.asdict(self)


def _extension_loads() -> bool:
    try:
        from deepep_lightning.ops import extension_available
    except ImportError:
        return False
    return bool(extension_available())


def group_fields(group: Any) -> dict[str, Any]:
    """A group as a dict of its fields, whether a dataclass (code) or a mapping (a config file); None: ``{}``."""
    if group is None:
        return {}
    if dataclasses.is_dataclass(group) and not isinstance(group, type):
        return dataclasses.asdict(group)
    return dict(group)


def grouped(**fields: Any) -> dict[str, Any]:
    """DeepEPModule's keyword arguments from fields named alone: each goes to its group, unset ones keep defaults.

    Example::

        DeepEPModule(**grouped(num_envs=8, hidden_size=16, cuda_graph=True, seed=3))

    Raises:
        TypeError: a name that is no group's field (the groups' fields listed).
    """
    owners = {f.name: group for group, kind in GROUPS.items() for f in dataclasses.fields(kind)}
    arguments: dict[str, Any] = {}
    per_group: dict[str, dict[str, Any]] = {}
    for name, value in fields.items():
        if name in ("seed", "log_throughput"):
            arguments[name] = value
        elif name in owners:
            per_group.setdefault(owners[name], {})[name] = value
        else:
            known = ", ".join(f"{group}: {sorted(n for n, g in owners.items() if g == group)}" for group in GROUPS)
            raise TypeError(f"grouped() got {name!r}, which is no field of DeepEPModule's groups ({known})")
    return {**{group: GROUPS[group](**values) for group, values in per_group.items()}, **arguments}
