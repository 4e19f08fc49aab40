"""The DeepEP network: policy, all-action value head and the value-feedback recurrent cell."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from deepep_lightning.deepep.agent.value_head import AllActionValueHead

__all__ = ["DeepEPAgent", "AgentStep", "chrono_init_"]


@dataclass
class AgentStep:
    """What one timestep produces for B environments."""

    logits: torch.Tensor  # [B, A]
    q: torch.Tensor  # [B, A] Q(s_t, a) for every action
    action: torch.Tensor  # [B] long
    hidden: torch.Tensor  # [B, H] h_{t+1}
    features: torch.Tensor  # [B, obs_dim + H] the value head's input [obs_t; h_t], detached
    feedback: torch.Tensor | None = None  # [B, obs_dim + A + 1] the recurrent cell's input [obs_t; onehot(a_t); v_t]


class DeepEPAgent(nn.Module):
    """Recurrent expected-policy-gradient agent (the seed's loop, one timestep per call).

    Per timestep, over B environments::

        logits = policy_net([obs_t; h_t])              # [B, A]
        a_t    ~ Categorical(logits)                   # inverse-CDF on a uniform from an explicit generator
        q_t    = value_head([obs_t; h_t])              # [B, A], Q for every action
        v_t    = q_t[a_t]                              # value estimate of the taken action
        h_t+1  = GRUCell([obs_t; onehot(a_t); v_t], h_t)   # the value fed back into the state

    Args:
        obs_dim: observation size.
        num_actions: A.
        hidden_size: recurrent state size (and MLP width).
        value_hidden_size: H of the value head (default ``hidden_size``).
        detach_feedback: feed ``v_t`` back without gradient (the critic is then trained only by
            its regression loss); ``False`` lets BPTT flow through the feedback path too.
        fused_value_head: run the value head's second layer with the compiled op.
        atomic_value_head: with the compiled op, its atomic (not bitwise reproducible) CUDA backward.
        target_critic: keep ``target_value_head``, a copy of the value head without gradients that the
            module moves toward the online head by Polyak averaging (see ``agent.targets``).
        target_policy: keep ``target_policy_net``, the same for the policy network (the anchor of
            the loss's KL trust region).
        chrono_horizon: chrono initialisation of the GRU's update gate: its input bias is
            ``log U(1, chrono_horizon - 1)``, so units start out keeping their state over time scales
            up to ``chrono_horizon`` steps and BPTT reaches back that far from the start of training.
            None: PyTorch's default initialisation.
        logit_bound: squash the policy's logits to ``c·tanh(z / c)`` with ``c = logit_bound``: the logit gap
            between two actions stays below ``2c``, so no action's probability falls below
            ``1 / (1 + (A − 1)·e^{2c})`` and the softmax cannot saturate onto one action, where the
            all-action gradient ``π(Q − V)`` of the actions it stops taking vanishes. The target policy is
            squashed the same way. None: unbounded logits.
        policy_reads_hidden: the policy's input is ``[obs_t; h_t]`` (True) or ``obs_t`` alone (False, for
            fully observed tasks such as CartPole). The critic trains the recurrent cell at its own, faster
            rate, so a policy that reads ``h_t`` changes its actions whenever the critic's features move,
            however slowly its own weights move.
    """

    def __init__(
        self,
        obs_dim: int,
        num_actions: int,
        hidden_size: int,
        value_hidden_size: int | None = None,
        detach_feedback: bool = True,
        fused_value_head: bool = False,
        atomic_value_head: bool = False,
        target_critic: bool = False,
        target_policy: bool = False,
        chrono_horizon: int | None = None,
        logit_bound: float | None = None,
        policy_reads_hidden: bool = True,
    ) -> None:
        super().__init__()
        if logit_bound is not None and not logit_bound > 0:
            raise ValueError(f"DeepEPAgent: logit_bound must be > 0 or None, got {logit_bound!r}")
        self.logit_bound = logit_bound
        self.policy_reads_hidden = policy_reads_hidden
        self.obs_dim, self.num_actions, self.hidden_size = obs_dim, num_actions, hidden_size
        self.detach_feedback = detach_feedback
        self.policy_net = nn.Sequential(
            nn.Linear(obs_dim + (hidden_size if policy_reads_hidden else 0), hidden_size),
            nn.Tanh(),
            nn.Linear(hidden_size, num_actions),
        )
        self.value_head = AllActionValueHead(
            obs_dim + hidden_size,
            value_hidden_size or hidden_size,
            num_actions,
            fused=fused_value_head,
            deterministic=not atomic_value_head,
        )
        self.rnn_cell = nn.GRUCell(obs_dim + num_actions + 1, hidden_size)
        if chrono_horizon is not None:
            chrono_init_(self.rnn_cell, chrono_horizon)
        self.target_value_head: AllActionValueHead | None = None
        if target_critic:
            self.target_value_head = copy.deepcopy(self.value_head).requires_grad_(False)
        self.target_policy_net: nn.Module | None = None
        if target_policy:
            self.target_policy_net = copy.deepcopy(self.policy_net).requires_grad_(False)

    def _target_pairs(self) -> list[tuple[nn.Module, nn.Module]]:
        pairs = [(self.target_value_head, self.value_head), (self.target_policy_net, self.policy_net)]
        return [(target, online) for target, online in pairs if target is not None]

    def target_parameters(self) -> list[torch.Tensor]:
        """The target networks' parameters, in the order of :meth:`online_parameters_of_targets`."""
        return [p for target, _ in self._target_pairs() for p in target.parameters()]

    def online_parameters_of_targets(self) -> list[torch.Tensor]:
        """The online parameters the target networks average."""
        return [p for _, online in self._target_pairs() for p in online.parameters()]

    def target_logits(self, features: torch.Tensor) -> torch.Tensor:
        """Logits of the target policy at ``features`` ``[..., obs_dim + H]`` (the policy's input), no gradient.

        Raises:
            RuntimeError: the agent has no target policy (``target_policy=False``).
        """
        if self.target_policy_net is None:
            raise RuntimeError("DeepEPAgent.target_logits needs target_policy=True")
        with torch.no_grad():
            return self._bounded(self.target_policy_net(self._policy_input(features)))

    def _policy_input(self, features: torch.Tensor) -> torch.Tensor:
        """The policy's part of ``features`` ``[..., obs_dim + H]``: all of it, or the observation alone."""
        return features if self.policy_reads_hidden else features[..., : self.obs_dim]

    def _bounded(self, logits: torch.Tensor) -> torch.Tensor:
        """``c·tanh(z / c)`` with ``c = logit_bound`` (identity without a bound)."""
        if self.logit_bound is None:
            return logits
        return self.logit_bound * torch.tanh(logits / self.logit_bound)

    def initial_state(self, batch_size: int, device: torch.device | str) -> torch.Tensor:
        return torch.zeros(batch_size, self.hidden_size, device=device)

    def evaluate(self, obs: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Policy logits and all-action Q at ``(obs, hidden)``: ``[B, A]`` each.

        The recurrent state is learned by the critic alone (BPTT of the value loss); the policy reads
        it as a feature. Letting the policy gradient into the shared recurrent cell would move it at
        the critic's faster learning rate and undo the two time-scale separation.
        """
        logits, q, _ = self._evaluate(obs, hidden)
        return logits, q

    def _evaluate(self, obs: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = torch.cat((obs, hidden), dim=-1)  # [B, obs_dim + H]
        return self.policy_logits(obs, hidden), self.value_head(x), x.detach()

    def policy_logits(self, obs: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The policy's logits ``[B, A]`` at ``(obs, hidden)`` without the critic (what :meth:`step` acts on)."""
        return self._bounded(self.policy_net(self._policy_input(torch.cat((obs, hidden.detach()), dim=-1))))

    def target_q(self, features: torch.Tensor) -> torch.Tensor:
        """Q of every action from the target critic at ``features`` ``[..., obs_dim + H]``, no gradient.

        Raises:
            RuntimeError: the agent has no target critic (``target_critic=False``).
        """
        if self.target_value_head is None:
            raise RuntimeError("DeepEPAgent.target_q needs target_critic=True")
        with torch.no_grad():
            return self.target_value_head(features.flatten(0, -2)).unflatten(0, features.shape[:-1])

    def step(self, obs: torch.Tensor, hidden: torch.Tensor, uniform: torch.Tensor | None) -> AgentStep:
        """One timestep; ``uniform`` ``[B]`` in [0, 1) drives the action sample (no global RNG); ``None``
        takes the greedy action, the most likely one (the lowest index among equal logits)."""
        logits, q, features = self._evaluate(obs, hidden)
        action = logits.detach().argmax(dim=-1) if uniform is None else sample_categorical(logits, uniform)
        one_hot = nn.functional.one_hot(action, self.num_actions).to(obs.dtype)  # [B, A]
        value = (q * one_hot).sum(dim=-1, keepdim=True)  # [B, 1]; a product, so no scatter-add in backward
        if self.detach_feedback:
            value = value.detach()
        feedback = torch.cat((obs, one_hot, value), dim=-1)
        return AgentStep(logits, q, action, self.rnn_cell(feedback, hidden), features, feedback)


@torch.no_grad()
def chrono_init_(cell: nn.GRUCell, horizon: int) -> None:
    """Chrono initialisation (Tallec & Ollivier, 2018) of a GRU cell's update gate, in place.

    PyTorch's GRU computes ``h' = (1 − z)·n + z·h`` with the gates ordered ``[r, z, n]``; an update-gate
    bias ``b_z = log u``, ``u ~ U(1, horizon − 1)``, makes ``z`` start near ``u/(1 + u)``: unit ``i``
    forgets over about ``u_i`` steps, spread over time scales up to ``horizon``. Draws from the global
    RNG (the module seeds it for initialisation).
    """
    if horizon < 2:
        raise ValueError(f"chrono_init_: horizon must be >= 2, got {horizon!r}")
    size = cell.hidden_size
    uniform = torch.empty(size).uniform_(1.0, max(float(horizon - 1), 1.0 + 1e-6))
    cell.bias_ih[size : 2 * size].copy_(uniform.log())
    cell.bias_hh[size : 2 * size].zero_()


def sample_categorical(logits: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sample of ``Categorical(logits)`` from ``uniform`` ``[B]``: no host sync, graph-capturable."""
    with torch.no_grad():
        cdf = torch.softmax(logits, dim=-1).cumsum(dim=-1)  # [B, A]
        action = (cdf < uniform.unsqueeze(-1)).sum(dim=-1)
        return action.clamp_(max=logits.shape[-1] - 1)
