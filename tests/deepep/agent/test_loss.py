import pytest
import torch

from deepep_lightning.deepep.agent import deepep_loss


def _random_rollout(T=5, B=4, A=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, B, A, generator=g, dtype=torch.float64, requires_grad=True)
    q = torch.randn(T, B, A, generator=g, dtype=torch.float64, requires_grad=True)
    actions = torch.randint(0, A, (T, B), generator=g)
    rewards = torch.randn(T, B, generator=g, dtype=torch.float64)
    dones = torch.rand(T, B, generator=g) < 0.3
    bootstrap = torch.randn(B, generator=g, dtype=torch.float64)
    return logits, q, actions, rewards, dones, bootstrap


def test_expected_policy_gradient_wrt_logits_is_pi_times_q_minus_v():
    logits, q, actions, rewards, dones, bootstrap = _random_rollout()
    terms = deepep_loss(
        logits, q, actions, rewards, dones, bootstrap, gamma=0.9, gae_lambda=0.8, value_coef=0.0, entropy_coef=0.0
    )
    (grad,) = torch.autograd.grad(terms.policy_loss, logits)
    pi = torch.softmax(logits.detach(), -1)
    qd = q.detach()
    v = (pi * qd).sum(-1, keepdim=True)
    expected = -pi * (qd - v) / (logits.shape[0] * logits.shape[1])
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-14)


def test_policy_loss_does_not_train_the_critic():
    logits, q, actions, rewards, dones, bootstrap = _random_rollout()
    terms = deepep_loss(
        logits, q, actions, rewards, dones, bootstrap, gamma=0.9, gae_lambda=0.8, value_coef=0.0, entropy_coef=0.0
    )
    (grad_q,) = torch.autograd.grad(terms.policy_loss, q, allow_unused=True, materialize_grads=True)
    assert torch.count_nonzero(grad_q) == 0


def test_critic_regresses_taken_action_only_and_entropy_sign():
    logits, q, actions, rewards, dones, bootstrap = _random_rollout()
    terms = deepep_loss(
        logits, q, actions, rewards, dones, bootstrap, gamma=0.9, gae_lambda=0.8, value_coef=1.0, entropy_coef=0.0
    )
    (grad_q,) = torch.autograd.grad(terms.value_loss, q)
    taken = torch.nn.functional.one_hot(actions, q.shape[-1]).bool()
    assert torch.count_nonzero(grad_q[~taken]) == 0 and torch.count_nonzero(grad_q[taken]) > 0
    uniform = torch.zeros_like(logits)
    high = deepep_loss(
        uniform, q, actions, rewards, dones, bootstrap, gamma=0.9, gae_lambda=0.8, value_coef=0.0, entropy_coef=1.0
    )
    assert high.entropy.item() > terms.entropy.item()  # uniform policy has maximal entropy


def _loss(logits, q, actions, rewards, dones, bootstrap, **kwargs):
    base = dict(gamma=0.9, gae_lambda=0.8, value_coef=1.0, entropy_coef=0.0)
    return deepep_loss(logits, q, actions, rewards, dones, bootstrap, **{**base, **kwargs})


def test_kl_term_is_zero_with_zero_gradient_when_the_policies_match():
    logits, q, actions, rewards, dones, bootstrap = _random_rollout()
    terms = _loss(logits, q, actions, rewards, dones, bootstrap, target_logits=logits.detach().clone(), kl_coef=1.0)
    assert terms.kl.item() == pytest.approx(0.0, abs=1e-12)
    (grad,) = torch.autograd.grad(terms.kl, logits)
    assert grad.abs().max().item() < 1e-12


def test_kl_term_gradient_is_kl_coef_times_pi_minus_target_pi():
    logits, q, actions, rewards, dones, bootstrap = _random_rollout()
    # its own generator: a policy drawn like the rollout's would equal it (KL 0)
    target_logits = torch.randn(logits.shape, dtype=logits.dtype, generator=torch.Generator().manual_seed(1))
    terms = _loss(logits, q, actions, rewards, dones, bootstrap, target_logits=target_logits, kl_coef=0.7)
    assert terms.kl.item() > 0  # negative control for the test above: different policies, positive KL
    with_kl = torch.autograd.grad(terms.loss, logits, retain_graph=True)[0]
    without_kl = torch.autograd.grad(terms.loss - 0.7 * terms.kl, logits)[0]
    n = logits.shape[0] * logits.shape[1]
    expected = 0.7 * (torch.softmax(logits.detach(), -1) - torch.softmax(target_logits, -1)) / n
    torch.testing.assert_close(with_kl - without_kl, expected, rtol=1e-10, atol=1e-12)


def test_target_q_sets_the_critic_targets_not_the_policy_loss():
    logits, q, actions, rewards, dones, bootstrap = _random_rollout()
    same = _loss(logits, q, actions, rewards, dones, bootstrap, target_q=q.detach().clone())
    online = _loss(logits, q, actions, rewards, dones, bootstrap)
    assert torch.equal(same.value_loss, online.value_loss)
    shifted = _loss(logits, q, actions, rewards, dones, bootstrap, target_q=q.detach() + 1.0)
    assert not torch.equal(shifted.value_loss, online.value_loss)
    assert torch.equal(shifted.policy_loss, online.policy_loss)


def test_expected_value_regression_reaches_the_untaken_actions():
    logits, q, actions, rewards, dones, bootstrap = _random_rollout()
    taken = torch.nn.functional.one_hot(actions, q.shape[-1]).bool()
    (plain,) = torch.autograd.grad(_loss(logits, q, actions, rewards, dones, bootstrap).value_loss, q)
    assert torch.count_nonzero(plain[~taken]) == 0  # negative control: only the taken action is regressed
    terms = _loss(logits, q, actions, rewards, dones, bootstrap, expected_value_coef=1.0)
    (grad,) = torch.autograd.grad(terms.value_loss, q)
    assert torch.count_nonzero(grad[~taken]) == grad[~taken].numel()


def test_a_tensor_entropy_coefficient_equals_the_float():
    logits, q, actions, rewards, dones, bootstrap = _random_rollout()
    as_float = _loss(logits, q, actions, rewards, dones, bootstrap, entropy_coef=0.25)
    as_tensor = _loss(logits, q, actions, rewards, dones, bootstrap, entropy_coef=torch.tensor(0.25, dtype=q.dtype))
    assert torch.equal(as_float.loss, as_tensor.loss)


def _policy_share_of_a_critic_burst(kl_coef, steps=50):
    """Mean π(action 0) after ``steps`` Adam steps on a critic that prefers action 0 in every state.

    The shape of the measured collapse: a critic shift gives one action a higher Q in all states at
    once, and the all-action gradient moves the whole policy onto it within a few dozen steps.
    """
    import copy

    from deepep_lightning.deepep.agent.targets import polyak_update_

    torch.manual_seed(0)
    policy = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2))
    target = copy.deepcopy(policy).requires_grad_(False)
    optimizer = torch.optim.Adam(policy.parameters(), lr=3e-3)
    features = torch.randn(1, 256, 8)
    q = torch.tensor([0.5, 0.0]).expand(1, 256, 2)
    actions, rewards = torch.zeros(1, 256, dtype=torch.long), torch.zeros(1, 256)
    dones, bootstrap = torch.zeros(1, 256, dtype=torch.bool), torch.zeros(256)
    for _ in range(steps):
        polyak_update_(list(target.parameters()), list(policy.parameters()), 0.05)
        logits = policy(features)
        terms = _loss(logits, q, actions, rewards, dones, bootstrap, value_coef=0.0,
                      target_logits=target(features) if kl_coef else None, kl_coef=kl_coef)  # fmt: skip
        optimizer.zero_grad()
        terms.loss.backward()
        optimizer.step()
    with torch.no_grad():
        return torch.softmax(policy(features), -1)[..., 0].mean().item()


def test_kl_trust_region_slows_the_jump_onto_a_globally_preferred_action():
    without = _policy_share_of_a_critic_burst(0.0)
    assert without > 0.9  # negative control: unanchored, 50 steps put the policy on action 0 almost everywhere
    assert _policy_share_of_a_critic_burst(1.0) < without - 0.1
