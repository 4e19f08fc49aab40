"""Regression rollback: a collapse of a monitored metric restores the best snapshot and applies the policy."""

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException

from deepep_lightning import RegressionTrigger
from deepep_lightning.health import NaNRollbackCallback, NumericalHealthCallback
from deepep_lightning.health.regression import RegressionVerdict as V
from deepep_lightning.summary import RunSummaryCallback

from .conftest import ToyModule, checkpoint_round_trip, fit

MAX_STEPS = 40


class ScoredModule(ToyModule):
    """Logs ``train/score``: minus the loss on a fixed evaluation set (a pure function of the weights)."""

    def __init__(self) -> None:
        super().__init__(lr=0.05)
        generator = torch.Generator().manual_seed(5)
        self.eval_x = torch.randn(64, 4, generator=generator)
        self.eval_y = self.eval_x.sum(dim=1, keepdim=True)

    def training_step(self, batch, batch_idx):
        with torch.no_grad():
            was_training = self.training
            self.eval()
            score = -torch.nn.functional.mse_loss(self.inner(self.eval_x), self.eval_y)
            self.train(was_training)
        self.log("train/score", score)
        return super().training_step(batch, batch_idx)


class Collapse(pl.Callback):
    """At step ``step``, saturates the tanh layer (x 1000: its gradients vanish) and blows up the output layer
    (x 100): finite everywhere, and Adam's bounded steps need far longer than the run to undo it."""

    def __init__(self, step: int, rank: int | None = None) -> None:
        self.step, self.rank = step, rank

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step and self.rank in (None, trainer.global_rank):
            with torch.no_grad():
                pl_module.inner[0].weight.mul_(1000.0)
                pl_module.inner[3].weight.mul_(100.0)


class ScoreAtStep(pl.Callback):
    """The ``train/score`` the rollback reads at the check after ``step`` steps (when it snapshots there)."""

    def __init__(self, step: int) -> None:
        self.step, self.value = step, None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step and self.value is None:
            self.value = float(trainer.callback_metrics["train/score"])


def _score(module):
    with torch.no_grad():
        return float(-torch.nn.functional.mse_loss(module.inner(module.eval_x), module.eval_y))


def _run(tmp_path, trigger, policy="lower_lr", collapse=True, spike_detection=False, **kwargs):
    health = NumericalHealthCallback(check_every_n_steps=2, spike_detection=spike_detection, spike_warmup=4)
    rollback = NaNRollbackCallback(snapshot_every_n_steps=4, policy=policy, regression=trigger, **kwargs)
    callbacks = ([Collapse(20)] if collapse else []) + [health, rollback]
    trainer, module = fit(tmp_path, callbacks, max_steps=MAX_STEPS, module=ScoredModule)
    return trainer, module, health, rollback


def _trigger():
    return RegressionTrigger("train/score", mode="max", threshold=1.0, patience=2)


def test_collapse_restores_the_best_snapshot_and_recovers(tmp_path):
    _, clean, _, _ = _run(tmp_path / "clean", None, collapse=False)
    _, collapsed, _, _ = _run(tmp_path / "collapsed", None)
    assert _score(collapsed) < 100 * _score(clean)  # negative control: without the trigger it stays collapsed

    trainer, module, health, rollback = _run(tmp_path / "rollback", _trigger())
    kinds = [(e["kind"], e["step"]) for e in health.events.events]
    # two checks (patience=2, every 2 steps) after the collapse at step 20; the snapshot of step 20 is the best;
    # the next check beats that best, so the collapse is over (recovered, named by the incident's step)
    assert kinds == [("regression", 24), ("rollback", 20), ("policy", 24), ("recovered", 24)]
    assert rollback.incidents[0].best_step == 20 and rollback.incidents[0].outcome == "recovered"
    assert rollback.incidents[0].recovered_at == 26
    assert trainer.global_step == MAX_STEPS and rollback.state_dict()["lr_scale"] == 0.5
    assert _score(module) > 2 * _score(clean)  # recovered: near the clean run (scores are negative)
    assert _score(module) > 100 * _score(collapsed)


def test_collapse_that_also_spikes_the_loss_is_rolled_back_when_spikes_are_ignored(tmp_path):
    """The collapse makes every later loss a spike; with rollback_on_spike=False the trigger still judges the metric."""
    trainer, module, health, rollback = _run(
        tmp_path, _trigger(), spike_detection=True, rollback_on_spike=False, policy="lower_lr"
    )
    kinds = [e["kind"] for e in health.events.events]
    assert kinds[0] == "spike_ignored" and kinds.count("regression") == 1  # the loss spikes at the collapse's checks
    assert kinds[kinds.index("regression") :][:3] == ["regression", "rollback", "policy"]
    assert rollback.incidents[0].reason == "regression" and rollback.incidents[0].best_step == 20
    assert trainer.global_step == MAX_STEPS and _score(module) > -1.0  # recovered (the collapsed score is far lower)


def test_stop_policy_stops_at_the_best_weights(tmp_path):
    with pytest.warns(UserWarning, match="stopped training: train/score="):
        trainer, module, health, rollback = _run(tmp_path, _trigger(), policy="stop")
    assert rollback.stopped and trainer.global_step == 24
    assert rollback.stop_report["weights_at_step"] == 20 and [e["kind"] for e in health.events.events][-1] == "stopped"
    assert all(torch.isfinite(p).all() for p in module.parameters())


def test_retry_cap_stops_when_the_collapse_comes_back(tmp_path):
    """The collapse comes back at every step from 20 on, so no new best is reached: max_retries rollbacks, a stop."""

    class EveryRestore(Collapse):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step >= 20:
                with torch.no_grad():
                    pl_module.inner[0].weight.fill_(50.0)
                    pl_module.inner[3].weight.fill_(50.0)

    health = NumericalHealthCallback(check_every_n_steps=2, spike_detection=False)
    rollback = NaNRollbackCallback(snapshot_every_n_steps=4, policy="skip", max_retries=1, regression=_trigger())
    with pytest.warns(UserWarning, match="stopped training"):
        fit(tmp_path, [EveryRestore(0), health, rollback], max_steps=MAX_STEPS, module=ScoredModule)
    kinds = [e["kind"] for e in health.events.events]
    assert kinds.count("regression") == 2 and kinds.count("rollback") == 1 and kinds[-1] == "stopped"


def test_trigger_state_round_trips_through_the_checkpoint(tmp_path):
    trainer, _, _, rollback = _run(tmp_path, _trigger())
    twin = NaNRollbackCallback(snapshot_every_n_steps=4, policy="lower_lr", regression=_trigger())
    saved = checkpoint_round_trip(tmp_path, trainer, rollback, twin)
    assert saved["regression"]["best"] == rollback.regression.best and saved["regression"]["checks"] == 20
    assert twin.regression.best_step == rollback.regression.best_step


def test_trigger_rule():
    trigger = RegressionTrigger("m", mode="min", threshold=0.5, threshold_mode="abs", patience=2, warmup_checks=1)
    assert trigger.update(100.0, 0) is V.NONE  # warm-up: not a best yet
    assert [trigger.update(v, s) for s, v in enumerate([1.0, 1.4, 1.6, 1.2, 1.6, 1.7], start=1)] == [
        V.NONE,  # best 1.0
        V.NONE,  # within 0.5
        V.NONE,  # past it, 1 of 2
        V.NONE,  # back within: the count restarts
        V.NONE,
        V.COLLAPSED,  # 2 checks in a row past it
    ]
    assert trigger.best == 1.0 and trigger.best_step == 1
    assert trigger.rank({4: 2.0, 8: 1.0, 12: float("nan"), 16: 1.0}) == [16, 8, 4]  # best first, newest on a tie


def test_a_rollback_that_holds_ends_the_collapse_at_the_metrics_ceiling():
    """A return at its ceiling (500 of 500) cannot set a new best: holding within the threshold for ``patience``
    checks ends the collapse, so a later one gets ``max_retries`` rollbacks of its own."""
    trigger = RegressionTrigger("m", mode="max", threshold=0.5, patience=2)
    assert [trigger.update(v, s) for s, v in enumerate([500.0, 100.0, 100.0])] == [V.NONE, V.NONE, V.COLLAPSED]
    trigger.rolled_back()
    # one check within, one past (the count restarts), then two within: recovered, the attempts start again
    assert [trigger.update(v, s) for s, v in enumerate([500.0, 100.0, 500.0, 490.0], start=3)] == [
        V.NONE,
        V.NONE,
        V.NONE,
        V.RECOVERED,
    ]
    assert trigger.attempts == 0 and trigger.best == 500.0
    # negative control: a collapse right after the rollback is the same collapse, its attempts add up
    trigger.update(100.0, 7)
    assert trigger.update(100.0, 8) is V.COLLAPSED
    trigger.rolled_back()
    assert [trigger.update(v, s) for s, v in enumerate([500.0, 100.0, 100.0], start=9)] == [V.NONE, V.NONE, V.COLLAPSED]
    assert trigger.attempts == 1


class CeilingModule(ScoredModule):
    """Logs ``train/score`` capped at a ceiling it reaches early (a return of 500 out of 500): no new best after it."""

    def training_step(self, batch, batch_idx):
        output = super().training_step(batch, batch_idx)
        self.log("train/score", torch.clamp(self.trainer.callback_metrics["train/score"], max=-2.0))
        return output


def test_collapses_that_each_recover_are_each_rolled_back_at_the_ceiling(tmp_path):
    """Two collapses (steps 12 and 26) with a held recovery between them: max_retries=1 rolls back both and the run
    ends recovered. Counting rollbacks until a new best instead, the second collapse would stop the run."""
    health = NumericalHealthCallback(check_every_n_steps=2, spike_detection=False)
    rollback = NaNRollbackCallback(snapshot_every_n_steps=4, policy="lower_lr", max_retries=1, regression=_trigger())
    trainer, module = fit(
        tmp_path, [Collapse(12), Collapse(26), health, rollback], max_steps=MAX_STEPS, module=CeilingModule
    )
    kinds = [e["kind"] for e in health.events.events]
    assert kinds == ["regression", "rollback", "policy", "recovered"] * 2
    assert not rollback.stopped and trainer.global_step == MAX_STEPS
    assert [i.outcome for i in rollback.incidents] == ["recovered", "recovered"]
    assert rollback.regression.best == -2.0 and _score(module) > -2.0


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"monitor": ""}, "monitor"),
        ({"monitor": "m", "mode": "up"}, "mode"),
        ({"monitor": "m", "threshold": float("inf")}, "threshold"),
        ({"monitor": "m", "threshold": 0}, "threshold"),
        ({"monitor": "m", "threshold_mode": "pct"}, "threshold_mode"),
        ({"monitor": "m", "patience": 0}, "patience"),
    ],
)
def test_bad_arguments(kwargs, name):
    with pytest.raises(MisconfigurationException, match=f"RegressionTrigger\\({name}=") as info:
        RegressionTrigger(**kwargs)
    assert repr(kwargs[name]) in str(info.value)
    with pytest.raises(MisconfigurationException, match="regression"):
        NaNRollbackCallback(regression="train/score")


class SharpenPolicy(pl.Callback):
    """At step ``step``, scales DeepEP's policy logits x 100 in place: a near-deterministic policy (entropy ~0.1,
    a collapse of exploration) that training does not undo on its own."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            with torch.no_grad():
                pl_module.agent.policy_net[2].weight.mul_(100.0)
                pl_module.agent.policy_net[2].bias.mul_(100.0)


def deepep_regression_run(tmp_path, trigger, accelerator="cpu", **module_args):
    """DeepEP with the entropy collapse at step 10; returns the trainer, the module and the health callback."""
    from deepep_lightning.deepep import DeepEPModule
    from deepep_lightning.deepep.config import grouped

    health = NumericalHealthCallback(check_every_n_steps=2, spike_detection=False)
    rollback = NaNRollbackCallback(snapshot_every_n_steps=4, policy="skip", regression=trigger)
    args = {"num_envs": 16, "rollout_length": 16, "hidden_size": 32, "steps_per_epoch": 40, "fused_value_head": False}
    trainer, module = fit(
        tmp_path,
        [SharpenPolicy(10), health, rollback],
        max_steps=30,
        module=lambda: DeepEPModule(**grouped(**{**args, **module_args})),
        accelerator=accelerator,
    )
    return trainer, module, health


def entropy_trigger():
    return RegressionTrigger("train/entropy", mode="max", threshold=0.5, patience=2)


def test_deepep_entropy_collapse_is_rolled_back(tmp_path):
    trainer, _, health = deepep_regression_run(tmp_path / "off", None)
    assert float(trainer.callback_metrics["train/entropy"]) < 0.3  # negative control: it stays collapsed
    trainer, _, health = deepep_regression_run(tmp_path / "on", entropy_trigger())
    kinds = [e["kind"] for e in health.events.events]
    assert kinds == ["regression", "rollback", "policy", "recovered"] and health.events.events[0]["step"] == 14
    assert float(trainer.callback_metrics["train/entropy"]) > 0.6  # exploring again (log 2 = 0.69)


def test_the_run_summary_says_which_weights_a_stop_left(tmp_path):
    """The metrics the summary reads were logged before the stop; the line also names the restored snapshot and
    its monitored value, so a run stopped after a collapse does not read as a collapsed model."""
    summary = RunSummaryCallback(["train/score"])
    health = NumericalHealthCallback(check_every_n_steps=2, spike_detection=False)
    rollback = NaNRollbackCallback(snapshot_every_n_steps=4, policy="stop", regression=_trigger())
    score = ScoreAtStep(20)
    with pytest.warns(UserWarning, match="stopped training"):
        fit(tmp_path, [Collapse(20), health, rollback, summary, score], max_steps=MAX_STEPS, module=ScoredModule)
    at_snapshot = rollback.stop_report["weights_metric"]["train/score"]
    assert at_snapshot == score.value > rollback.incidents[0].value  # the best (the snapshot's), not the collapse
    line = summary.last_summary
    assert f"stopped at step 24 with the weights of step 20 (train/score={at_snapshot:.4g} there)" in line
    assert line.index("train/score=") < line.index("stopped at step") < line.index("health:")


def test_the_run_summary_of_a_recovered_run_names_no_stop(tmp_path):
    summary = RunSummaryCallback(["train/score"])
    health = NumericalHealthCallback(check_every_n_steps=2, spike_detection=False)
    rollback = NaNRollbackCallback(snapshot_every_n_steps=4, policy="lower_lr", regression=_trigger())
    fit(tmp_path, [Collapse(20), health, rollback, summary], max_steps=MAX_STEPS, module=ScoredModule)
    assert rollback.incidents[0].outcome == "recovered" and "stopped at step" not in summary.last_summary
