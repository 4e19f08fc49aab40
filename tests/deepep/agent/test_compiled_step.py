"""CompiledTimestep: the torch.compile'd timestep equals the eager one, is repeatable, and falls back cleanly.

CPU tests share one compile (module-scoped fixture, tiny shapes); inductor's CPU backend needs g++.
"""

import copy
import json
import os
import re
import sys
import warnings
from pathlib import Path

import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch._inductor import config as inductor_config
from torch._inductor import utils as inductor_utils
from torch.utils._python_dispatch import TorchDispatchMode

from deepep_lightning.deepep import DeepEPModule
from deepep_lightning.deepep.agent import DeepEPAgent, compiled_step
from deepep_lightning.deepep.agent.compiled_step import CompiledTimestep, compile_unavailable_reason
from deepep_lightning.deepep.agent.rollout import eager_timestep
from deepep_lightning.deepep.config import grouped
from deepep_lightning.deepep.envs import BatchedCartPole, BatchedEnv, CueRecall
from deepep_lightning.deepep.graph_training import StandaloneStep

REPO = Path(__file__).resolve().parents[3]
B, H = 4, 8  # tiny: compile time, not arithmetic, is the cost here
MODULE_SIZES = dict(num_envs=B, rollout_length=3, hidden_size=H, seed=3, fused_value_head=False)
# inductor compiles (so its code is captured) in a fresh cache; torch < 2.8 calls it fresh_inductor_cache
fresh_cache = getattr(inductor_utils, "fresh_cache", None) or inductor_utils.fresh_inductor_cache
RTOL, ATOL = 1e-5, 1e-6  # fp32 rounding of a few chained ops; a planted 1e-3 change is far outside


def _agent() -> DeepEPAgent:
    torch.manual_seed(0)
    return DeepEPAgent(BatchedCartPole.obs_dim, BatchedCartPole.num_actions, H)


def _env(device: str = "cpu") -> BatchedCartPole:
    env = BatchedCartPole(B, device)
    env.reset(torch.Generator(device).manual_seed(1))
    return env


def _one_timestep(timestep_fn, agent, env):
    """One timestep from a fixed state and generator, then backward of a scalar of every output."""
    agent.zero_grad(set_to_none=True)
    hidden = torch.linspace(-1, 1, B * H, device=env.device).reshape(B, H).requires_grad_()
    generator = torch.Generator(env.device).manual_seed(7)
    step, result, next_hidden = timestep_fn(env.observe(), hidden, generator)
    scalar = step.logits.sin().sum() + step.q.cos().sum() + (next_hidden * torch.arange(H, device=env.device)).sum()
    scalar.backward()
    grads = {name: p.grad.clone() for name, p in agent.named_parameters() if p.grad is not None}
    outputs = {
        "logits": step.logits,
        "q": step.q,
        "hidden": step.hidden,
        "next_hidden": next_hidden,
        "obs": result.obs,
        "reward": result.reward,
        "env_state": env.state.clone(),
        "grad_hidden": hidden.grad,
    }
    return {k: v.detach() for k, v in outputs.items()}, step.action, result.done, grads


@pytest.fixture(scope="module")
def compiled():
    """The one compile of this file: a timestep with the env inside, its generated code captured."""
    agent, env = _agent(), _env()
    timestep = CompiledTimestep(agent, env)
    assert timestep.compiled and timestep.includes_env
    with fresh_cache():
        result, code = inductor_utils.run_and_get_code(_one_timestep, timestep, agent, env)
    return agent, result, code


def _assert_outputs_close(actual, expected, rtol=RTOL, atol=ATOL):
    (values, action, done, grads), (values_ref, action_ref, done_ref, grads_ref) = actual, expected
    assert torch.equal(action, action_ref) and torch.equal(done, done_ref)
    for name in values_ref:
        torch.testing.assert_close(values[name], values_ref[name], rtol=rtol, atol=atol, msg=name)
    assert grads.keys() == grads_ref.keys() and grads_ref
    for name in grads_ref:
        torch.testing.assert_close(grads[name], grads_ref[name], rtol=rtol, atol=atol, msg=name)


@pytest.mark.slow
def test_compiled_timestep_equals_eager_to_fp32_rounding(compiled):
    agent, result, _ = compiled
    env = _env()
    expected = _one_timestep(lambda *args: eager_timestep(agent, env, *args), agent, env)
    _assert_outputs_close(result, expected)


@pytest.mark.slow
def test_a_planted_change_is_caught_at_that_tolerance(compiled):
    agent, result, _ = compiled
    planted = copy.deepcopy(agent)
    with torch.no_grad():
        planted.rnn_cell.weight_hh.mul_(1.001)
    env = _env()
    perturbed = _one_timestep(lambda *args: eager_timestep(planted, env, *args), planted, env)
    with pytest.raises(AssertionError):
        _assert_outputs_close(result, perturbed)


@pytest.mark.slow
def test_compiled_timestep_is_bitwise_repeatable(compiled):
    agent, result, _ = compiled
    env = _env()
    again = _one_timestep(CompiledTimestep(agent, env), agent, env)
    _assert_outputs_close(again, result, rtol=0, atol=0)


@pytest.mark.slow
def test_the_uniform_is_an_input_of_the_compiled_sampler(compiled):
    agent, _, _ = compiled
    fn = compiled_step.compile_once(compiled_step.agent_and_env_step)
    obs, hidden = _env().observe(), torch.zeros(B, H, requires_grad=True)
    noise = torch.zeros(B, 4)
    low, _, _ = fn(agent, _env(), obs, hidden, torch.zeros(B), noise)
    high, _, _ = fn(agent, _env(), obs, hidden, torch.full((B,), 1 - 1e-6), noise)
    assert torch.equal(low.action, torch.zeros(B, dtype=torch.long))  # the CDF's first bin
    assert torch.equal(high.action, torch.ones(B, dtype=torch.long))  # its last


def _atomic_adds(code):
    """Atomic accumulations in inductor's code: ``atomic_add(``/``atomic_add_vec<...>(`` (C++),
    ``tl.atomic_add(`` (triton), and a triton kernel's ``'atomic_add_found': True`` metadata. Every
    triton kernel's metadata carries the key ``atomic_add_found`` (False without atomics): the key
    alone is no atomic."""
    pattern = r"\batomic_add(?:_vec)?\s*(?:<[^>]*>)?\s*\(|['\"]atomic_add_found['\"]\s*:\s*True"
    return [match for source in code for match in re.findall(pattern, source)]


@pytest.mark.slow
def test_generated_code_has_no_atomic_adds(compiled):
    _, _, code = compiled
    assert len(code) >= 2, "forward and backward code expected"  # the scan below reads real kernels
    assert all("kernel" in source for source in code)
    assert _atomic_adds(code) == []


def test_the_atomics_scan_sees_an_atomic_kernel():
    def index_add(x, index, source):
        return x.index_add(0, index, source)

    x, index, source = torch.zeros(3), torch.tensor([0, 1, 0, 2]), torch.ones(4)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # one thread needs no atomics; two, without the aten fallback, do
    try:
        # without inductor's aten fallback for a parallel scatter-add (an option of newer torch)
        no_fallback = (
            {"cpp.fallback_scatter_reduce_sum": False}
            if hasattr(inductor_config.cpp, "fallback_scatter_reduce_sum")
            else {}
        )
        with fresh_cache(), inductor_config.patch(no_fallback):
            compiled_fn = torch.compile(index_add, fullgraph=True)
            result, code = inductor_utils.run_and_get_code(compiled_fn, x, index, source)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(result, torch.tensor([2.0, 1.0, 1.0]))
    assert _atomic_adds(code)


@pytest.mark.slow
def test_training_step_equals_eager_and_is_bitwise_repeatable(compiled):
    def rollout_step(compile_step):
        model = DeepEPModule(**grouped(**MODULE_SIZES, compile_step=compile_step))
        model.ensure_rollout_state()
        model.seed_rollout()
        _, terms = model.rollout_and_loss()
        terms.loss.backward()
        grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
        return terms.loss.detach(), grads, model.rollout_state.hidden.clone(), model.rollout_state.env.state.clone()

    eager, first, second = rollout_step(False), rollout_step(True), rollout_step(True)
    torch.testing.assert_close(first[0], eager[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(first[2], eager[2], rtol=1e-5, atol=1e-6)
    assert torch.equal(first[3], eager[3])  # same actions, so the same CartPole trajectories
    for name, grad in eager[1].items():
        torch.testing.assert_close(first[1][name], grad, rtol=1e-4, atol=1e-6, msg=name)
    assert torch.equal(first[0], second[0]) and torch.equal(first[2], second[2])
    assert all(torch.equal(first[1][name], second[1][name]) for name in first[1])


def test_env_split_step_equals_step():
    for make in (lambda: BatchedCartPole(B), lambda: CueRecall(B, horizon=3)):
        whole, split = make(), make()
        for env in (whole, split):
            env.reset(torch.Generator().manual_seed(0))
        g_whole, g_split = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
        for t in range(4):
            action = torch.tensor([0, 1, 1, 0]) if t % 2 else torch.ones(B, dtype=torch.long)
            a = whole.step(action, g_whole)
            b = split.step_with_noise(action, split.draw_step_noise(g_split))
            assert all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("obs", "reward", "done", "episode_return"))
        assert torch.equal(g_whole.get_state(), g_split.get_state())


class _UnsplitCartPole(BatchedCartPole):
    """CartPole as a third-party env would be: ``step`` only, no split."""

    draw_step_noise = BatchedEnv.draw_step_noise
    step_with_noise = BatchedEnv.step_with_noise

    def step(self, action, generator):
        return BatchedCartPole.step_with_noise(self, action, BatchedCartPole.draw_step_noise(self, generator))


@pytest.mark.slow
def test_an_env_without_a_split_step_steps_eagerly_after_the_compiled_agent(compiled):
    agent, result, _ = compiled
    env = _UnsplitCartPole(B)
    env.reset(torch.Generator().manual_seed(1))
    with pytest.raises(NotImplementedError):
        env.step_with_noise(torch.ones(B, dtype=torch.long), torch.zeros(B, 4))
    timestep = CompiledTimestep(agent, env)
    assert timestep.compiled and not timestep.includes_env
    # env.step (eager) with the same numbers in the same order: the same timestep
    _assert_outputs_close(_one_timestep(timestep, agent, env), result)


@pytest.mark.slow
def test_under_a_dispatch_mode_the_timestep_runs_eagerly_and_the_mode_sees_its_ops(compiled):
    agent, result, _ = compiled
    seen = []

    class RecordOps(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func.__name__)
            return func(*args, **(kwargs or {}))

    env = _env()
    with RecordOps():
        recorded = _one_timestep(CompiledTimestep(agent, env), agent, env)
    assert any(name.startswith("addmm") for name in seen) and any(name.startswith("tanh") for name in seen)
    _assert_outputs_close(recorded, result)


def test_unavailable_compile_falls_back_to_eager_with_one_warning(monkeypatch):
    reason = "inductor's CPU backend needs a C++ compiler (test)"
    monkeypatch.setattr(compiled_step, "compile_unavailable_reason", lambda device: reason)
    monkeypatch.setattr(compiled_step, "compile_once", lambda fn: pytest.fail("compiled although unavailable"))

    def two_steps(compile_step):
        model = DeepEPModule(**grouped(**MODULE_SIZES, compile_step=compile_step))
        model.ensure_rollout_state()
        losses = []
        for _ in range(2):
            model.seed_rollout()
            losses.append(model.rollout_and_loss()[1].loss.detach())
            model.rollout_state.step += 1
        return torch.stack(losses)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fallback = two_steps(True)
    ours = [w for w in caught if "CompiledTimestep" in str(w.message)]
    assert len(ours) == 1 and reason in str(ours[0].message) and "eagerly" in str(ours[0].message)
    assert torch.equal(fallback, two_steps(False))


def test_compile_unavailable_reason_names_the_missing_piece(monkeypatch):
    assert compile_unavailable_reason("cpu") is None  # g++ is installed here
    assert "'meta'" in compile_unavailable_reason("meta")

    def no_compiler():
        raise RuntimeError("no g++ on PATH")

    monkeypatch.setattr("torch._inductor.cpp_builder.get_cpp_compiler", no_compiler)
    assert "C++ compiler" in compile_unavailable_reason("cpu") and "no g++" in compile_unavailable_reason("cpu")


def test_bad_arguments_are_refused_by_name():
    with pytest.raises(MisconfigurationException, match=r"compile_step=.*'yes'"):
        DeepEPModule(**grouped(compile_step="yes"))
    with pytest.raises(TypeError, match="agent must be a DeepEPAgent, got str"):
        CompiledTimestep("agent", BatchedCartPole(2))
    with pytest.raises(TypeError, match="env must be a BatchedEnv, got str"):
        CompiledTimestep(_agent(), "cartpole")


@pytest.mark.slow  # a fresh process compiles again
def test_benchmark_quick_runs_on_cpu(tmp_path, run_process):
    # one variant per kind of step (op by op, compiled timestep, the extension's rollout kernel)
    variants = ["eager", "compiled_eager", "rollout_kernel_eager"]
    out = run_process(
        [sys.executable, "benchmarks/bench_train_step.py", "--quick", "--out", str(tmp_path), "--variants", *variants],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads((tmp_path / "train_step_quick.json").read_text())
    shape = report["shapes"][0]
    assert set(variants) == shape["median_ms_per_step"].keys()
    assert shape["flops_per_step"] > 0 and shape["achieved_tflops"]["eager"] > 0


# ---------------------------------------------------------------- GPU
GPU_SIZES = dict(num_envs=64, rollout_length=32, hidden_size=64, seed=5, fused_value_head=True)


def _train_gpu(steps, graph, compile_step, seed=5, fused_bptt=False):
    model = DeepEPModule(
        **grouped(**{**GPU_SIZES, "seed": seed}, cuda_graph=graph, compile_step=compile_step, fused_bptt=fused_bptt)
    ).cuda()
    model.ensure_rollout_state()
    step = StandaloneStep(model, torch.optim.Adam(model.parameters(), lr=1e-3, capturable=graph))
    losses = torch.stack([step()["loss"].clone() for _ in range(steps)])
    torch.cuda.synchronize()
    assert step.graphed is None or step.graphed.captures == 1
    return model.state_dict(), losses


@pytest.mark.gpu
def test_generated_cuda_code_has_no_atomic_adds_and_equals_eager():
    agent, env = _agent().cuda(), _env("cuda")
    with fresh_cache():
        result, code = inductor_utils.run_and_get_code(_one_timestep, CompiledTimestep(agent, env), agent, env)
    assert len(code) >= 2 and all("triton" in source for source in code)
    assert _atomic_adds(code) == []
    env = _env("cuda")
    _assert_outputs_close(result, _one_timestep(lambda *args: eager_timestep(agent, env, *args), agent, env))


@pytest.mark.gpu
@pytest.mark.parametrize("fused_bptt", [False, True], ids=["autograd_bptt", "fused_bptt"])
def test_compiled_graph_step_is_bitwise_reproducible_across_fresh_modules(fused_bptt):
    state_a, losses_a = _train_gpu(20, graph=True, compile_step=True, fused_bptt=fused_bptt)
    state_b, losses_b = _train_gpu(20, graph=True, compile_step=True, fused_bptt=fused_bptt)
    assert torch.equal(losses_a, losses_b)
    assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)


@pytest.mark.gpu
@pytest.mark.parametrize("fused_bptt", [False, True], ids=["autograd_bptt", "fused_bptt"])
def test_compiled_graph_step_equals_eager_reference_to_fp32_rounding(fused_bptt):
    """The reference is the op-by-op eager step with autograd through time, for both backward paths."""
    eager_state, eager_losses = _train_gpu(20, graph=False, compile_step=False)
    state, losses = _train_gpu(20, graph=True, compile_step=True, fused_bptt=fused_bptt)
    torch.testing.assert_close(losses, eager_losses, rtol=1e-4, atol=1e-5)
    for key, value in eager_state.items():
        torch.testing.assert_close(state[key], value, rtol=1e-3, atol=1e-4, msg=key)
    # negative control: another seed's run is far outside that tolerance
    _, other_losses = _train_gpu(20, graph=True, compile_step=True, seed=6, fused_bptt=fused_bptt)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(other_losses, eager_losses, rtol=1e-4, atol=1e-5)
