"""Expected (all-action) policy gradient, critic regression on λ-returns, entropy bonus."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepep_lightning.deepep.kernels.lambda_returns import lambda_returns

__all__ = ["LossTerms", "deepep_loss", "lambda_returns"]


@dataclass
class LossTerms:
    loss: torch.Tensor
    policy_loss: torch.Tensor
    value_loss: torch.Tensor
    entropy: torch.Tensor
    kl: torch.Tensor  # mean KL(π_target ‖ π) over the states (0 without target logits)


def deepep_loss(
    logits: torch.Tensor,
    q: torch.Tensor,
    actions: torch.Tensor,
    rewards: torch.Tensor,
    dones: torch.Tensor,
    bootstrap_value: torch.Tensor,
    *,
    gamma: float,
    gae_lambda: float,
    value_coef: float,
    entropy_coef: float | torch.Tensor,
    target_q: torch.Tensor | None = None,
    target_logits: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    expected_value_coef: float = 0.0,
) -> LossTerms:
    """The DeepEP objective over a ``[T, B]`` rollout (means over T·B).

    - policy: ``−Σ_a π(a|s_t)·stopgrad(Q(s_t, a))`` — the expected policy gradient over *all*
      actions; its gradient w.r.t. the logits is ``−π(Q − V)`` with ``V = Σ_a π Q`` (no sampling
      variance from the action choice);
    - critic: ``½(Q(s_t, a_t) − G_t)²`` with ``G_t`` the λ-returns of
      :func:`~deepep_lightning.deepep.kernels.lambda_returns.lambda_returns`,
      bootstrapped with the expected value ``V`` (targets carry no gradient);
    - entropy bonus, subtracted with ``entropy_coef`` (a float, or a 0-d tensor for an adaptive one).

    ``target_q`` ``[T, B, A]`` (no grad), when given, is a slow target critic's Q at the same states:
    the λ-returns bootstrap from ``V = Σ_a π Q_target`` instead of the online critic, so the regression
    targets do not move with every update of the network they train (pass ``bootstrap_value`` from
    the target critic too). The policy still follows the online critic.

    ``target_logits`` ``[T, B, A]`` (no grad), when given, are a slow target policy's logits: the loss
    adds ``kl_coef · KL(π_target ‖ π)`` per state (exact over the enumerable actions), whose gradient
    w.r.t. the logits is ``kl_coef·(π − π_target)``: it is zero when the policies match and pulls the
    policy back toward its recent average otherwise.

    ``expected_value_coef`` adds ``expected_value_coef · ½(Σ_a π(a|s_t) Q(s_t, a) − G_t)²`` to the critic
    loss (π without gradient): the taken-action regression alone corrects only the actions the policy
    takes, so when the value level moves fast (the first failures after a long run of full-length
    episodes) the Q of the actions it takes less stays stale, and the all-action gradient ``π(Q − V)``
    drives the policy onto them in every state at once. This term moves all of them with the level.
    """
    log_probs = torch.log_softmax(logits, dim=-1)  # [T, B, A]
    probs = log_probs.exp()
    policy_loss = -(probs * q.detach()).sum(dim=-1).mean()
    entropy = -(probs * log_probs).sum(dim=-1).mean()
    with torch.no_grad():
        values = (probs * (q if target_q is None else target_q)).sum(dim=-1)  # [T, B]
        targets = lambda_returns(rewards, dones, values, bootstrap_value, gamma, gae_lambda)
    # One-hot product, not gather: gather's backward is a scatter-add (atomics on CUDA).
    taken = torch.nn.functional.one_hot(actions, q.shape[-1]).to(q.dtype)  # [T, B, A]
    q_taken = (q * taken).sum(dim=-1)  # [T, B]
    value_loss = 0.5 * (q_taken - targets).square().mean()
    if expected_value_coef > 0:
        # ½(Σ_a π Q − G)²: moves every action's Q with the value level, by π(a), not only the taken one's
        expected_value = (probs.detach() * q).sum(dim=-1)  # [T, B]
        value_loss = value_loss + expected_value_coef * 0.5 * (expected_value - targets).square().mean()
    loss = policy_loss + value_coef * value_loss - entropy_coef * entropy
    if target_logits is None:
        kl = torch.zeros((), dtype=logits.dtype, device=logits.device)
    else:
        target_log_probs = torch.log_softmax(target_logits.detach(), dim=-1)
        kl = (target_log_probs.exp() * (target_log_probs - log_probs)).sum(dim=-1).mean()
        loss = loss + kl_coef * kl
    return LossTerms(loss, policy_loss, value_loss, entropy, kl)
