"""Validation of :class:`~deepep_lightning.deepep.module.DeepEPModule`'s hyperparameters.

Every argument is checked before the module builds anything, and a bad one raises naming the argument,
its value and what is allowed. A file of its own: the checks are a third of the constructor and read
none of the module's state, only the arguments (``save_hyperparameters()``'s record of them).
"""

from __future__ import annotations

import math
from typing import Any

from lightning.fabric.utilities.data import AttributeDict
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from deepep_lightning import validation as _checks
from deepep_lightning.deepep.envs import ENVIRONMENTS, BatchedEnv, make_env

__all__ = ["check_arguments"]


def _require_positive_int(name: str, value: Any, allow_none: bool = False) -> None:
    if allow_none and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        allowed = "a positive int or None" if allow_none else "a positive int"
        raise MisconfigurationException(f"`DeepEPModule({name}=...)` must be {allowed}, got {value!r}")


def _require_in_range(name: str, value: Any, low: float, high: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise MisconfigurationException(
            f"`DeepEPModule({name}=...)` must be a number in [{low}, {high}], got {value!r}"
        )


def check_arguments(hp: AttributeDict) -> BatchedEnv:
    """Check ``DeepEPModule``'s arguments ``hp``; return a one-environment CPU probe (observation and action sizes).

    Raises:
        MisconfigurationException: an argument out of its range or of the wrong type, or two that do not go
            together (e.g. ``optimizer="sgd"`` with ``cuda_graph=True``).
        ValueError: ``fused_bptt=True`` with ``detach_feedback=False``; ``fused_rollout=True`` with
            ``fused_bptt=False``, ``compile_step=True`` or ``detach_feedback=False``.
    """
    if hp.env not in ENVIRONMENTS:
        raise MisconfigurationException(
            f"`DeepEPModule(env=...)` must be one of {sorted(ENVIRONMENTS)}, got {hp.env!r}"
        )
    for name, value in (
        ("num_envs", hp.num_envs),
        ("rollout_length", hp.rollout_length),
        ("hidden_size", hp.hidden_size),
        ("steps_per_epoch", hp.steps_per_epoch),
    ):
        _require_positive_int(name, value)
    _require_positive_int("value_hidden_size", hp.value_hidden_size, allow_none=True)
    _require_positive_int("bptt_truncation", hp.bptt_truncation, allow_none=True)
    _checks.number("DeepEPModule", "learning_rate", hp.learning_rate, minimum=0, exclusive_minimum=True, finite=True)
    _checks.number(
        "DeepEPModule", "policy_learning_rate", hp.policy_learning_rate, minimum=0, exclusive_minimum=True,
        finite=True, allow_none=True,
    )  # fmt: skip
    _checks.number(
        "DeepEPModule", "recurrent_learning_rate", hp.recurrent_learning_rate, minimum=0, exclusive_minimum=True,
        finite=True, allow_none=True,
    )  # fmt: skip
    if hp.optimizer not in ("adam", "sgd"):
        raise MisconfigurationException(f"`DeepEPModule(optimizer=...)` must be 'adam' or 'sgd', got {hp.optimizer!r}")
    if hp.optimizer == "sgd" and hp.cuda_graph:
        raise MisconfigurationException(
            "`DeepEPModule(optimizer='sgd')` cannot be used with cuda_graph=True"
            " (HINT: the graph needs Adam(capturable=True))"
        )
    _require_in_range("gamma", hp.gamma, 0.0, 1.0)
    _require_in_range("gae_lambda", hp.gae_lambda, 0.0, 1.0)
    _checks.number("DeepEPModule", "reward_scale", hp.reward_scale, minimum=0, exclusive_minimum=True, finite=True)
    _checks.number("DeepEPModule", "value_coef", hp.value_coef, minimum=0.0, finite=True)
    _checks.number("DeepEPModule", "entropy_coef", hp.entropy_coef, minimum=0.0, finite=True)
    _checks.number("DeepEPModule", "entropy_coef_max", hp.entropy_coef_max, minimum=hp.entropy_coef, finite=True)
    _checks.number("DeepEPModule", "entropy_coef_rate", hp.entropy_coef_rate, minimum=0.0, exclusive_minimum=True)
    _checks.number(
        "DeepEPModule",
        "target_tau",
        hp.target_tau,
        minimum=0.0,
        maximum=1.0,
        exclusive_minimum=True,
        allow_none=True,
    )
    _checks.number("DeepEPModule", "kl_coef", hp.kl_coef, minimum=0.0, finite=True)
    _checks.number("DeepEPModule", "expected_value_coef", hp.expected_value_coef, minimum=0.0, finite=True)
    for optional_name, optional_value in (("policy_adam_eps", hp.policy_adam_eps), ("logit_bound", hp.logit_bound)):
        _checks.number(
            "DeepEPModule", optional_name, optional_value, minimum=0, exclusive_minimum=True, finite=True,
            allow_none=True,
        )  # fmt: skip
    if hp.policy_adam_eps is not None and hp.optimizer != "adam":
        raise MisconfigurationException(
            f"`DeepEPModule(policy_adam_eps=...)` must be None with optimizer={hp.optimizer!r}, got"
            f" {hp.policy_adam_eps!r} (HINT: it is Adam's eps for the policy group)"
        )
    if hp.kl_coef > 0 and hp.target_tau is None:
        raise MisconfigurationException(
            f"`DeepEPModule(kl_coef=...)` must be 0 without target networks, got {hp.kl_coef!r} with target_tau=None"
            " (HINT: set target_tau, e.g. 0.05)"
        )
    _require_positive_int("lr_decay_steps", hp.lr_decay_steps, allow_none=True)
    _checks.int_at_least("DeepEPModule", "lr_decay_stages", hp.lr_decay_stages, 1)
    if hp.chrono_horizon is not None:
        _checks.int_at_least("DeepEPModule", "chrono_horizon", hp.chrono_horizon, 2)
    if hp.max_grad_norm is not None:
        _require_in_range("max_grad_norm", hp.max_grad_norm, 1e-12, float("inf"))
    for switch in ("cuda_graph", "detach_feedback", "log_throughput"):
        _checks.strict_bool("DeepEPModule", switch, hp[switch])
    _checks.strict_bool("DeepEPModule", "policy_reads_hidden", hp.policy_reads_hidden)
    _checks.strict_bool("DeepEPModule", "compile_step", hp.compile_step)
    if hp.fused_bptt is not None:
        _checks.strict_bool("DeepEPModule", "fused_bptt", hp.fused_bptt)
    if hp.fused_bptt and not hp.detach_feedback:
        raise ValueError(
            f"`DeepEPModule(fused_bptt=...)` must be None or False with detach_feedback=False, got {hp.fused_bptt!r}:"
            " the fused backward follows the gradient through the recurrent state alone, and a fed-back value"
            " with gradient adds paths through the cell's input (HINT: leave fused_bptt at None)"
        )
    if hp.fused_rollout is not None:
        _checks.strict_bool("DeepEPModule", "fused_rollout", hp.fused_rollout)
    if hp.fused_rollout and (hp.fused_bptt is False or hp.compile_step or not hp.detach_feedback):
        raise ValueError(
            f"`DeepEPModule(fused_rollout=...)` must be None or False with fused_bptt={hp.fused_bptt!r}, "
            f"compile_step={hp.compile_step!r}, detach_feedback={hp.detach_feedback!r}, got {hp.fused_rollout!r}:"
            " the kernel runs the no-gradient timesteps of the fused BPTT rollout, in place of the compiled timestep"
            " (HINT: leave fused_rollout at None)"
        )
    if isinstance(hp.seed, bool) or not isinstance(hp.seed, int):
        raise MisconfigurationException(f"`DeepEPModule(seed=...)` must be an int, got {hp.seed!r}")
    if not isinstance(hp.atomic_value_head, bool) or (hp.atomic_value_head and hp.fused_value_head is False):
        raise MisconfigurationException(
            f"`DeepEPModule(atomic_value_head=...)` must be a bool, True only with fused_value_head=True or None, "
            f"got {hp.atomic_value_head!r} with fused_value_head={hp.fused_value_head!r}"
        )
    try:
        probe = make_env(hp.env, 1, "cpu", **(hp.env_kwargs or {}))
    except ValueError as error:
        raise MisconfigurationException(f"`DeepEPModule(env_kwargs=...)`: {error}") from error
    max_entropy = math.log(probe.num_actions)
    _checks.number(
        "DeepEPModule",
        "target_entropy",
        hp.target_entropy,
        minimum=0.0,
        maximum=round(max_entropy, 6),
        allow_none=True,
    )
    if hp.target_entropy is not None and hp.entropy_coef <= 0:
        raise MisconfigurationException(
            f"`DeepEPModule(entropy_coef=...)` must be > 0 with target_entropy={hp.target_entropy!r}, got"
            f" {hp.entropy_coef!r} (HINT: the adaptive coefficient starts at entropy_coef and moves in log space)"
        )
    return probe
