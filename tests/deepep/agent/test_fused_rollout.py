"""deepep::cartpole_rollout: the rollout's no-gradient timesteps in one launch equal the op-by-op timesteps.

CPU: the CPU kernel (the same stage code as the CUDA kernel) against the agent's and CartPole's own ops in
float64 and float32, bitwise repeats, the schema (opcheck), the refusals, and the module switch. GPU (marked):
the CUDA kernel against the op-by-op timesteps and the CPU kernel, bitwise repeats, inside a CUDA graph, and
the training step with it (eager and graph) repeating bitwise; the cluster kernel (float32, Hopper) against the
block kernel's bits.
"""

from __future__ import annotations

import pytest
import torch

from deepep_lightning.deepep import DeepEPModule
from deepep_lightning.deepep.agent import DeepEPAgent
from deepep_lightning.deepep.agent.fused_rollout import (
    RolloutSteps,
    fused_rollout_unsupported_reason,
    rollout_steps,
    rollout_steps_fused,
)
from deepep_lightning.deepep.config import grouped
from deepep_lightning.deepep.envs import BatchedCartPole, CueRecall
from deepep_lightning.deepep.graph_training import StandaloneStep
from deepep_lightning.ops import extension_available

pytestmark = pytest.mark.skipif(not extension_available(), reason="needs the compiled deepep extension")

FIELDS = tuple(RolloutSteps.__dataclass_fields__)


def _setup(dtype=torch.float64, batch=10, hidden=24, device="cpu", seed=0, episode=30, **agent_args):
    """An agent, a CartPole env (short episodes: resets happen), a recurrent state and a generator, all in dtype."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # the env's state and its random draws in dtype, as the agent
    try:
        torch.manual_seed(seed)
        agent = DeepEPAgent(4, 2, hidden, **agent_args).to(device)
        env = BatchedCartPole(batch, device, max_episode_steps=episode)
        generator = torch.Generator(device).manual_seed(seed + 1)
        env.reset(generator)
        state = torch.randn(batch, hidden, device=device) * 0.5
    finally:
        torch.set_default_dtype(previous)
    return agent, env, state, generator


def _both(length=40, dtype=torch.float64, rows_per_block=3, device="cpu", **kwargs):
    """The op-by-op timesteps and the kernel's from twin set-ups; the two envs after them."""
    agent, env, state, generator = _setup(dtype, device=device, **kwargs)
    twin_agent, twin_env, twin_state, twin_generator = _setup(dtype, device=device, **kwargs)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # the action's uniforms in dtype on both paths
    try:
        want = rollout_steps(agent, env, state, length, generator)
        got = rollout_steps_fused(twin_agent, twin_env, twin_state, length, twin_generator, rows_per_block)
    finally:
        torch.set_default_dtype(previous)
    return want, got, env, twin_env


def _assert_steps_close(want, got, env, twin_env, tolerance):
    for name in FIELDS:
        expected, actual = getattr(want, name), getattr(got, name)
        assert actual.shape == expected.shape and actual.dtype == expected.dtype, name
        if expected.dtype in (torch.long, torch.bool):
            assert torch.equal(actual, expected), name  # the same actions, ends and resets
        else:
            torch.testing.assert_close(actual, expected, rtol=tolerance, atol=tolerance, msg=name)
    for name in ("state", "episode_return", "episode_length"):
        torch.testing.assert_close(getattr(twin_env, name), getattr(env, name), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize(
    "agent_args, rows_per_block",
    [({}, 3), ({"policy_reads_hidden": False}, 1), ({"logit_bound": 2.0}, 8), ({"value_hidden_size": 40}, 4)],
)
def test_kernel_equals_the_op_by_op_timesteps_in_float64(agent_args, rows_per_block):
    want, got, env, twin_env = _both(rows_per_block=rows_per_block, **agent_args)
    assert 0 < int(want.dones.sum()) and bool(want.terminateds.any()) and bool((want.dones & ~want.terminateds).any())
    _assert_steps_close(want, got, env, twin_env, 1e-12)


def test_kernel_equals_the_op_by_op_timesteps_in_float32_to_rounding():
    want, got, env, twin_env = _both(dtype=torch.float32, batch=16, hidden=32)
    _assert_steps_close(want, got, env, twin_env, 1e-5)


def test_a_wrong_step_is_caught_by_the_comparison():
    """Negative control: the kernel run from another recurrent state is told apart."""
    want, _, env, _ = _both()
    agent, other_env, state, generator = _setup()
    got = rollout_steps_fused(agent, other_env, state + 1e-3, 40, generator, 3)
    with pytest.raises(AssertionError):
        _assert_steps_close(want, got, env, other_env, 1e-12)


def test_rows_per_block_does_not_change_the_result():
    results = []
    for rows in (1, 3, 8):
        agent, env, state, generator = _setup(torch.float32)
        results.append(rollout_steps_fused(agent, env, state, 20, generator, rows))
    for other in results[1:]:
        assert all(torch.equal(getattr(results[0], name), getattr(other, name)) for name in FIELDS)


def _op_inputs(device="cpu", batch=70, hidden=24, steps=30):
    """The op's arguments drawn once: states, uniforms, noise and the agent's weights (episodes of 12 steps end)."""
    from deepep_lightning.deepep.agent.fused_rollout import _weights

    agent, env, state, _ = _setup(torch.float32, batch=batch, hidden=hidden, logit_bound=3.0, episode=12)
    draws = torch.Generator().manual_seed(4)
    uniforms, noise = torch.rand(steps, batch, generator=draws), torch.rand(steps, batch, 4, generator=draws)
    tensors = [env.state, env.episode_return, env.episode_length, state, uniforms, noise]
    weights = [w.detach().to(device) for w in _weights(agent)]
    return [t.to(device) for t in tensors], weights


def test_cpu_kernel_bits_do_not_depend_on_the_thread_count():
    inputs, weights = _op_inputs()
    threads = torch.get_num_threads()
    results = []
    try:
        for count in (1, 2, max(3, threads)):
            torch.set_num_threads(count)
            results.append(torch.ops.deepep.cartpole_rollout.default(*inputs, weights, 3.0, 12, 2))
    finally:
        torch.set_num_threads(threads)
    assert bool(results[0][5].any())  # episodes end inside the rollout
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


def test_bitwise_repeat():
    runs = []
    for _ in range(2):
        agent, env, state, generator = _setup(torch.float32)
        runs.append(rollout_steps_fused(agent, env, state, 20, generator, 4))
    assert all(torch.equal(getattr(runs[0], name), getattr(runs[1], name)) for name in FIELDS)


def test_opcheck():
    from deepep_lightning.deepep.agent.fused_rollout import _weights

    agent, env, state, _ = _setup(torch.float32, batch=5, hidden=8)
    weights = [w.detach() for w in _weights(agent)]
    args = (env.state, env.episode_return, env.episode_length, state, torch.rand(6, 5), torch.rand(6, 5, 4), weights)
    torch.library.opcheck(torch.ops.deepep.cartpole_rollout.default, (*args, 0.0, 30, 2))


def test_what_the_kernel_cannot_run_is_named():
    agent, env, state, generator = _setup(torch.float32, batch=4, hidden=8)
    memory = CueRecall(4)
    assert "CartPole only" in fused_rollout_unsupported_reason(agent, memory)
    assert "float32 or float64" in fused_rollout_unsupported_reason(agent.double(), env)
    with pytest.raises(ValueError, match="rollout_steps_fused: the fused rollout steps CartPole only"):
        rollout_steps_fused(agent, memory, state, 3, generator)
    agent.float()
    with pytest.raises(ValueError, match=r"rows_per_block must be an int in \[1, 8\], got 9"):
        rollout_steps_fused(agent, env, state, 3, generator, rows_per_block=9)
    with pytest.raises(ValueError, match=r"hidden must be \[4, 8\], got \(4, 9\)"):
        rollout_steps_fused(agent, env, torch.zeros(4, 9), 3, generator)


MODULE = dict(num_envs=8, rollout_length=12, hidden_size=16, seed=3, fused_bptt=True, bptt_truncation=6)


def _train(steps, **kwargs):
    model = DeepEPModule(**grouped(**{**MODULE, **kwargs}))
    model.ensure_rollout_state()
    step = StandaloneStep(model, torch.optim.Adam(model.parameters(), lr=1e-3))
    return model, torch.stack([step()["loss"].detach().clone() for _ in range(steps)])


def test_module_steps_with_the_kernel_equal_the_op_by_op_loop_to_rounding():
    _, losses = _train(6, fused_rollout=True)
    _, reference = _train(6, fused_rollout=False)
    torch.testing.assert_close(losses, reference, rtol=1e-4, atol=1e-5)
    _, other = _train(6, fused_rollout=True, seed=4)  # negative control
    with pytest.raises(AssertionError):
        torch.testing.assert_close(other, reference, rtol=1e-4, atol=1e-5)


def test_module_switch_is_off_on_cpu_by_default_and_refuses_what_it_cannot_run():
    model, _ = _train(1)
    assert not model.fused_rollout_on  # None: CUDA only
    with pytest.raises(ValueError, match="fused_rollout=True.*the fused rollout steps CartPole only"):
        _train(1, fused_rollout=True, name="memory")
    for bad in ({"compile_step": True}, {"fused_bptt": False}):
        with pytest.raises(ValueError, match=r"fused_rollout=\.\.\.\)` must be None or False"):
            DeepEPModule(**grouped(**{**MODULE, **bad, "fused_rollout": True}))


def _as_if_on_cuda(model, monkeypatch, kernels_built=True):
    """``model`` (its state built on the CPU) reporting a CUDA device, where None resolves the switch."""
    from deepep_lightning.deepep import rollout_loss

    model.ensure_rollout_state()
    monkeypatch.setattr(model, "_device", torch.device("cuda", 0))
    monkeypatch.setattr(rollout_loss, "_cuda_kernels_load", lambda: kernels_built)


@pytest.mark.parametrize("case", ["memory_env", "float64_agent"])
def test_none_on_cuda_warns_once_naming_why_the_rollout_runs_op_by_op(case, monkeypatch, recwarn):
    model = DeepEPModule(**grouped(**{**MODULE, **({"name": "memory"} if case == "memory_env" else {})}))
    _as_if_on_cuda(model, monkeypatch)
    if case == "float64_agent":
        model.agent.double()  # the env's state stays float32
    assert not model.fused_rollout_on and not model.fused_rollout_on
    messages = [str(w.message) for w in recwarn if "fused_rollout=None" in str(w.message)]
    why = "CartPole only" if case == "memory_env" else "float32 or float64 for every weight and env state"
    assert len(messages) == 1 and why in messages[0] and "fused_rollout=False" in messages[0]


@pytest.mark.parametrize("case", ["false", "cpu", "kernels_not_built"])
def test_no_warning_where_the_op_by_op_rollout_is_chosen_or_already_explained(case, monkeypatch, recwarn):
    model = DeepEPModule(
        **grouped(**{**MODULE, "name": "memory", **({"fused_rollout": False} if case == "false" else {})})
    )
    if case == "cpu":
        model.ensure_rollout_state()
    else:
        _as_if_on_cuda(model, monkeypatch, kernels_built=case != "kernels_not_built")
    assert not model.fused_rollout_on
    assert not [w for w in recwarn if "fused_rollout=None" in str(w.message)]


# ---------------------------------------------------------------- GPU


def _needs_cuda_kernels():
    from deepep_lightning.ops import cuda_kernels_available

    if not torch.cuda.is_available() or not cuda_kernels_available():
        pytest.skip("needs CUDA and the compiled deepep CUDA kernels")


@pytest.mark.gpu
@pytest.mark.parametrize("rows_per_block", [1, 2, 4, 8])
def test_gpu_kernel_equals_the_op_by_op_timesteps_in_float64(rows_per_block):
    _needs_cuda_kernels()
    want, got, env, twin_env = _both(
        length=64, batch=300, hidden=256, device="cuda", rows_per_block=rows_per_block, episode=40
    )
    _assert_steps_close(want, got, env, twin_env, 1e-11)


@pytest.mark.gpu
def test_gpu_kernel_equals_the_cpu_kernel_in_float64():
    """The same inputs (weights, states, uniforms, noise) on both devices: the shared stage code agrees to rounding."""
    from deepep_lightning.deepep.agent.fused_rollout import _weights

    _needs_cuda_kernels()
    agent, env, state, _ = _setup(torch.float64, batch=20, hidden=64, logit_bound=3.0, episode=12)
    draws = torch.Generator().manual_seed(9)
    uniforms = torch.rand(30, 20, dtype=torch.float64, generator=draws)
    noise = torch.rand(30, 20, 4, dtype=torch.float64, generator=draws)
    inputs = [env.state, env.episode_return, env.episode_length, state, uniforms, noise]
    weights = [w.detach() for w in _weights(agent)]
    cpu = torch.ops.deepep.cartpole_rollout.default(*inputs, weights, 3.0, 12, 4)
    cuda = torch.ops.deepep.cartpole_rollout.default(
        *[t.cuda() for t in inputs], [w.cuda() for w in weights], 3.0, 12, 4
    )
    assert bool(cpu[5].any())  # episodes end and reset inside the rollout
    for index, (expected, actual) in enumerate(zip(cpu, cuda)):
        if expected.is_floating_point():
            torch.testing.assert_close(actual.cpu(), expected, rtol=1e-12, atol=1e-12, msg=f"output {index}")
        else:
            assert torch.equal(actual.cpu(), expected), f"output {index}"


@pytest.mark.gpu
def test_gpu_kernel_in_float32_equals_the_op_by_op_timesteps_to_rounding_and_repeats_bitwise():
    _needs_cuda_kernels()
    want, got, env, twin_env = _both(length=8, dtype=torch.float32, batch=256, hidden=256, device="cuda")
    _assert_steps_close(want, got, env, twin_env, 1e-4)
    runs = []
    for _ in range(20):
        agent, env, state, generator = _setup(torch.float32, 256, 256, "cuda")
        runs.append(rollout_steps_fused(agent, env, state, 64, generator))
    assert all(torch.equal(getattr(runs[0], n), getattr(run, n)) for run in runs[1:] for n in FIELDS)


@pytest.mark.gpu
@pytest.mark.parametrize("rows_per_block", [2, None], ids=["blocks", "default"])
def test_gpu_kernel_inside_a_cuda_graph_equals_the_eager_launch(rows_per_block):
    _needs_cuda_kernels()
    agent, env, state, generator = _setup(torch.float32, 64, 64, "cuda")
    start = env.state_dict()
    eager = rollout_steps_fused(agent, env, state, 16, generator.manual_seed(7), rows_per_block)
    env.load_state_dict(start)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        generator.manual_seed(7)
        rollout_steps_fused(agent, env, state, 16, generator, rows_per_block)  # warm-up outside the capture
        env.load_state_dict(start)
        generator.manual_seed(7)
        graph.register_generator_state(generator)
        with torch.cuda.graph(graph):
            captured = rollout_steps_fused(agent, env, state, 16, generator, rows_per_block)
    torch.cuda.current_stream().wait_stream(stream)
    env.load_state_dict(start)
    generator.manual_seed(7)
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(getattr(eager, n), getattr(captured, n)) for n in FIELDS)


def _needs_clusters():
    _needs_cuda_kernels()
    if torch.cuda.get_device_properties(0).major < 9:
        pytest.skip("the cluster kernel needs thread-block clusters (compute capability 9.0+)")


@pytest.mark.gpu
@pytest.mark.parametrize(
    "batch, hidden, agent_args, rows_per_cluster",
    [
        (256, 256, {"policy_reads_hidden": False}, 0),  # configs/gpu.yaml's shape, the kernel's choice of rows
        (256, 256, {"policy_reads_hidden": False}, 4),  # 64 clusters: more than are resident at once
        (256, 256, {"policy_reads_hidden": False}, 16),
        (256, 256, {"policy_reads_hidden": False}, 24),  # a last cluster of 16 rows
        (300, 256, {}, 16),  # a last cluster of 12 rows; the policy reads [obs; h]
        (300, 256, {}, 0),
        (37, 90, {"value_hidden_size": 60}, 0),  # sizes that are not multiples of 4 or of 8 units
    ],
)
def test_gpu_cluster_kernel_gives_the_block_kernels_bits(batch, hidden, agent_args, rows_per_cluster):
    """The same sums in the same order: every output of the cluster kernel equals the block kernel's, bit for bit,
    however many environments a cluster owns."""
    from deepep_lightning.deepep.agent.fused_rollout import _weights, runs_on_clusters

    _needs_clusters()
    agent, env, state, _ = _setup(torch.float32, batch, hidden, "cuda", logit_bound=3.0, episode=12, **agent_args)
    assert runs_on_clusters(agent, env)
    draws = torch.Generator("cuda").manual_seed(4)
    uniforms = torch.rand(96, batch, device="cuda", generator=draws)
    noise = torch.rand(96, batch, 4, device="cuda", generator=draws)
    inputs = [env.state, env.episode_return, env.episode_length, state, uniforms, noise, _weights(agent), 3.0, 12]
    blocks = torch.ops.deepep.cartpole_rollout.default(*inputs, 4)
    clusters = torch.ops.deepep.cartpole_rollout_clusters.default(*inputs, rows_per_cluster)
    assert bool(blocks[5].any()) and bool((blocks[3] == 1).any())  # episodes end; both actions are taken
    for index, (expected, actual) in enumerate(zip(blocks, clusters)):
        assert torch.equal(actual, expected), f"output {index}"


@pytest.mark.gpu
def test_gpu_cluster_kernel_refuses_float64_by_name():
    from deepep_lightning.deepep.agent.fused_rollout import runs_on_clusters

    _needs_clusters()
    agent, env, state, _ = _setup(torch.float64, 32, 32, "cuda")
    assert not runs_on_clusters(agent, env)
    inputs, weights = _op_inputs("cuda", batch=32, hidden=32, steps=4)
    with pytest.raises(RuntimeError, match="hidden must be float32, got Double"):
        torch.ops.deepep.cartpole_rollout_clusters.default(
            *[t.double() for t in inputs], [w.double() for w in weights], 3.0, 12
        )


@pytest.mark.gpu
def test_gpu_launches_from_two_host_threads_give_the_bits_of_one():
    """Two host threads, each on its own stream, launch the same rollout at once: each result is the lone launch's."""
    import threading

    _needs_cuda_kernels()
    inputs, weights = _op_inputs("cuda", batch=256, hidden=256, steps=64)
    alone = torch.ops.deepep.cartpole_rollout.default(*inputs, weights, 3.0, 12, 4)
    torch.cuda.synchronize()
    results: dict[int, tuple] = {}

    def launch(index: int) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.default_stream())
        with torch.cuda.stream(stream):
            results[index] = torch.ops.deepep.cartpole_rollout.default(*inputs, weights, 3.0, 12, 4)
        stream.synchronize()

    workers = [threading.Thread(target=launch, args=(index,)) for index in range(2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert sorted(results) == [0, 1]
    for result in results.values():
        assert all(torch.equal(a, b) for a, b in zip(alone, result))


GPU_MODULE = dict(num_envs=256, rollout_length=32, hidden_size=256, seed=5, fused_value_head=True)


def _train_gpu(steps, graph, **kwargs):
    model = DeepEPModule(**grouped(**{**GPU_MODULE, **kwargs}, cuda_graph=graph)).cuda()
    model.ensure_rollout_state()
    step = StandaloneStep(model, torch.optim.Adam(model.parameters(), lr=1e-3, capturable=graph))
    losses = torch.stack([step()["loss"].clone() for _ in range(steps)])
    torch.cuda.synchronize()
    return model, losses


@pytest.mark.gpu
@pytest.mark.parametrize("graph", [False, True])
def test_gpu_default_training_step_runs_the_kernel_and_repeats_bitwise(graph):
    _needs_cuda_kernels()
    first, first_losses = _train_gpu(10, graph)
    assert first.fused_rollout_on  # None: on with CUDA
    second, second_losses = _train_gpu(10, graph)
    assert torch.equal(first_losses, second_losses)
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), second.state_dict().values()))
    _, reference = _train_gpu(10, graph, fused_rollout=False)
    torch.testing.assert_close(first_losses[:3], reference[:3], rtol=1e-3, atol=1e-4)
