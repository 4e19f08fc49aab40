import math

import pytest
import torch

from deepep_lightning.deepep.agent import AllActionValueHead, DeepEPAgent, collect_rollout, sample_categorical
from deepep_lightning.deepep.envs import BatchedCartPole
from deepep_lightning.ops import extension_available


def test_inverse_cdf_sampling_matches_probabilities():
    logits = torch.log(torch.tensor([[0.2, 0.5, 0.3]])).expand(200_000, 3)
    uniform = torch.rand(200_000, generator=torch.Generator().manual_seed(0))
    counts = torch.bincount(sample_categorical(logits, uniform), minlength=3).double() / 200_000
    torch.testing.assert_close(counts, torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64), atol=5e-3, rtol=0)


def test_fused_value_head_equals_reference_to_fp32_rounding():
    assert extension_available(), "the C++ extension must build wherever a compiler exists"
    torch.manual_seed(0)
    reference = AllActionValueHead(12, 32, 5, fused=False)
    fused = AllActionValueHead(12, 32, 5, fused=True)
    fused.load_state_dict(reference.state_dict())
    with torch.no_grad():
        reference.action_embedding.normal_()  # nonzero E so actions differ
        fused.action_embedding.copy_(reference.action_embedding)
    x = torch.randn(64, 12)
    q_ref, q_fused = reference(x), fused(x)
    torch.testing.assert_close(q_fused, q_ref, rtol=1e-5, atol=1e-6)
    q_ref.square().sum().backward()
    q_fused.square().sum().backward()
    for (name, p_ref), p_fused in zip(reference.named_parameters(), fused.parameters()):
        torch.testing.assert_close(p_fused.grad, p_ref.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_rollout_is_a_pure_function_of_state_and_generator():
    def run(seed):
        torch.manual_seed(0)
        agent = DeepEPAgent(4, 2, 16)
        env = BatchedCartPole(8)
        generator = torch.Generator().manual_seed(seed)
        env.reset(generator)
        torch.manual_seed(12345)  # the global RNG must not matter
        rollout = collect_rollout(agent, env, agent.initial_state(8, "cpu"), 40, generator)
        rollout.q.sum().backward()
        return rollout, [p.grad.clone() for p in agent.parameters() if p.grad is not None]

    (a, grads_a), (b, grads_b), (c, _) = run(1), run(1), run(2)
    assert torch.equal(a.actions, b.actions) and torch.equal(a.q, b.q) and torch.equal(a.final_hidden, b.final_hidden)
    assert all(torch.equal(x, y) for x, y in zip(grads_a, grads_b))
    assert not torch.equal(a.actions, c.actions)


def test_recurrent_state_resets_at_episode_end_and_bptt_truncation_cuts_gradient():
    torch.manual_seed(0)
    agent = DeepEPAgent(4, 2, 16)
    env = BatchedCartPole(64)
    generator = torch.Generator().manual_seed(0)
    env.reset(generator)
    hidden = agent.initial_state(64, "cpu").requires_grad_(True)
    rollout = collect_rollout(agent, env, hidden, 30, generator, bptt_truncation=10)
    # Only the first window depends on the initial state.
    (grad,) = torch.autograd.grad(
        rollout.q[10:].sum(), hidden, allow_unused=True, materialize_grads=True, retain_graph=True
    )
    assert torch.count_nonzero(grad) == 0
    (grad,) = torch.autograd.grad(rollout.q[:10].sum(), hidden)
    assert torch.count_nonzero(grad) > 0
    assert rollout.dones.any()


def test_fused_value_head_calls_the_op_through_the_kernels_module(monkeypatch):
    # deepep-audit routes the head to the atomic variant by replacing kernels.all_action_q; a name bound
    # at import time would silently bypass that (the GPU audit once reported the atomic head "reproducible").
    import deepep_lightning.deepep.kernels as kernels

    calls = []
    original = kernels.all_action_q
    monkeypatch.setattr(
        kernels, "all_action_q", lambda *args, **kwargs: calls.append(kwargs) or original(*args, **kwargs)
    )
    head = AllActionValueHead(6, 8, 3, fused=True)
    head(torch.randn(5, 6))
    assert len(calls) == 1


def test_chrono_init_sets_the_update_gate_bias_to_log_uniform_and_default_does_not():
    torch.manual_seed(0)
    agent = DeepEPAgent(4, 2, 32, chrono_horizon=64)
    size = agent.hidden_size
    z_input, z_hidden = agent.rnn_cell.bias_ih[size : 2 * size], agent.rnn_cell.bias_hh[size : 2 * size]
    assert z_input.min().item() >= 0.0 and z_input.max().item() <= torch.log(torch.tensor(63.0)).item() + 1e-6
    assert z_input.std().item() > 0.3  # spread over time scales, not one constant
    assert torch.count_nonzero(z_hidden) == 0
    torch.manual_seed(0)
    default = DeepEPAgent(4, 2, 32)
    assert default.rnn_cell.bias_ih[size : 2 * size].abs().max().item() < 1 / size**0.5 + 1e-6  # PyTorch's U(-k, k)


def test_target_networks_start_as_copies_without_gradients():
    torch.manual_seed(0)
    agent = DeepEPAgent(4, 2, 16, target_critic=True, target_policy=True)
    features = torch.randn(3, 5, 4 + 16)
    assert torch.equal(agent.target_q(features), agent.value_head(features.flatten(0, 1)).detach().view(3, 5, 2))
    assert torch.equal(agent.target_logits(features), agent.policy_net(features).detach())
    assert all(not p.requires_grad for p in agent.target_parameters())
    assert len(agent.target_parameters()) == len(agent.online_parameters_of_targets())
    plain = DeepEPAgent(4, 2, 16)
    assert plain.target_parameters() == []
    with pytest.raises(RuntimeError, match="target_critic=True"):
        plain.target_q(features)


def test_rollout_features_are_the_value_head_inputs():
    torch.manual_seed(0)
    agent = DeepEPAgent(4, 2, 16, target_critic=True)
    env = BatchedCartPole(6)
    generator = torch.Generator().manual_seed(0)
    env.reset(generator)
    rollout = collect_rollout(agent, env, agent.initial_state(6, "cpu"), 5, generator)
    assert rollout.features.shape == (6, 6, 20) and rollout.bootstrap_logits.shape == (6, 2)
    torch.testing.assert_close(agent.value_head(rollout.features[:-1].flatten(0, 1)).view(5, 6, 2), rollout.q)


def test_logit_bound_keeps_every_action_probable_and_lets_gradients_through():
    torch.manual_seed(0)
    bounded, plain = DeepEPAgent(4, 2, 16, logit_bound=2.0, target_policy=True), DeepEPAgent(4, 2, 16)
    plain.load_state_dict(bounded.state_dict(), strict=False)
    for agent in (bounded, plain):
        with torch.no_grad():  # a saturated policy: huge last-layer weights
            agent.policy_net[2].weight.mul_(1000.0)
    bounded.target_policy_net.load_state_dict(bounded.policy_net.state_dict())
    obs, hidden = torch.randn(64, 4), torch.randn(64, 16)
    logits, _ = bounded.evaluate(obs, hidden)
    floor = 1.0 / (1.0 + math.exp(2 * 2.0))  # A = 2: the gap stays below 2c
    assert logits.abs().max().item() <= 2.0
    assert torch.softmax(logits, -1).min().item() >= floor * (1 - 1e-5)
    plain_logits, _ = plain.evaluate(obs, hidden)
    assert torch.softmax(plain_logits, -1).min().item() < floor / 100  # negative control: unbounded saturates
    torch.testing.assert_close(logits, 2.0 * torch.tanh(plain_logits / 2.0))
    features = torch.cat((obs, hidden), -1)
    torch.testing.assert_close(bounded.target_logits(features), logits.detach())  # the target is squashed alike
    # mild logits pass through nearly unchanged, with gradient
    mild = DeepEPAgent(4, 2, 16, logit_bound=50.0)
    z = mild.policy_net(features)
    mild_logits, _ = mild.evaluate(obs, hidden)
    torch.testing.assert_close(mild_logits, z, rtol=1e-3, atol=1e-4)
    mild_logits.sum().backward()
    assert mild.policy_net[2].weight.grad.abs().sum().item() > 0


@pytest.mark.parametrize("bound", [0.0, -1.0])
def test_logit_bound_must_be_positive(bound):
    with pytest.raises(ValueError, match=rf"logit_bound must be > 0 or None, got {bound!r}"):
        DeepEPAgent(4, 2, 16, logit_bound=bound)


def test_a_policy_that_does_not_read_the_hidden_state_ignores_the_critics_features():
    torch.manual_seed(0)
    obs, hidden, moved = torch.randn(8, 4), torch.randn(8, 16), torch.randn(8, 16)
    reader, observer = DeepEPAgent(4, 2, 16), DeepEPAgent(4, 2, 16, policy_reads_hidden=False, target_policy=True)
    assert observer.policy_net[0].in_features == 4 and reader.policy_net[0].in_features == 20
    logits, q = observer.evaluate(obs, hidden)
    moved_logits, moved_q = observer.evaluate(obs, moved)
    assert torch.equal(logits, moved_logits)
    assert not torch.equal(q, moved_q)  # the critic still reads the recurrent state
    # negative control: the default policy's actions move with the recurrent state
    assert not torch.equal(reader.evaluate(obs, hidden)[0], reader.evaluate(obs, moved)[0])
    torch.testing.assert_close(observer.target_logits(torch.cat((obs, hidden), -1)), logits.detach())
    step = observer.step(obs, hidden, torch.rand(8))
    assert step.features.shape == (8, 20) and step.hidden.shape == (8, 16)
