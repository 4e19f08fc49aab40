"""collect_rollout_fused: the no-grad rollout plus gru_sequence's BPTT equals autograd of the op-by-op rollout.

CPU tests in float64 (gradients to ~1e-10 of the reference), the module switch, and GPU tests (marked) of the
CUDA kernels inside the training step, the CUDA graph and the kernel census.
"""

from __future__ import annotations

import collections

import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from deepep_lightning.deepep import DeepEPModule
from deepep_lightning.deepep.agent import DeepEPAgent, collect_rollout, deepep_loss, fused_bptt
from deepep_lightning.deepep.agent.fused_bptt import collect_rollout_fused, gru_sequence
from deepep_lightning.deepep.config import grouped
from deepep_lightning.deepep.envs import BatchedCartPole
from deepep_lightning.deepep.envs.base import StepResult
from deepep_lightning.deepep.graph_training import StandaloneStep

B, H, T = 6, 8, 13
GRAD_RTOL = 1e-10  # float64: the two paths sum the same products in other orders


class _Float64Env:
    """CartPole with float64 observations and rewards (the float64 comparison runs the agent in float64)."""

    def __init__(self, max_episode_steps: int = 5) -> None:
        self.env = BatchedCartPole(B, "cpu", max_episode_steps=max_episode_steps)
        self.env.reset(torch.Generator().manual_seed(1))
        self.num_envs, self.device = B, self.env.device

    def observe(self) -> torch.Tensor:
        return self.env.observe().double()

    def step(self, action: torch.Tensor, generator: torch.Generator) -> StepResult:
        r = self.env.step(action, generator)
        return StepResult(
            r.obs.double(),
            r.reward.double(),
            r.done,
            r.terminated,
            r.episode_return.double(),
            r.episode_length.double(),
        )


def _rollout_gradients(collect, truncation, policy_reads_hidden=True, length=T):
    torch.manual_seed(0)
    agent = DeepEPAgent(4, 2, H, policy_reads_hidden=policy_reads_hidden, chrono_horizon=8).double()
    env = _Float64Env()
    hidden = torch.randn(B, H, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    rollout = collect(agent, env, hidden, length, torch.Generator().manual_seed(2), truncation)
    terms = deepep_loss(
        rollout.logits, rollout.q, rollout.actions, rollout.rewards, rollout.terminateds, rollout.bootstrap_value,
        gamma=0.9, gae_lambda=0.8, value_coef=0.5, entropy_coef=0.01,
    )  # fmt: skip
    terms.loss.backward()
    return rollout, {name: p.grad for name, p in agent.named_parameters()}


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).abs().max() / expected.abs().max())


@pytest.mark.parametrize("policy_reads_hidden", [True, False])
@pytest.mark.parametrize("truncation", [None, 4, 5])
def test_gradients_equal_autograd_of_the_op_by_op_rollout(truncation, policy_reads_hidden):
    reference, want = _rollout_gradients(collect_rollout, truncation, policy_reads_hidden)
    rollout, got = _rollout_gradients(collect_rollout_fused, truncation, policy_reads_hidden)
    # episodes end inside the rollout (5-step CartPole episodes), so the masks matter
    assert reference.dones[:-1].any() and not reference.dones.all()
    for field in ("actions", "rewards", "dones", "terminateds", "episode_returns", "features", "final_hidden"):
        assert torch.equal(getattr(rollout, field), getattr(reference, field)), field
    for field in ("logits", "q", "bootstrap_value", "bootstrap_logits"):
        torch.testing.assert_close(getattr(rollout, field), getattr(reference, field), rtol=1e-12, atol=1e-12)
    assert want.keys() == got.keys()
    for name, grad in want.items():
        assert grad is not None and grad.abs().max() > 0, f"{name}: a zero oracle proves nothing"
        assert _relative_error(got[name], grad) < GRAD_RTOL, name


def test_a_truncation_of_one_leaves_the_cell_without_gradient_as_autograd_does():
    _, want = _rollout_gradients(collect_rollout, 1)
    _, got = _rollout_gradients(collect_rollout_fused, 1)
    cell = [name for name in want if name.startswith("rnn_cell.")]
    assert cell and all(want[name] is None and got[name] is None for name in cell)
    for name, grad in want.items():
        if grad is not None:
            assert _relative_error(got[name], grad) < GRAD_RTOL, name


def test_a_rollout_of_one_timestep_equals_autograd():
    _, want = _rollout_gradients(collect_rollout, None, length=1)
    _, got = _rollout_gradients(collect_rollout_fused, None, length=1)
    for name, grad in want.items():  # the cell is read by nothing with gradient: None on both paths
        assert (grad is None) == (got[name] is None) and (grad is None or _relative_error(got[name], grad) < 1e-10)


def _ignore_masks(grad_output, carry, mask, *rest):
    return _real_cell_backward(grad_output, carry, torch.ones_like(mask), *rest)


_real_cell_backward = fused_bptt.gru_cell_backward_unchecked


@pytest.mark.parametrize("broken", ["masks_ignored", "truncation_ignored", "truncation_one_step_late"])
def test_a_broken_backward_is_caught_by_the_gradient_comparison(broken, monkeypatch):
    """Negative controls: the comparison above fails for a backward that drops the masks or the truncation."""
    truncation = 4
    _, want = _rollout_gradients(collect_rollout, truncation)
    if broken == "masks_ignored":
        monkeypatch.setattr(fused_bptt, "gru_cell_backward_unchecked", _ignore_masks)
        _, got = _rollout_gradients(collect_rollout_fused, truncation)
    elif broken == "truncation_ignored":
        _, got = _rollout_gradients(collect_rollout_fused, None)
    else:  # cut h_{t+2} instead of h_{t+1}: the index the backward must get right
        monkeypatch.setattr(fused_bptt, "_cut_before", lambda t, k: (t + 2) % k == 0)
        _, got = _rollout_gradients(collect_rollout_fused, truncation)
    cell = [name for name in want if name.startswith("rnn_cell.")]
    assert max(_relative_error(got[name], want[name]) for name in cell) > 1e-3


def test_two_runs_are_bitwise_equal():
    first, first_grads = _rollout_gradients(collect_rollout_fused, 4)
    second, second_grads = _rollout_gradients(collect_rollout_fused, 4)
    assert torch.equal(first.q, second.q) and torch.equal(first.logits, second.logits)
    assert all(torch.equal(first_grads[name], second_grads[name]) for name in first_grads)


def _recurrence(inputs, initial, masks, weights, truncation=None):
    """The masked GRU states step by step; with ``truncation``, detached as collect_rollout detaches them."""
    states, hidden = [], initial
    for t in range(inputs.shape[0]):
        if truncation is not None and t > 0 and t % truncation == 0:
            hidden = hidden.detach()
            states[-1] = states[-1].detach()  # collect_rollout's value head reads the detached h_t too
        hidden = masks[t].unsqueeze(-1) * torch.gru_cell(inputs[t], hidden, *weights)
        states.append(hidden)
    return torch.stack(states)


def _sequence(inputs, initial, masks, truncation, *weights):
    with torch.no_grad():  # the states the forward is handed, recomputed for every perturbed input
        states = _recurrence(inputs, initial, masks, weights)
    return fused_bptt._GRUSequence.apply(inputs, initial, masks, states, *weights, truncation)


@pytest.mark.parametrize("truncation", [None, 2, 3])
def test_gru_sequence_gradcheck_and_truncated_gradients(truncation):
    generator = torch.Generator().manual_seed(4)
    length, batch, size, width = 5, 3, 4, 3
    inputs = torch.randn(length, batch, width, dtype=torch.float64, generator=generator, requires_grad=True)
    initial = torch.randn(batch, size, dtype=torch.float64, generator=generator, requires_grad=True)
    weights = [
        (torch.randn(shape, dtype=torch.float64, generator=generator) * 0.5).requires_grad_()
        for shape in ((3 * size, width), (3 * size, size), (3 * size,), (3 * size,))
    ]
    masks = torch.tensor([[1, 1, 1], [1, 0, 1], [1, 1, 1], [0, 1, 1], [1, 1, 0]], dtype=torch.float64)
    if truncation is None:
        function = lambda *args: _sequence(args[0], args[1], masks, None, *args[2:])  # noqa: E731
        assert torch.autograd.gradcheck(function, (inputs, initial, *weights), eps=1e-6, atol=1e-8)
    # truncated BPTT is not the derivative of the forward: compare with autograd of the detached loop
    grad = torch.randn(length, batch, size, dtype=torch.float64, generator=generator)
    leaves = (inputs, initial, *weights)
    got = torch.autograd.grad(_sequence(inputs, initial, masks, truncation, *weights), leaves, grad)
    want = torch.autograd.grad(_recurrence(inputs, initial, masks, weights, truncation), leaves, grad)
    for actual, expected in zip(got, want):
        assert expected.abs().max() > 0
        torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12)
    if truncation is not None:  # negative control: the untruncated gradient differs
        full = torch.autograd.grad(_recurrence(inputs, initial, masks, weights), leaves, grad)
        assert not torch.allclose(full[4], want[4], rtol=1e-6, atol=1e-9)


def test_gru_sequence_refuses_bad_arguments_by_name():
    cell = torch.nn.GRUCell(3, 4)
    inputs, initial, masks, states = torch.zeros(5, 2, 3), torch.zeros(2, 4), torch.ones(5, 2), torch.zeros(5, 2, 4)
    gru_sequence(inputs, initial, masks, states, cell)  # the shapes that fit
    for kwargs, pattern in (
        ({"inputs": torch.zeros(5, 2, 4)}, r"inputs must be \[5, 2, 3\]"),
        ({"initial": torch.zeros(3, 4)}, r"initial must be \[2, 4\]"),
        ({"masks": torch.ones(5, 2, dtype=torch.bool)}, r"masks must be \[5, 2\] of torch.float32"),
        ({"states": torch.zeros(5, 2, 5)}, r"states must be \[T, B, 4\]"),
        ({"bptt_truncation": 0}, r"bptt_truncation must be a positive int or None, got 0"),
    ):
        args = {"inputs": inputs, "initial": initial, "masks": masks, "states": states, "cell": cell, **kwargs}
        with pytest.raises(ValueError, match=pattern):
            gru_sequence(**args)


def test_an_agent_whose_feedback_carries_gradient_is_refused():
    agent = DeepEPAgent(4, 2, H, detach_feedback=False)
    env = BatchedCartPole(B)
    with pytest.raises(ValueError, match="detach_feedback=False"):
        collect_rollout_fused(agent, env, torch.zeros(B, H), 3, torch.Generator())


# ---------------------------------------------------------------- the module's switch
SIZES = dict(num_envs=5, rollout_length=9, hidden_size=8, seed=3, fused_value_head=False, bptt_truncation=4)


def _train(fused, steps=4, **overrides):
    model = DeepEPModule(**grouped(**{**SIZES, **overrides}, fused_bptt=fused))
    model.ensure_rollout_state()
    step = StandaloneStep(model, torch.optim.Adam(model.parameters(), lr=1e-2))
    losses = [step()["loss"].clone() for _ in range(steps)]
    return torch.stack(losses), model.state_dict()


def test_none_resolves_off_on_cpu_and_true_turns_it_on():
    assert not DeepEPModule(**grouped(**SIZES)).fused_bptt_on
    assert DeepEPModule(**grouped(**SIZES, fused_bptt=True)).fused_bptt_on
    assert not DeepEPModule(**grouped(**SIZES, fused_bptt=False)).fused_bptt_on


@pytest.mark.parametrize(
    "options",
    [{}, {"target_tau": 0.05, "kl_coef": 0.1, "expected_value_coef": 0.5, "logit_bound": 3.0, "name": "memory"}],
    ids=["default", "targets_kl_bound_memory"],
)
def test_training_steps_equal_the_reference_path_to_fp32_rounding(options):
    want, want_state = _train(False, **options)
    got, state = _train(True, **options)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    for key, value in want_state.items():
        torch.testing.assert_close(state[key], value, rtol=1e-3, atol=1e-4, msg=key)
    again, _ = _train(True, **options)
    assert torch.equal(got, again)
    other, _ = _train(True, **{**options, "seed": 4})  # negative control: another seed is far outside the tolerance
    with pytest.raises(AssertionError):
        torch.testing.assert_close(other, want, rtol=1e-4, atol=1e-5)


def test_the_module_uses_the_fused_rollout_only_when_on(monkeypatch):
    calls = collections.Counter()
    real = fused_bptt.collect_rollout_fused

    def counting(*args, **kwargs):
        calls["fused"] += 1
        return real(*args, **kwargs)

    from deepep_lightning.deepep import rollout_loss

    monkeypatch.setattr(rollout_loss, "collect_rollout_fused", counting)
    _train(None, steps=1)
    assert calls["fused"] == 0
    _train(True, steps=2)
    assert calls["fused"] == 2


def test_virtual_ranks_train_with_the_fused_rollout():
    model = DeepEPModule(**grouped(**SIZES, fused_bptt=True))
    model.ensure_rollout_state(virtual_ranks=(0, 2))
    step = StandaloneStep(model, torch.optim.Adam(model.parameters(), lr=1e-2))
    for index in range(2):
        model.rollouts.select(index)
        step()
    reference = DeepEPModule(**grouped(**SIZES, fused_bptt=False))
    reference.ensure_rollout_state(virtual_ranks=(0, 2))
    reference_step = StandaloneStep(reference, torch.optim.Adam(reference.parameters(), lr=1e-2))
    for index in range(2):
        reference.rollouts.select(index)
        reference_step()
    for (name, value), other in zip(model.state_dict().items(), reference.state_dict().values()):
        torch.testing.assert_close(value, other, rtol=1e-3, atol=1e-4, msg=name)
    for slot, reference_slot in zip(model.rollouts.virtual.states, reference.rollouts.virtual.states, strict=True):
        torch.testing.assert_close(slot.hidden, reference_slot.hidden, rtol=1e-4, atol=1e-5)


def test_bad_values_are_refused_by_name():
    with pytest.raises(ValueError, match=r"fused_bptt=\.\.\.\)` must be None or False with detach_feedback=False"):
        DeepEPModule(**grouped(**SIZES, fused_bptt=True, detach_feedback=False))
    with pytest.raises(MisconfigurationException, match="fused_bptt"):
        DeepEPModule(**grouped(**SIZES, fused_bptt="yes"))
    DeepEPModule(**grouped(**SIZES, fused_bptt=None, detach_feedback=False))  # None resolves off there: accepted


def test_compiled_no_grad_timestep_inside_the_fused_rollout_equals_eager():
    from deepep_lightning.deepep.agent.compiled_step import compile_unavailable_reason

    if compile_unavailable_reason("cpu") is not None:
        pytest.skip(compile_unavailable_reason("cpu"))
    sizes = dict(steps=2, num_envs=4, rollout_length=3, hidden_size=8)
    want, _ = _train(True, **sizes)
    got, _ = _train(True, compile_step=True, **sizes)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- GPU
GPU_SIZES = dict(num_envs=64, rollout_length=32, hidden_size=64, seed=5, fused_value_head=True, bptt_truncation=8)


def _needs_cuda_kernels():
    from deepep_lightning.ops import cuda_kernels_available

    if not torch.cuda.is_available() or not cuda_kernels_available():
        pytest.skip("needs CUDA and the compiled deepep CUDA kernels")


def _train_gpu(steps, fused, graph, seed=5):
    # the op-by-op no-gradient timesteps (the rollout kernel's tests are test_fused_rollout.py)
    model = DeepEPModule(
        **grouped(**{**GPU_SIZES, "seed": seed}, fused_bptt=fused, cuda_graph=graph, fused_rollout=False)
    )
    model = model.cuda()
    model.ensure_rollout_state()
    step = StandaloneStep(model, torch.optim.Adam(model.parameters(), lr=1e-3, capturable=graph))
    losses = torch.stack([step()["loss"].clone() for _ in range(steps)])
    torch.cuda.synchronize()
    return model, losses, step.graphed


@pytest.mark.gpu
def test_gpu_default_is_on_and_equals_the_reference_to_fp32_rounding():
    _needs_cuda_kernels()
    model, losses, _ = _train_gpu(12, fused=None, graph=False)
    assert model.fused_bptt_on
    reference, reference_losses, _ = _train_gpu(12, fused=False, graph=False)
    torch.testing.assert_close(losses, reference_losses, rtol=1e-4, atol=1e-5)
    for (key, value), other in zip(model.state_dict().items(), reference.state_dict().values()):
        torch.testing.assert_close(value, other, rtol=1e-3, atol=1e-4, msg=key)
    _, other_losses, _ = _train_gpu(12, fused=None, graph=False, seed=6)  # negative control
    with pytest.raises(AssertionError):
        torch.testing.assert_close(other_losses, reference_losses, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("graph", [False, True])
def test_gpu_two_runs_are_bitwise_equal(graph):
    _needs_cuda_kernels()
    first, first_losses, graphed = _train_gpu(8, fused=True, graph=graph)
    second, second_losses, _ = _train_gpu(8, fused=True, graph=graph)
    assert graphed is None or graphed.captures == 1
    assert torch.equal(first_losses, second_losses)
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), second.state_dict().values()))


@pytest.mark.gpu
def test_gpu_graph_step_equals_the_eager_fused_step():
    _needs_cuda_kernels()
    eager, eager_losses, _ = _train_gpu(8, fused=True, graph=False)
    graph, graph_losses, graphed = _train_gpu(8, fused=True, graph=True)
    assert graphed is not None and graphed.captures == 1
    # capturable Adam (graph) and plain Adam (eager) round differently: fp32 rounding, as test_module_gpu.py allows
    torch.testing.assert_close(graph_losses, eager_losses, rtol=1e-4, atol=1e-5)


def kernels_per_timestep(step, horizon: int) -> float:
    """CUDA kernels (not memcpy/memset) one call of ``step`` launches, per timestep (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(not n.startswith(("Memcpy", "Memset", "cudaMemcpy", "cudaMemset")) for n in names) / horizon


@pytest.mark.gpu
def test_gpu_kernel_census_the_fused_backward_saves_kernels_per_timestep():
    _needs_cuda_kernels()
    counts = {}
    for fused in (False, True):
        model, _, graphed = _train_gpu(4, fused=fused, graph=True)
        assert graphed is not None

        def step(model=model, graphed=graphed):
            model.seed_rollout()
            graphed()

        counts[fused] = kernels_per_timestep(step, GPU_SIZES["rollout_length"])
    # the op-by-op backward is dozens of kernels per timestep, the fused one two
    assert counts[True] < counts[False] - 20, counts
