"""The DeepEP timestep as one ``torch.compile``'d function: agent step, env step and state reset, forward and backward.

Eagerly every op of a timestep, forward and backward, is a kernel of its own on tensors of B x H, and a CUDA
graph of the whole training step replays them one by one: the step is bound by kernel count, not arithmetic
(``benchmarks/bench_train_step.py`` counts them). Inductor fuses the timestep's elementwise work (the
policy's tanh, the inverse-CDF sample, the one-hot, the value feedback, the GRU gates, CartPole's physics
and auto-reset) into a few kernels around the GEMMs, and AOTAutograd does the same for the backward. The
compiled code runs on the current stream without host syncs, so the CUDA graph of
:class:`~deepep_lightning.deepep.agent.graphed_step.GraphedTrainStep` captures the generated kernels: its
warm-up calls compile (forward at the first timestep, backward at the first ``backward()``) before the capture.

What stays outside the compiled region, and why:

- random numbers: the action's uniform and the env's noise (:meth:`BatchedEnv.draw_step_noise`) are drawn
  from the rollout's generator before the call and passed in, in the order :func:`eager_timestep` draws them,
  so both paths see the same numbers and the compiled code holds no RNG;
- an env without :meth:`BatchedEnv.step_with_noise` steps eagerly after the compiled agent step;
- under a ``TorchDispatchMode`` (which dynamo does not trace) the whole timestep runs eagerly, so the mode
  sees every op.

Determinism: the compiled code is built with inductor's ``deterministic`` option, which keeps inductor from
choosing kernel configurations by timing them where the choice changes the numerics (a reduction's block
size changes its summation order, so two processes could otherwise differ in the last bits). The timestep
has no scatter or index-add, so its generated code has no atomics.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch

from deepep_lightning.deepep.agent.network import AgentStep, DeepEPAgent
from deepep_lightning.deepep.agent.rollout import eager_timestep
from deepep_lightning.deepep.envs.base import BatchedEnv, StepResult

__all__ = [
    "COMPILE_OPTIONS",
    "CompiledTimestep",
    "agent_and_env_step",
    "agent_step",
    "compile_unavailable_reason",
    "compile_once",
]

#: Inductor options of the compiled timestep (see the module docstring for ``deterministic``).
COMPILE_OPTIONS: dict[str, Any] = {"deterministic": True}


def compile_unavailable_reason(device: torch.device | str) -> str | None:
    """Why ``torch.compile`` (inductor) cannot build code for ``device`` here, or None when it can.

    Checked in Python before anything compiles: dynamo's platform support, then inductor's backend for
    the device (a C++ compiler for CPU, a working triton for CUDA).
    """
    device = torch.device(device)
    if not torch._dynamo.is_dynamo_supported():
        return "torch.compile does not support this Python version or platform"
    if device.type == "cuda":
        from torch.utils._triton import has_triton

        return None if has_triton() else "inductor's CUDA backend needs triton, which is missing or sees no GPU"
    if device.type == "cpu":
        from torch._inductor import cpp_builder

        try:
            cpp_builder.get_cpp_compiler()
        except Exception as error:  # inductor raises its own InvalidCxxCompiler
            return f"inductor's CPU backend needs a C++ compiler (set CXX): {type(error).__name__}: {error}"
        return None
    return f"inductor builds code for cpu and cuda devices, not {device.type!r}"


def agent_and_env_step(
    agent: DeepEPAgent,
    env: BatchedEnv,
    obs: torch.Tensor,
    hidden: torch.Tensor,
    uniform: torch.Tensor,
    noise: torch.Tensor,
) -> tuple[AgentStep, StepResult, torch.Tensor]:
    """One timestep as the compiler sees it: the agent's step, the env's step with the given noise, the reset
    of the finished environments' recurrent state."""
    step = agent.step(obs, hidden, uniform)
    result = env.step_with_noise(step.action, noise)
    return step, result, step.hidden * (~result.done).unsqueeze(-1).to(step.hidden.dtype)


def agent_step(agent: DeepEPAgent, obs: torch.Tensor, hidden: torch.Tensor, uniform: torch.Tensor) -> AgentStep:
    """The agent's step alone (for an env whose step is not compiled)."""
    return agent.step(obs, hidden, uniform)


@functools.cache
def compile_once(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` under ``torch.compile`` with :data:`COMPILE_OPTIONS`, one wrapper per function for the process.

    Dynamo keys its cache by code object and backend, and the agent and env are arguments, so two modules of
    the same shapes share the compiled code.
    """
    return torch.compile(fn, backend="inductor", fullgraph=True, dynamic=False, options=dict(COMPILE_OPTIONS))


class CompiledTimestep:
    """One rollout timestep of ``agent`` on ``env`` with the agent's and the env's step compiled together.

    A drop-in for :func:`~deepep_lightning.deepep.agent.rollout.eager_timestep` (pass it as
    ``collect_rollout(..., timestep=...)``): same inputs, same random numbers, the same function to fp32
    rounding; gradients flow through it as through the eager ops. Compiling happens at the first call
    (and the backward at the first ``backward()``), with static shapes (``dynamic=False``) and the whole
    function as one graph (``fullgraph=True``: an op dynamo cannot trace is an error, never a silent split).

    The recurrent state enters the compiled code as a tensor that requires grad: where it does not (the
    rollout's first step, a BPTT truncation) it is passed as a fresh leaf, so every timestep runs one
    compiled graph instead of two; gradients still stop there.

    Args:
        agent: the network whose ``step`` is compiled.
        env: the environments; compiled with the agent when the env splits its step
            (:meth:`~deepep_lightning.deepep.envs.base.BatchedEnv.step_with_noise`), stepped eagerly otherwise.

    Attributes:
        compiled: False when ``torch.compile`` is unavailable for the env's device; then every call runs
            :func:`eager_timestep`, after one warning naming the reason.
        includes_env: whether the env's step runs inside the compiled region.

    Raises:
        TypeError: ``agent`` is not a :class:`DeepEPAgent` or ``env`` not a :class:`BatchedEnv`.

    Example::

        timestep = CompiledTimestep(agent, env)
        rollout = collect_rollout(agent, env, hidden, 32, generator, timestep=timestep)
        deepep_loss(rollout.logits, ...).backward()
    """

    def __init__(self, agent: DeepEPAgent, env: BatchedEnv) -> None:
        if not isinstance(agent, DeepEPAgent):
            raise TypeError(f"CompiledTimestep: agent must be a DeepEPAgent, got {type(agent).__name__} {agent!r}")
        if not isinstance(env, BatchedEnv):
            raise TypeError(f"CompiledTimestep: env must be a BatchedEnv, got {type(env).__name__} {env!r}")
        self.agent, self.env = agent, env
        kind = type(env)
        self.includes_env = (
            kind.step_with_noise is not BatchedEnv.step_with_noise
            and kind.draw_step_noise is not BatchedEnv.draw_step_noise
        )
        self.unavailable_reason = compile_unavailable_reason(env.device)
        self.compiled = self.unavailable_reason is None
        if not self.compiled:
            warnings.warn(
                f"CompiledTimestep: torch.compile is unavailable on {env.device} ({self.unavailable_reason}); "
                "the timestep runs eagerly (same function, not fused)",
                stacklevel=2,
            )

    def __call__(
        self, obs: torch.Tensor, hidden: torch.Tensor, generator: torch.Generator
    ) -> tuple[AgentStep, StepResult, torch.Tensor]:
        """``(obs [B, obs_dim], hidden [B, H], generator)`` to the agent's step, the env's step and ``h_{t+1}``."""
        # Dynamo does not trace under a TorchDispatchMode (NaNRollbackCallback's non-finite locator is one):
        # there the eager ops, which the mode is there to see, are the timestep.
        if not self.compiled or torch._C._len_torch_dispatch_stack() > 0:
            return eager_timestep(self.agent, self.env, obs, hidden, generator)
        uniform = torch.rand(self.env.num_envs, device=obs.device, generator=generator)  # [B]
        if torch.is_grad_enabled() and not hidden.requires_grad:
            hidden = hidden.detach().requires_grad_()
        if self.includes_env:
            noise = self.env.draw_step_noise(generator)
            return compile_once(agent_and_env_step)(self.agent, self.env, obs, hidden, uniform, noise)
        step = compile_once(agent_step)(self.agent, obs, hidden, uniform)
        result = self.env.step(step.action, generator)
        return step, result, step.hidden * (~result.done).unsqueeze(-1).to(step.hidden.dtype)
