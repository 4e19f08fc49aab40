"""The no-gradient timesteps of a CartPole rollout as one kernel launch: ``deepep::cartpole_rollout``.

:func:`~deepep_lightning.deepep.agent.fused_bptt.collect_rollout_fused` runs its T timesteps without autograd
and differentiates them afterwards. Op by op, each timestep is some 20-130 kernels on ``B x H`` tensors
(the policy, the value head, the sample, the GRU cell, CartPole's step), so a T=256 step is bound by kernel
count. Every quantity of a timestep belongs to one environment, though, so one kernel can run the whole
rollout: a block owns a few environments for all T timesteps (``extensions/csrc/deepep/cartpole_rollout.h``).

The random numbers are drawn before the launch, per timestep and in the op-by-op order (the action's
uniform, then CartPole's reset noise), so the kernel sees the numbers :func:`rollout_steps` sees; the
actions, rewards and states equal the op-by-op loop's to rounding (a sum of another order can flip an action
whose uniform lies within rounding of the CDF: the two paths then follow different trajectories).

That kernel streams every weight from L2 at every timestep. On Hopper, float32 runs
``deepep::cartpole_rollout_clusters`` instead (``extensions/csrc/deepep/cuda/cartpole_rollout_clusters.cu``): a
cluster of 8 blocks owns a few environments and splits each layer's units between its blocks, which keep their
weights in shared memory for the whole rollout and exchange the head's partial sums and the new recurrent
states through distributed shared memory. The kernel picks the environments per cluster (16 for 256
environments where 16 clusters of 8 blocks are resident at once) from the GPU's cluster residency. Its sums
run in the block kernel's order, so the two give equal bits.

:func:`rollout_steps` (the agent's and the env's own ops) is the reference; :func:`rollout_steps_fused` runs
the kernel on what :func:`fused_rollout_unsupported_reason` accepts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepep_lightning.deepep.agent.network import DeepEPAgent
from deepep_lightning.deepep.agent.rollout import Timestep, eager_timestep
from deepep_lightning.deepep.envs.base import BatchedEnv
from deepep_lightning.deepep.envs.cartpole import BatchedCartPole
from deepep_lightning.ops import on_extension_loaded

__all__ = [
    "RolloutSteps",
    "fused_rollout_unsupported_reason",
    "greedy_steps_fused",
    "rollout_steps",
    "rollout_steps_fused",
]

#: Rows per block of the CUDA kernel, at most (``kMaxRows`` in cartpole_rollout.h).
MAX_ROWS_PER_BLOCK = 8
#: Shared memory a block may use (bytes): the H200's opt-in maximum is 227 KiB.
MAX_SHARED_BYTES = 227 * 1024
_LANES, _OBS, _ACTIONS = 32, 4, 2
_FEEDBACK = _OBS + _ACTIONS + 1  # [obs; onehot(a); v]
#: The cluster kernel's blocks per cluster and its fewest and most environments per cluster (``kCluster``,
#: ``kMinClusterRows``, ``kMaxClusterRows``); the environments per cluster are a multiple of 4.
CLUSTER_BLOCKS, MIN_CLUSTER_ROWS, MAX_CLUSTER_ROWS = 8, 4, 64


@dataclass
class RolloutSteps:
    """T no-gradient timesteps of B environments; every tensor is ``[T, B, ...]``."""

    observations: torch.Tensor  # [T, B, obs_dim] obs_t
    feedback: torch.Tensor  # [T, B, obs_dim + A + 1] the recurrent cell's input [obs_t; onehot(a_t); v_t]
    states: torch.Tensor  # [T, B, H] h_{t+1}, zeroed where the episode ended at t
    actions: torch.Tensor  # [T, B] long
    rewards: torch.Tensor  # [T, B]
    dones: torch.Tensor  # [T, B] bool
    terminateds: torch.Tensor  # [T, B] bool
    returns: torch.Tensor  # [T, B] the finished episode's return where done, else 0


def rollout_steps(
    agent: DeepEPAgent,
    env: BatchedEnv,
    hidden: torch.Tensor,
    length: int,
    generator: torch.Generator,
    timestep: Timestep | None = None,
) -> RolloutSteps:
    """``length`` timesteps op by op, without gradient (``timestep``: how each runs; None: :func:`eager_timestep`)."""
    fields: dict[str, list[torch.Tensor]] = {name: [] for name in RolloutSteps.__dataclass_fields__}
    obs = env.observe()  # [B, obs_dim]
    run = timestep or _eager(agent, env)
    with torch.no_grad():
        for _ in range(length):
            step, result, hidden = run(obs, hidden, generator)
            assert step.feedback is not None
            for name, value in (
                ("observations", obs),
                ("feedback", step.feedback),
                ("states", hidden),
                ("actions", step.action),
                ("rewards", result.reward),
                ("dones", result.done),
                ("terminateds", result.terminated),
                ("returns", result.episode_return),
            ):
                fields[name].append(value)
            obs = result.obs
    return RolloutSteps(**{name: torch.stack(values) for name, values in fields.items()})


def _eager(agent: DeepEPAgent, env: BatchedEnv) -> Timestep:
    return lambda obs, hidden, generator: eager_timestep(agent, env, obs, hidden, generator)


def _policy_layers(agent: DeepEPAgent) -> tuple[torch.nn.Linear, torch.nn.Linear]:
    first, last = agent.policy_net[0], agent.policy_net[2]
    assert isinstance(first, torch.nn.Linear) and isinstance(last, torch.nn.Linear)
    return first, last


def shared_memory_bytes(agent: DeepEPAgent, dtype: torch.dtype) -> int:
    """Shared memory per block of the kernel (``shared_scalars`` in cartpole_rollout.h, for ``kMaxRows`` rows)."""
    rows, size = MAX_ROWS_PER_BLOCK, agent.hidden_size
    policy_hidden = _policy_layers(agent)[0].out_features
    value_hidden = agent.value_head.input_layer.out_features
    # per row: [obs; h], p1, z, the head's partial sums and outputs, the feedback, keep, h_{t+1}, CartPole's state
    scalars = rows * (
        (_OBS + size)
        + policy_hidden
        + value_hidden
        + 2 * _ACTIONS * _LANES
        + 2 * _ACTIONS
        + _FEEDBACK
        + 1
        + size
        + _OBS
        + 2
    )
    return scalars * torch.empty((), dtype=dtype).element_size()


def cluster_shared_memory_bytes(agent: DeepEPAgent, rows: int = MIN_CLUSTER_ROWS) -> int:
    """Shared memory per block of the float32 cluster kernel with ``rows`` environments per cluster (``Layout`` in
    cartpole_rollout_clusters.cu)."""

    def units(n: int) -> int:  # the most units a block owns: j = rank + 8 i < n
        return -(-n // CLUSTER_BLOCKS)

    def padded(n: int) -> int:  # a weight row's stride: 4 x an odd number of float4s
        quads = -(-n // 4)
        return 4 * (quads + (quads % 2 == 0))

    def round4(n: int) -> int:
        return -(-n // 4) * 4

    first = _policy_layers(agent)[0]
    size = agent.hidden_size
    up, uv, uh = units(first.out_features), units(agent.value_head.input_layer.out_features), units(size)
    parts = [
        up * padded(first.in_features),  # the block's policy, value-head and GRU weights
        uv * padded(_OBS + size),
        3 * uh * padded(size),
        3 * uh * _FEEDBACK,
        2 * rows * round4(_OBS + size),  # inputs [obs; h] of this timestep and the next
        rows * up,
        rows * uv,
        2 * _ACTIONS * rows * (_LANES // CLUSTER_BLOCKS),
        rows * 2 * _ACTIONS,
        rows * _FEEDBACK,
        rows,
        rows * (_OBS + 2),
    ]
    return 4 * sum(round4(part) for part in parts)


def runs_on_clusters(agent: DeepEPAgent, env: BatchedEnv) -> bool:
    """Whether :func:`rollout_steps_fused` picks ``deepep::cartpole_rollout_clusters``: float32 on a GPU with
    thread-block clusters (compute capability 9.0+) and the blocks' weights, with the fewest environments per
    cluster, within its shared memory."""
    if env.device.type != "cuda" or agent.rnn_cell.weight_hh.dtype != torch.float32:
        return False
    properties = torch.cuda.get_device_properties(env.device)
    return properties.major >= 9 and cluster_shared_memory_bytes(agent) <= MAX_SHARED_BYTES


def fused_rollout_unsupported_reason(agent: DeepEPAgent, env: BatchedEnv) -> str | None:
    """Why ``deepep::cartpole_rollout`` cannot run ``agent`` on ``env``, or None when it can.

    It runs DeepEP on CartPole (two actions, four observations), float32 or float64 everywhere, with the
    extension's kernel for the device, the module's standard layers (biases included) and a block's
    shared memory within the device's limit.
    """
    from deepep_lightning.ops import cuda_kernels_available, extension_available

    if type(env) is not BatchedCartPole:
        return f"the fused rollout steps CartPole only, got {type(env).__name__}"
    if (agent.obs_dim, agent.num_actions) != (_OBS, _ACTIONS):
        return f"the fused rollout needs obs_dim=4 and 2 actions, got {agent.obs_dim} and {agent.num_actions}"
    layers = (*_policy_layers(agent), agent.value_head.input_layer)
    if any(layer.bias is None for layer in layers) or not agent.rnn_cell.bias:
        return "the fused rollout needs the policy's, the value head's and the GRU cell's biases"
    dtype = agent.rnn_cell.weight_hh.dtype
    tensors = [*agent.parameters(), env.state, env.episode_return, env.episode_length]
    if dtype not in (torch.float32, torch.float64) or any(t.dtype != dtype for t in tensors):
        return f"the fused rollout needs float32 or float64 for every weight and env state, got {dtype} and others"
    if any(t.device != env.state.device for t in tensors):
        return f"the fused rollout needs the agent and the env on one device ({env.state.device})"
    if not extension_available() or (env.device.type == "cuda" and not cuda_kernels_available()):
        return f"the extension's {env.device.type} kernels are not available"
    if env.device.type not in ("cpu", "cuda"):
        return f"the fused rollout runs on cpu and cuda, not {env.device.type}"
    if shared_memory_bytes(agent, dtype) > MAX_SHARED_BYTES:
        return f"hidden_size={agent.hidden_size} needs more shared memory per block than {MAX_SHARED_BYTES} bytes"
    return None


def _weights(agent: DeepEPAgent) -> list[torch.Tensor]:
    """The op's weights, in its order; the input layers transposed to ``[in, out]``."""
    policy_in, policy_out = _policy_layers(agent)
    head, cell = agent.value_head, agent.rnn_cell
    return [
        policy_in.weight.t().contiguous(),
        policy_in.bias,
        policy_out.weight,
        policy_out.bias,
        head.input_layer.weight.t().contiguous(),
        head.input_layer.bias,
        head.action_embedding,
        head.output_weight,
        head.output_bias,
        cell.weight_ih.t().contiguous(),
        cell.bias_ih,
        cell.weight_hh.t().contiguous(),
        cell.bias_hh,
    ]


def default_rows_per_block(batch: int, device: torch.device) -> int:
    """Rows per block: each block reads every weight once per timestep for its rows, so blocks own as many rows as
    keeps every SM busy (B / rows blocks), up to ``MAX_ROWS_PER_BLOCK``."""
    if device.type != "cuda":
        return MAX_ROWS_PER_BLOCK
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    rows = 1
    while rows < MAX_ROWS_PER_BLOCK and batch // (rows * 2) >= sms // 4:
        rows *= 2
    return rows


def rollout_steps_fused(
    agent: DeepEPAgent,
    env: BatchedEnv,
    hidden: torch.Tensor,
    length: int,
    generator: torch.Generator,
    rows_per_block: int | None = None,
) -> RolloutSteps:
    """:func:`rollout_steps` as one kernel launch; the env's state moves on in place.

    ``rows_per_block=None`` runs the cluster kernel where :func:`runs_on_clusters`, else the block kernel with
    :func:`default_rows_per_block`; an int runs the block kernel with that many rows per block.

    Raises:
        ValueError: what :func:`fused_rollout_unsupported_reason` names, or ``rows_per_block`` outside
            ``[1, 8]``; both before the compiled op runs.
    """
    clusters, rows = _kernel_choice("rollout_steps_fused", agent, env, hidden, rows_per_block)
    uniforms, noise = [], []
    for _ in range(length):  # the op-by-op order of draws: the action's uniform, then the env's step noise
        uniforms.append(torch.rand(env.num_envs, device=env.device, generator=generator))
        noise.append(env.draw_step_noise(generator))
    return _launch(agent, env, hidden, torch.stack(uniforms), torch.stack(noise), clusters, rows)


def greedy_steps_fused(
    agent: DeepEPAgent, env: BatchedEnv, hidden: torch.Tensor, length: int, rows_per_block: int | None = None
) -> RolloutSteps:
    """``length`` timesteps of the greedy policy as one kernel launch; no number is drawn.

    Every action's uniform is 1/2, so the kernel takes the action whose softmax probability exceeds one half:
    with CartPole's two actions the argmax of the logits, but for logits within rounding of a tie. An
    environment whose episode ends resets to the middle of CartPole's reset box (all of its noise 1/2).
    Arguments and errors as :func:`rollout_steps_fused`.
    """
    clusters, rows = _kernel_choice("greedy_steps_fused", agent, env, hidden, rows_per_block)
    assert isinstance(env, BatchedCartPole)
    half = torch.full((length, env.num_envs), 0.5, dtype=env.state.dtype, device=env.device)
    return _launch(agent, env, hidden, half, half.unsqueeze(-1).expand(-1, -1, _OBS), clusters, rows)


def _kernel_choice(
    caller: str, agent: DeepEPAgent, env: BatchedEnv, hidden: torch.Tensor, rows_per_block: int | None
) -> tuple[bool, int]:
    """(whether the cluster kernel runs, the block kernel's rows per block), after the checks the callers document."""
    reason = fused_rollout_unsupported_reason(agent, env)
    if reason is not None:
        raise ValueError(f"{caller}: {reason}. HINT: use rollout_steps")
    clusters = rows_per_block is None and runs_on_clusters(agent, env)
    if rows_per_block is None:
        rows_per_block = default_rows_per_block(env.num_envs, env.device)
    if isinstance(rows_per_block, bool) or not isinstance(rows_per_block, int) or not 1 <= rows_per_block <= 8:
        raise ValueError(f"{caller}: rows_per_block must be an int in [1, 8], got {rows_per_block!r}")
    if tuple(hidden.shape) != (env.num_envs, agent.hidden_size):
        raise ValueError(f"{caller}: hidden must be [{env.num_envs}, {agent.hidden_size}], got {tuple(hidden.shape)}")
    return clusters, rows_per_block


def _launch(
    agent: DeepEPAgent,
    env: BatchedEnv,
    hidden: torch.Tensor,
    uniforms: torch.Tensor,
    noise: torch.Tensor,
    clusters: bool,
    rows_per_block: int,
) -> RolloutSteps:
    assert isinstance(env, BatchedCartPole)
    bound = float(agent.logit_bound) if agent.logit_bound is not None else 0.0
    inputs = (
        env.state,
        env.episode_return,
        env.episode_length,
        hidden.detach().to(env.state.dtype),
        uniforms.to(env.state.dtype),
        noise.to(env.state.dtype),
        _weights(agent),
        bound,
        env.max_episode_steps,
    )
    with torch.no_grad():
        if clusters:
            out = torch.ops.deepep.cartpole_rollout_clusters.default(*inputs)
        else:
            out = torch.ops.deepep.cartpole_rollout.default(*inputs, rows_per_block)
    env.state.copy_(out[8])
    env.episode_return.copy_(out[9])
    env.episode_length.copy_(out[10])
    return RolloutSteps(*out[:8])


def _fake(
    state: torch.Tensor,
    episode_return: torch.Tensor,
    episode_length: torch.Tensor,
    hidden: torch.Tensor,
    uniforms: torch.Tensor,
    noise: torch.Tensor,
    weights: list[torch.Tensor],
    logit_bound: float,
    max_episode_steps: int,
    rows_per_block: int = 1,  # deepep::cartpole_rollout_clusters has no such argument
) -> tuple[torch.Tensor, ...]:
    steps, (batch, size) = uniforms.shape[0], hidden.shape
    return (
        hidden.new_empty(steps, batch, _OBS),
        hidden.new_empty(steps, batch, _FEEDBACK),
        hidden.new_empty(steps, batch, size),
        hidden.new_empty(steps, batch, dtype=torch.long),
        hidden.new_empty(steps, batch),
        hidden.new_empty(steps, batch, dtype=torch.bool),
        hidden.new_empty(steps, batch, dtype=torch.bool),
        hidden.new_empty(steps, batch),
        state.new_empty(state.shape),
        episode_return.new_empty(episode_return.shape),
        episode_length.new_empty(episode_length.shape),
    )


def _register() -> None:
    torch.library.register_fake("deepep::cartpole_rollout")(_fake)
    torch.library.register_fake("deepep::cartpole_rollout_clusters")(_fake)


on_extension_loaded(_register)
