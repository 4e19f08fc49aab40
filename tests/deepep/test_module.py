from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from deepep_lightning.deepep import DeepEPModule
from deepep_lightning.deepep.config import grouped
from deepep_lightning.deepep.envs import BatchedCartPole
from deepep_lightning.deepep.progress import ProgressLog
from deepep_lightning.health import NaNRollbackCallback, NumericalHealthCallback, RegressionTrigger
from deepep_lightning.protocols import monitored_metrics

TINY = dict(num_envs=8, rollout_length=8, hidden_size=16, steps_per_epoch=4)


def _fit(max_steps, **kwargs):
    model = DeepEPModule(**grouped(**{**TINY, **kwargs}))
    clip = None if kwargs.get("cuda_graph") else 1.0  # Lightning refuses gradient_clip_val in manual optimisation
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        gradient_clip_val=clip,
    )
    trainer.fit(model)
    return model, trainer


def test_two_seeded_fits_are_bitwise_identical_and_another_seed_differs():
    a, _ = _fit(6, seed=3)
    torch.manual_seed(999)  # the global RNG state must not leak into the run
    b, _ = _fit(6, seed=3)
    c, _ = _fit(6, seed=4)
    state_a, state_b, state_c = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)
    assert any(not torch.equal(state_a[k], state_c[k]) for k in state_a)


def test_fused_and_reference_value_heads_train_alike():
    fused, _ = _fit(3, seed=1, fused_value_head=True)
    reference, _ = _fit(3, seed=1, fused_value_head=False)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(fused.state_dict()[key], value, rtol=1e-4, atol=1e-5, msg=key)


def test_logs_the_documented_tags():
    _, trainer = _fit(4)
    for tag in (
        "train/loss",
        "train/policy_loss",
        "train/value_loss",
        "train/entropy",
        "train/grad_norm",
        "train/episode_return",
    ):
        assert tag in trainer.callback_metrics, tag
        assert torch.isfinite(trainer.callback_metrics[tag])


def _random_policy_mean_return(episodes=400):
    env = BatchedCartPole(episodes)
    generator = torch.Generator().manual_seed(123)
    env.reset(generator)
    returns = torch.full((episodes,), float("nan"))
    for _ in range(500):
        result = env.step(torch.randint(0, 2, (episodes,), generator=generator), generator)
        first = result.done & returns.isnan()
        returns[first] = result.episode_return[first]
        if not returns.isnan().any():
            break
    return returns.mean().item()


class _FinishedEpisodes(pl.Callback):
    def __init__(self):
        self.returns = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step > 150:  # the second half of the run
            rollout = pl_module.last_rollout
            self.returns += rollout.episode_returns[rollout.dones].tolist()


@pytest.mark.slow
def test_short_seeded_run_beats_the_random_policy():
    random_mean = _random_policy_mean_return()
    assert 18 < random_mean < 28  # CartPole under a uniform policy: ~22
    episodes = _FinishedEpisodes()
    model = DeepEPModule(**grouped(num_envs=32, rollout_length=32, hidden_size=64, seed=0))
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=300,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[episodes],
    )
    trainer.fit(model)
    # Policy-gradient curves are noisy step to step; average every episode of the second half.
    assert len(episodes.returns) > 100
    learned_mean = sum(episodes.returns) / len(episodes.returns)
    assert learned_mean > 1.5 * random_mean, (learned_mean, random_mean)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"name": "pong"}, r"name=.*must be one of \['cartpole', 'memory'\], got 'pong'"),
        ({"num_envs": 0}, r"num_envs=.*must be a positive int, got 0"),
        ({"rollout_length": -3}, r"rollout_length=.*got -3"),
        ({"hidden_size": 2.5}, r"hidden_size=.*got 2.5"),
        ({"gamma": 1.5}, r"gamma=.*\[0.0, 1.0\], got 1.5"),
        ({"learning_rate": 0}, r"learning_rate=.*got 0"),
        ({"name": "memory", "kwargs": {"horizon": 0}}, r"kwargs=.*horizon must be an int >= 2, got 0"),
    ],
)
def test_bad_arguments_fail_before_training(kwargs, message):
    with pytest.raises(MisconfigurationException, match=message):
        DeepEPModule(**grouped(**kwargs))


def test_cuda_graph_on_cpu_is_refused_with_a_hint():
    with pytest.raises(MisconfigurationException, match="cuda_graph=True.*needs a CUDA device.*HINT"):
        _fit(1, cuda_graph=True)


class _AllFinishedReturns(pl.Callback):
    def __init__(self):
        self.returns = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        rollout = pl_module.last_rollout
        self.returns += rollout.episode_returns[rollout.dones].tolist()


def test_epoch_episode_return_is_the_mean_over_finished_episodes():
    # Negative control: a mean of per-step means (what MeanMetric(nan_strategy="disable") gives, since it
    # drops the weights, torchmetrics#3434) differs from the per-episode mean on this run.
    finished = _AllFinishedReturns()
    model = DeepEPModule(**grouped(num_envs=8, rollout_length=16, hidden_size=16, steps_per_epoch=6, seed=0))
    step_means = []
    original_update = model.episode_return.update

    def update(return_sum, episodes):
        if episodes > 0:
            step_means.append((return_sum / episodes).item())
        original_update(return_sum, episodes)

    model.episode_return.update = update
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=6,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[finished],
    )
    trainer.fit(model)
    per_episode = sum(finished.returns) / len(finished.returns)
    logged = trainer.callback_metrics["train/episode_return"].item()
    assert logged == pytest.approx(per_episode, rel=1e-6)
    assert abs(sum(step_means) / len(step_means) - per_episode) > 1e-3 * per_episode


STABILISED = dict(target_tau=0.1, target_entropy=0.693, kl_coef=0.5, expected_value_coef=1.0, entropy_coef_rate=1.0)


def test_stabilised_fits_are_bitwise_identical_and_update_their_targets():
    a, _ = _fit(6, seed=3, **STABILISED)
    b, _ = _fit(6, seed=3, **STABILISED)
    state_a, state_b = a.state_dict(), b.state_dict()
    assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)
    agent = a.agent
    # the targets moved from their initial copies but lag the online networks (Polyak, not a copy)
    fresh_module = DeepEPModule(**grouped(**{**TINY, "seed": 3, **STABILISED}))
    fresh = fresh_module.agent
    for target, online in zip(agent.target_parameters(), agent.online_parameters_of_targets()):
        assert not torch.equal(target, online)
    assert any(not torch.equal(t, i) for t, i in zip(agent.target_parameters(), fresh.target_parameters()))
    # the adaptive entropy coefficient moved off its start value
    assert a.log_entropy_coef.item() != fresh_module.log_entropy_coef.item()
    assert "agent.target_value_head.output_bias" in state_a and "log_entropy_coef" in state_a


def test_stabilisers_off_leave_the_run_unchanged():
    plain, _ = _fit(4, seed=2)
    off, _ = _fit(4, seed=2, target_tau=None, target_entropy=None, kl_coef=0.0, expected_value_coef=0.0)
    on, _ = _fit(4, seed=2, target_tau=0.1)
    state_plain, state_off, state_on = plain.state_dict(), off.state_dict(), on.state_dict()
    assert all(torch.equal(state_plain[k], state_off[k]) for k in state_plain)
    assert any(not torch.equal(state_plain[k], state_on[k]) for k in state_plain)  # negative control


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"target_tau": 0.0}, r"target_tau=.*must be a number in \(0.0, 1.0\] or None, got 0.0"),
        ({"target_tau": 1.5}, r"target_tau=.*got 1.5"),
        ({"target_entropy": 0.9}, r"target_entropy=.*\[0.0, 0.693147\] or None, got 0.9"),
        ({"target_entropy": 0.3, "entropy_coef": 0.0}, r"entropy_coef=.*must be > 0 with target_entropy=0.3"),
        ({"entropy_coef_max": 1e-4}, r"entropy_coef_max=.*>= 0.001, got 0.0001"),
        ({"entropy_coef_rate": 0}, r"entropy_coef_rate=.*> 0.0, got 0"),
        ({"kl_coef": -1.0}, r"kl_coef=.*>= 0.0, got -1.0"),
        ({"kl_coef": 0.5}, r"kl_coef=.*must be 0 without target networks, got 0.5.*HINT"),
        ({"expected_value_coef": float("nan")}, r"expected_value_coef=.*got nan"),
        ({"chrono_horizon": 1}, r"chrono_horizon=.*>= 2, got 1"),
    ],
)
def test_bad_stabiliser_arguments_fail_before_training(kwargs, message):
    with pytest.raises(MisconfigurationException, match=message):
        DeepEPModule(**grouped(**kwargs))


class _LoggedEveryStep(pl.Callback):
    def __init__(self):
        self.rolling, self.finished = [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        rollout = pl_module.last_rollout
        self.finished += rollout.episode_returns.reshape(-1)[rollout.dones.reshape(-1)].tolist()
        self.rolling.append((trainer.callback_metrics["train/episode_return_100"].item(), list(self.finished[-100:])))


def test_rolling_100_episode_return_logged_every_step_and_progress_values_at_log_steps():
    recorder = _LoggedEveryStep()
    model = DeepEPModule(**grouped(**{**TINY, "num_envs": 32, "rollout_length": 16}, log_throughput=True))
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=12,
        log_every_n_steps=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[recorder],
    )
    trainer.fit(model)
    for logged, window in recorder.rolling:
        if window:
            assert logged == pytest.approx(sum(window) / len(window), rel=1e-6)
    assert len(recorder.finished) > 100  # the window really rolled
    # device tensors every step (no host read), host values for the progress bar at the steps Lightning writes
    assert trainer.callback_metrics["train/episode_return_100"].device == model.device
    assert trainer.callback_metrics["return_100"].device.type == "cpu"
    assert trainer.progress_bar_metrics["return_100"] == pytest.approx(recorder.rolling[-1][0], rel=1e-6)
    assert "train/loss" not in trainer.progress_bar_metrics  # no per-step conversion of a device tensor
    assert float(trainer.callback_metrics["perf/env_steps_per_s"]) > 0


def _quiet_trainer(**kwargs) -> pl.Trainer:
    """A CPU Trainer without logger, checkpoints, progress bar or summary; ``kwargs`` on top."""
    return pl.Trainer(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def test_progress_values_are_read_only_at_the_steps_lightning_writes(monkeypatch):
    reads = []
    original = ProgressLog.log

    def counting(self, module, *args):
        reads.append(module.trainer.global_step)
        original(self, module, *args)

    monkeypatch.setattr(ProgressLog, "log", counting)
    _quiet_trainer(max_steps=9, log_every_n_steps=3).fit(DeepEPModule(**grouped(**TINY)))
    assert reads == [2, 5, 8]  # the 0-based steps Lightning writes at with log_every_n_steps=3


class _Monitor(pl.Callback):
    def __init__(self, monitor):
        self.monitor = monitor  # as ModelCheckpoint and EarlyStopping name theirs


def _logged_steps(monkeypatch, callbacks=()) -> dict[str, list[int]]:
    """The global step of every ``self.log`` call of an 11-step fit, by name."""
    logged: dict[str, list[int]] = {}
    original = DeepEPModule.log

    def recording(self, name, *args, **kwargs):
        logged.setdefault(name, []).append(self.trainer.global_step)
        original(self, name, *args, **kwargs)

    monkeypatch.setattr(DeepEPModule, "log", recording)
    trainer = _quiet_trainer(max_steps=11, log_every_n_steps=3, callbacks=list(callbacks))
    trainer.fit(DeepEPModule(**grouped(**{**TINY, "steps_per_epoch": 5})))
    return logged


def test_loss_terms_are_logged_at_written_steps_epoch_ends_and_the_last_step_and_the_return_every_step(monkeypatch):
    """One ``self.log`` costs about half a millisecond of host time: the loss terms skip the steps nothing reads."""
    logged = _logged_steps(monkeypatch)
    # written at 2, 5, 8 (log_every_n_steps=3); the epochs (5 steps) end at 4 and 9; the fit's last step is 10
    for name in ("train/loss", "train/policy_loss", "train/value_loss", "train/entropy", "train/grad_norm"):
        assert logged[name] == [2, 4, 5, 8, 9, 10], name
    assert logged["train/episode_return"] == [2, 4, 5, 8, 9, 10]
    assert logged["train/episode_return_100"] == list(range(11))
    assert ProgressLog.logs_step(None, 0, 0)  # outside a Trainer: always


def test_a_monitored_loss_term_is_logged_at_every_step(monkeypatch):
    trigger = RegressionTrigger("train/entropy", mode="max", threshold=0.5, patience=2)
    rollback = NaNRollbackCallback(snapshot_every_n_steps=4, regression=trigger)
    assert monitored_metrics(SimpleNamespace(callbacks=[rollback, _Monitor("train/value_loss"), _Monitor(None)])) == {
        "train/entropy",
        "train/value_loss",
    }
    logged = _logged_steps(monkeypatch, [NumericalHealthCallback(check_every_n_steps=4), rollback])
    assert logged["train/entropy"] == list(range(11))  # what the trigger reads at its checks is current there
    assert logged["train/loss"] == [2, 4, 5, 8, 9, 10]  # the others as without a monitor
    logged = _logged_steps(monkeypatch, [_Monitor("train/policy_loss")])
    assert logged["train/policy_loss"] == list(range(11)) and logged["train/entropy"] == [2, 4, 5, 8, 9, 10]


def test_throughput_is_logged_only_when_asked_for():
    """A wall-clock figure differs between identical runs: off by default (configs turn it on)."""
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=4,
        log_every_n_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(DeepEPModule(**grouped(**TINY)))
    assert "perf/env_steps_per_s" not in trainer.callback_metrics and "return_100" in trainer.callback_metrics
    with pytest.raises(MisconfigurationException, match="log_throughput.*'yes'"):
        DeepEPModule(**grouped(**TINY, log_throughput="yes"))


def _policy_step_sizes(gradient, steps=20, **kwargs):
    """Per-element policy weight change after ``steps`` Adam steps on a constant policy gradient."""
    model = DeepEPModule(**grouped(**{**TINY, **kwargs}))
    optimizer = model.configure_optimizers()
    policy = list(model.agent.policy_net.parameters())
    start = [p.detach().clone() for p in policy]
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=False)
        for p in policy:
            p.grad = torch.full_like(p, gradient)
        optimizer.step()
    return torch.cat([(p.detach() - s).abs().flatten() for p, s in zip(policy, start)]), optimizer


def test_policy_adam_eps_bounds_the_policy_step_under_a_tiny_biased_gradient():
    lr, steps = 1e-4, 20
    default, optimizer = _policy_step_sizes(1e-7, steps, policy_learning_rate=lr)
    # Adam normalises a tiny consistent gradient to a full step per element (the drift this option bounds)
    assert default.min().item() > 0.8 * lr * steps
    damped, optimizer = _policy_step_sizes(1e-7, steps, policy_learning_rate=lr, policy_adam_eps=1e-4)
    assert [group["eps"] for group in optimizer.param_groups] == [1e-8, 1e-4]  # the critic keeps Adam's default
    assert damped.max().item() < 2e-3 * lr * steps  # lr·g/eps per step: 1e-3 of the full step
    # a gradient far above eps still gets Adam's normalised step
    strong, _ = _policy_step_sizes(1e-1, steps, policy_learning_rate=lr, policy_adam_eps=1e-4)
    assert strong.min().item() > 0.95 * lr * steps


def test_recurrent_learning_rate_moves_the_recurrent_cell_at_its_own_rate():
    def first_step_sizes(**kwargs):
        model = DeepEPModule(**grouped(**{**TINY, **kwargs}))
        optimizer = model.configure_optimizers()
        modules = {"cell": model.agent.rnn_cell, "head": model.agent.value_head, "policy": model.agent.policy_net}
        start = {name: [p.detach().clone() for p in module.parameters()] for name, module in modules.items()}
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        optimizer.step()  # Adam's first step moves every element by its group's lr
        sizes = {}
        for name, module in modules.items():
            change = torch.cat([(p.detach() - s).abs().flatten() for p, s in zip(module.parameters(), start[name])])
            sizes[name] = change.max().item()
        in_groups = sorted(id(p) for group in optimizer.param_groups for p in group["params"])
        assert in_groups == sorted(id(p) for p in model.parameters() if p.requires_grad)  # each parameter once
        return sizes, optimizer

    default, optimizer = first_step_sizes(learning_rate=3e-3, policy_learning_rate=1e-4)
    assert len(optimizer.param_groups) == 2  # negative control: the cell trains at the critic's rate
    assert default["cell"] == pytest.approx(3e-3, rel=1e-3)
    slow, optimizer = first_step_sizes(learning_rate=3e-3, policy_learning_rate=1e-4, recurrent_learning_rate=3e-4)
    assert [group["lr"] for group in optimizer.param_groups] == [3e-3, 1e-4, 3e-4]
    assert slow["cell"] == pytest.approx(3e-4, rel=1e-3)
    assert slow["head"] == pytest.approx(3e-3, rel=1e-3) and slow["policy"] == pytest.approx(1e-4, rel=1e-3)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"recurrent_learning_rate": 0}, r"recurrent_learning_rate=.*must be a finite number > 0 or None, got 0"),
        ({"policy_adam_eps": 0.0}, r"policy_adam_eps=.*must be a finite number > 0 or None, got 0.0"),
        ({"policy_adam_eps": float("inf")}, r"policy_adam_eps=.*got inf"),
        ({"policy_adam_eps": 1e-3, "optimizer": "sgd"}, r"policy_adam_eps=.*None with optimizer='sgd', got 0.001"),
        ({"logit_bound": -2.0}, r"logit_bound=.*must be a finite number > 0 or None, got -2.0"),
        ({"logit_bound": "3"}, r"logit_bound=.*got '3'"),
        ({"policy_reads_hidden": 0}, r"policy_reads_hidden=.*must be a bool, got 0"),
    ],
)
def test_bad_policy_step_arguments_fail_before_training(kwargs, message):
    with pytest.raises(MisconfigurationException, match=message):
        DeepEPModule(**grouped(**kwargs))


def test_policy_step_options_train_bitwise_repeatably_and_change_the_run():
    options = dict(policy_adam_eps=1e-5, logit_bound=3.0, recurrent_learning_rate=3e-4, policy_reads_hidden=False)
    a, _ = _fit(4, seed=2, **options)
    b, _ = _fit(4, seed=2, **options)
    plain, _ = _fit(4, seed=2)
    state_a, state_b, state_plain = a.state_dict(), b.state_dict(), plain.state_dict()
    assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)
    assert any(not torch.equal(state_a[k], state_plain[k]) for k in state_a)  # negative control
