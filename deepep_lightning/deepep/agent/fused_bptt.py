"""The DeepEP rollout with its backward through time as one recurrent-backward op (two kernels per timestep).

With ``detach_feedback=True`` the recurrent cell's input ``f_t = [obs_t; onehot(a_t); v_t]`` carries no
gradient and the policy reads ``h_t`` detached, so the only gradient path through time is the critic's:
value loss → ``q_t = value_head([obs_t; h_t])`` → ``h_t = m_{t-1}·GRUCell(f_{t-1}, h_{t-1})`` → ... (``m = ~done``).
Autograd of the op-by-op rollout (:func:`~deepep_lightning.deepep.agent.rollout.collect_rollout`) walks that path
with every forward and backward op of every timestep a kernel on ``B x H`` tensors. Here instead:

1. the timestep loop runs under ``torch.no_grad()`` with the same ops and the same random draws, so actions,
   rewards and observations are the same function of the generator; it records ``f_t``, ``m_t`` and the
   masked states ``h_1..h_T``;
2. after the loop, :func:`gru_sequence` returns those states as a differentiable function of the cell's
   weights (its forward recomputes nothing), and the value head and the policy run once over all ``T·B``
   rows (one GEMM per layer);
3. :func:`gru_sequence`'s backward computes every gate pre-activation with two GEMMs over ``T·B`` rows, then
   per timestep, from the last, one ``deepep::gru_cell_backward`` kernel and one ``addmm``
   (:mod:`deepep_lightning.deepep.kernels.gru_backward`), and the weight gradients with one GEMM or column sum each
   over all timesteps: fixed order, no atomics.

The :class:`~deepep_lightning.deepep.agent.rollout.Rollout` it returns has the same fields and values (the
logits and Q to fp32 rounding: a batched GEMM sums in another order than a per-timestep one), so the loss
and everything after it is unchanged. Everything runs on the current stream without host syncs, so a CUDA
graph of the training step captures the backward's loop of launches.
"""

from __future__ import annotations

from typing import Any

import torch

from deepep_lightning.deepep.agent.fused_rollout import rollout_steps, rollout_steps_fused
from deepep_lightning.deepep.agent.network import DeepEPAgent
from deepep_lightning.deepep.agent.rollout import Rollout, Timestep
from deepep_lightning.deepep.envs.base import BatchedEnv
from deepep_lightning.deepep.kernels.gru_backward import check_gru_cell_backward_inputs, gru_cell_backward_unchecked

__all__ = ["collect_rollout_fused", "fused_bptt_unsupported_reason", "gru_sequence"]


def fused_bptt_unsupported_reason(agent: DeepEPAgent) -> str | None:
    """Why :func:`collect_rollout_fused` cannot train ``agent`` exactly as the op-by-op rollout, or None when it can."""
    if not agent.detach_feedback:
        return (
            "with detach_feedback=False the value fed back into the recurrent cell carries gradient, so the "
            "gradient through time has paths besides the recurrent state's"
        )
    return None


class _GRUSequence(torch.autograd.Function):
    """The masked states of a GRU rollout, computed already; the backward is truncated BPTT."""

    @staticmethod
    def forward(
        ctx: Any,
        inputs: torch.Tensor,
        initial: torch.Tensor,
        masks: torch.Tensor,
        states: torch.Tensor,
        weight_ih: torch.Tensor,
        weight_hh: torch.Tensor,
        bias_ih: torch.Tensor | None,
        bias_hh: torch.Tensor | None,
        truncation: int | None,
    ) -> torch.Tensor:
        ctx.save_for_backward(inputs, initial, masks, states, weight_ih, weight_hh, bias_ih, bias_hh)
        ctx.truncation = truncation
        return states

    @staticmethod
    def backward(ctx: Any, grad_states: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        inputs, initial, masks, states, weight_ih, weight_hh, bias_ih, bias_hh = ctx.saved_tensors
        truncation: int | None = ctx.truncation
        length, batch, size = states.shape
        grad_states = grad_states.contiguous()
        previous = torch.cat((initial.unsqueeze(0), states[:-1]), dim=0)  # [T, B, H]: h_t read by step t
        flat_inputs, flat_previous = inputs.reshape(length * batch, -1), previous.reshape(length * batch, size)
        # gate pre-activations of every timestep, two GEMMs: [T, B, 3H] each, gates [r, z, n]
        input_gates = _affine(flat_inputs, weight_ih, bias_ih).view(length, batch, 3 * size)
        hidden_gates = _affine(flat_previous, weight_hh, bias_hh).view(length, batch, 3 * size)
        check_gru_cell_backward_inputs(
            grad_states[0], grad_states[0], masks[0], input_gates[0], hidden_gates[0], previous[0]
        )
        zero_gates = input_gates.new_zeros(batch, 3 * size)
        carry = states.new_zeros(batch, size)  # dL/dh_{t+1} through step t + 1
        grad_input_gates: list[torch.Tensor] = [zero_gates] * length
        grad_hidden_gates: list[torch.Tensor] = [zero_gates] * length
        need_initial = ctx.needs_input_grad[1]
        steps_with_gradient = 0
        for t in range(length - 1, -1, -1):
            if truncation is not None and _cut_before(t, truncation):
                # no gradient reaches step t, and the gradient through time starts again from zero
                carry = states.new_zeros(batch, size)
                continue
            steps_with_gradient += 1
            grad_input_gates[t], grad_hidden_gates[t], through_blend = gru_cell_backward_unchecked(
                grad_states[t], carry, masks[t], input_gates[t], hidden_gates[t], previous[t]
            )
            if t > 0 or need_initial:
                carry = torch.addmm(through_blend, grad_hidden_gates[t], weight_hh)  # dL/dh_t
        stacked_input_gates = torch.stack(grad_input_gates).view(length * batch, 3 * size)
        stacked_hidden_gates = torch.stack(grad_hidden_gates).view(length * batch, 3 * size)
        # No step on a gradient path (bptt_truncation=1 cuts every state): no gradient, as in collect_rollout,
        # where the cell then never enters the graph (an optimizer skips it instead of stepping on zeros).
        needs = ctx.needs_input_grad if steps_with_gradient > 0 else (False,) * 9
        grad_inputs = torch.mm(stacked_input_gates, weight_ih).view_as(inputs) if needs[0] else None
        grad_initial = carry if needs[1] else None
        grad_weight_ih = torch.mm(stacked_input_gates.t(), flat_inputs) if needs[4] else None
        grad_weight_hh = torch.mm(stacked_hidden_gates.t(), flat_previous) if needs[5] else None
        grad_bias_ih = stacked_input_gates.sum(dim=0) if needs[6] else None
        grad_bias_hh = stacked_hidden_gates.sum(dim=0) if needs[7] else None
        return grad_inputs, grad_initial, None, None, grad_weight_ih, grad_weight_hh, grad_bias_ih, grad_bias_hh, None


def _cut_before(t: int, truncation: int) -> bool:
    """Whether collect_rollout detaches ``h_{t+1}``, the state step ``t`` writes, before anything reads it.

    It does at ``t + 1 = k, 2k, ...``: the value head at ``t + 1`` and the cell's step ``t + 1`` both read
    the detached state, so no gradient w.r.t. ``h_{t+1}`` exists at all.
    """
    return (t + 1) % truncation == 0


def _affine(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.mm(rows, weight.t()) if bias is None else torch.addmm(bias, rows, weight.t())


def gru_sequence(
    inputs: torch.Tensor,
    initial: torch.Tensor,
    masks: torch.Tensor,
    states: torch.Tensor,
    cell: torch.nn.GRUCell,
    bptt_truncation: int | None = None,
) -> torch.Tensor:
    """``states`` as a differentiable function of ``cell``'s weights: truncated BPTT in two kernels per timestep.

    ``states[t] = masks[t] · cell(inputs[t], states[t - 1])`` (``states[-1]`` read as ``initial``) must hold:
    the forward returns ``states`` as they are, the backward differentiates that recurrence.

    Args:
        inputs: ``[T, B, in]`` the cell's inputs ``f_t``.
        initial: ``[B, H]`` the state step 0 reads.
        masks: ``[T, B]`` 1 where the episode goes on after step t, 0 where it ended; ``states``'s dtype.
        states: ``[T, B, H]`` the masked states ``h_1..h_T``, computed without gradient.
        cell: the GRU cell whose weights get the gradients.
        bptt_truncation: as in :func:`~deepep_lightning.deepep.agent.rollout.collect_rollout`: the state
            ``h_t`` is cut at every ``t % bptt_truncation == 0, t > 0`` (no gradient reaches anything before
            it from ``h_t``, nor from the value head's read of it). None: through the whole sequence.

    Returns:
        ``[T, B, H]``, equal to ``states``, with a gradient path into ``cell`` (and into ``inputs`` and
        ``initial`` where they require grad).

    Raises:
        ValueError: shapes that do not fit ``[T, B, ...]`` and the cell, or a truncation that is not a positive int.

    Example::

        states = gru_sequence(inputs, h0, masks, states, agent.rnn_cell, bptt_truncation=16)
        agent.value_head(torch.cat((obs, torch.cat((h0[None], states[:-1])), dim=-1)))
    """
    if bptt_truncation is not None and (
        isinstance(bptt_truncation, bool) or not isinstance(bptt_truncation, int) or bptt_truncation <= 0
    ):
        raise ValueError(f"gru_sequence: bptt_truncation must be a positive int or None, got {bptt_truncation!r}")
    if states.dim() != 3 or states.shape[-1] != cell.hidden_size:
        raise ValueError(f"gru_sequence: states must be [T, B, {cell.hidden_size}], got shape {tuple(states.shape)}")
    length, batch, _ = states.shape
    if inputs.dim() != 3 or tuple(inputs.shape) != (length, batch, cell.input_size):
        raise ValueError(
            f"gru_sequence: inputs must be [{length}, {batch}, {cell.input_size}], got shape {tuple(inputs.shape)}"
        )
    if tuple(initial.shape) != (batch, cell.hidden_size):
        raise ValueError(f"gru_sequence: initial must be [{batch}, {cell.hidden_size}], got {tuple(initial.shape)}")
    if tuple(masks.shape) != (length, batch) or masks.dtype != states.dtype:
        raise ValueError(
            f"gru_sequence: masks must be [{length}, {batch}] of {states.dtype}, got {tuple(masks.shape)} {masks.dtype}"
        )
    return _apply(inputs, initial, masks, states, cell, bptt_truncation)


def _apply(
    inputs: torch.Tensor,
    initial: torch.Tensor,
    masks: torch.Tensor,
    states: torch.Tensor,
    cell: torch.nn.GRUCell,
    bptt_truncation: int | None,
) -> torch.Tensor:
    bias_ih = cell.bias_ih if cell.bias else None
    bias_hh = cell.bias_hh if cell.bias else None
    return _GRUSequence.apply(
        inputs, initial, masks, states.detach(), cell.weight_ih, cell.weight_hh, bias_ih, bias_hh, bptt_truncation
    )


def collect_rollout_fused(
    agent: DeepEPAgent,
    env: BatchedEnv,
    hidden: torch.Tensor,
    length: int,
    generator: torch.Generator,
    bptt_truncation: int | None = None,
    timestep: Timestep | None = None,
    fused_rollout: bool = False,
) -> Rollout:
    """:func:`~deepep_lightning.deepep.agent.rollout.collect_rollout` with the backward through time as one op.

    Same arguments, same :class:`Rollout` (the module docstring says how and what differs: the rounding of
    ``logits`` and ``q``). ``timestep`` runs each timestep of the no-gradient loop (a
    :class:`~deepep_lightning.deepep.agent.compiled_step.CompiledTimestep` compiles it for inference);
    ``fused_rollout=True`` runs the whole loop as one ``deepep::cartpole_rollout`` launch instead
    (:mod:`~deepep_lightning.deepep.agent.fused_rollout`). ``hidden`` is read without gradient, as the module's
    recurrent state (a buffer) always is.

    Raises:
        ValueError: the agent is one this path cannot train exactly (:func:`fused_bptt_unsupported_reason`), or
            ``fused_rollout=True`` where the kernel does not run (its reason named).
    """
    reason = fused_bptt_unsupported_reason(agent)
    if reason is not None:
        raise ValueError(f"collect_rollout_fused: {reason}. HINT: use collect_rollout")
    if length < 1:
        raise ValueError(f"collect_rollout_fused: length must be >= 1, got {length!r}")
    initial = hidden.detach()
    if fused_rollout:
        steps = rollout_steps_fused(agent, env, initial, length, generator)
    else:
        steps = rollout_steps(agent, env, initial, length, generator, timestep)
    obs = env.observe()  # [B, obs_dim] s_T
    stored = steps.states  # [T, B, H]: h_1..h_T
    with torch.no_grad():
        last_logits, last_q = agent.evaluate(obs, stored[-1])
        bootstrap = (torch.softmax(last_logits, dim=-1) * last_q).sum(dim=-1)
    observed, done = steps.observations, steps.dones  # [T, B, obs_dim], [T, B]
    read = initial.unsqueeze(0)  # [T, B, H]: h_0..h_{T-1} as the value head reads them, with gradient
    if length > 1:  # h_T is read without gradient (bootstrap, features): the last step is not differentiated
        masks = (~done[:-1]).to(stored.dtype)
        recurrent = gru_sequence(steps.feedback[:-1], initial, masks, stored[:-1], agent.rnn_cell, bptt_truncation)
        read = torch.cat((read, recurrent), dim=0)
    rows = length * env.num_envs
    q = agent.value_head(torch.cat((observed, read), dim=-1).reshape(rows, -1)).view(length, env.num_envs, -1)
    policy_input = agent._policy_input(torch.cat((observed, read.detach()), dim=-1)).reshape(rows, -1)
    logits = agent._bounded(agent.policy_net(policy_input)).view(length, env.num_envs, -1)
    features = torch.cat(
        (torch.cat((observed, obs.unsqueeze(0))), torch.cat((initial.unsqueeze(0), stored))), dim=-1
    )  # [T + 1, B, obs_dim + H]: [obs_t; h_t] at s_0..s_T
    return Rollout(
        logits,
        q,
        steps.actions,
        steps.rewards,
        done,
        steps.terminateds,
        steps.returns,
        bootstrap,
        stored[-1].detach(),
        features,
        last_logits,
    )
