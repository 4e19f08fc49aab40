"""Health and rollback on DeepEP (tiny CPU sizes): a transient fault leaves weights and rollout state bitwise equal."""

import pytest
import torch

from deepep_lightning.deepep import DeepEPModule
from deepep_lightning.deepep.config import grouped
from deepep_lightning.health import FaultInjectionCallback, NaNRollbackCallback, NumericalHealthCallback

from .conftest import fit, state_equal


def _make():
    return DeepEPModule(
        **grouped(num_envs=4, rollout_length=8, hidden_size=16, steps_per_epoch=20, fused_value_head=False)
    )


@pytest.mark.parametrize(
    "snapshot_every, check_every, fault_step, max_steps, rollback_to",
    [
        (4, 2, 5, 10, 4),
        # snapshots only at train start (step 0): the rollout state must already exist there
        (100, 1, 3, 6, 0),
    ],
    ids=["latest_snapshot", "train_start_snapshot"],
)
def test_deepep_transient_gradient_fault_is_invisible(
    tmp_path, snapshot_every, check_every, fault_step, max_steps, rollback_to
):
    def callbacks(health):
        return [health, NaNRollbackCallback(snapshot_every_n_steps=snapshot_every)]

    _, clean = fit(
        tmp_path, callbacks(NumericalHealthCallback(check_every_n_steps=check_every)), max_steps=max_steps, module=_make
    )
    health = NumericalHealthCallback(check_every_n_steps=check_every)
    _, faulty = fit(
        tmp_path,
        [FaultInjectionCallback("gradient", steps=[fault_step]), *callbacks(health)],
        max_steps=max_steps,
        module=_make,
    )
    assert [(e["kind"], e["step"]) for e in health.events.events] == [
        ("detected", fault_step),
        ("rollback", rollback_to),
        ("transient", fault_step),
    ]
    assert state_equal(clean.state_dict(), faulty.state_dict())
    a, b = clean.rollout_state_dict(), faulty.rollout_state_dict()
    assert a["rollout_step"] == b["rollout_step"] == max_steps
    assert torch.equal(a["hidden"], b["hidden"]) and all(torch.equal(a["env"][k], b["env"][k]) for k in a["env"])


def test_deepep_transient_fault_under_lr_decay_is_invisible(tmp_path):
    """The replay after the rollback runs its steps at their stairs' rates: the weights end as the clean run's."""

    def make():
        sizes = dict(num_envs=4, rollout_length=8, hidden_size=16, steps_per_epoch=20)
        return DeepEPModule(**grouped(**sizes, fused_value_head=False, lr_decay_steps=8, lr_decay_stages=4))

    def callbacks(health):
        return [health, NaNRollbackCallback(snapshot_every_n_steps=2)]

    _, clean = fit(tmp_path, callbacks(NumericalHealthCallback(check_every_n_steps=1)), max_steps=8, module=make)
    health = NumericalHealthCallback(check_every_n_steps=1)
    _, faulty = fit(
        tmp_path, [FaultInjectionCallback("gradient", steps=[5]), *callbacks(health)], max_steps=8, module=make
    )
    _, undecayed = fit(tmp_path, callbacks(NumericalHealthCallback()), max_steps=8, module=_make)
    assert [(e["kind"], e["step"]) for e in health.events.events][:2] == [("detected", 5), ("rollback", 4)]
    assert state_equal(clean.state_dict(), faulty.state_dict())
    assert not state_equal(clean.state_dict(), undecayed.state_dict())  # negative control: the decay acts


def test_deepep_persistent_loss_fault_skipped_and_diagnosed(tmp_path):
    health = NumericalHealthCallback(check_every_n_steps=1)
    rollback = NaNRollbackCallback(snapshot_every_n_steps=4, policy="skip")
    trainer, module = fit(
        tmp_path,
        [FaultInjectionCallback("loss", steps=[6], mode="always"), health, rollback],
        max_steps=10,
        module=_make,
    )
    kinds = [e["kind"] for e in health.events.events]
    assert kinds[-1] == "recovered" and "diagnosis" in kinds and trainer.global_step == 10
    # the skipped step still advanced the rollout (data position), only its update was dropped
    assert module.rollout_state_dict()["rollout_step"] == 10
    assert all(torch.isfinite(p).all() for p in module.parameters())


@pytest.mark.slow
def test_deepep_real_overflow_detected_diagnosed_and_recovered(tmp_path):
    health = NumericalHealthCallback(check_every_n_steps=1, spike_detection=False)
    rollback = NaNRollbackCallback(snapshot_every_n_steps=5, policy="lower_lr", lr_factor=0.1, max_retries=3)

    def make():
        return DeepEPModule(
            **grouped(
                num_envs=4,
                rollout_length=8,
                hidden_size=16,
                steps_per_epoch=50,
                learning_rate=10.0,
                optimizer="sgd",
                fused_value_head=False,
            )
        )

    trainer, module = fit(tmp_path, [health, rollback], max_steps=20, module=make)
    kinds = [(e["kind"], e["step"]) for e in health.events.events]
    bad = kinds[0][1]
    assert kinds[0][0] == "detected" and kinds[2] == ("reproducible", bad) and kinds[1][1] < bad
    diagnosis = next(e for e in health.events.events if e["kind"] == "diagnosis")
    # the critic's squared error overflows float32: the locator names the op and the source line
    assert diagnosis["phase"] == "forward" and "value_loss" in diagnosis["report"] and "loss.py" in diagnosis["report"]
    assert ("recovered", bad) in kinds and trainer.global_step == 20 and not rollback.stopped
    assert all(torch.isfinite(p).all() for p in module.parameters())
    assert trainer.optimizers[0].param_groups[0]["lr"] <= 1.0 + 1e-9  # lowered at least once


@pytest.mark.slow
def test_nan_demo_comment_names_the_op_its_diagnosis_reports(tmp_path, run_process):
    """configs/nan_demo.yaml, run as train.py would (its callbacks and model), names the op of its comment."""
    import json
    import os
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    config = repo / "configs" / "nan_demo.yaml"
    result = run_process(
        [
            sys.executable,
            str(repo / "train.py"),
            "fit",
            "--config",
            str(config),
            "--trainer.logger.init_args.save_dir",
            str(tmp_path),
        ],
        cwd=tmp_path,
        env=dict(os.environ),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    events_file = next(tmp_path.glob("nan_demo/version_*/health_events.jsonl"))
    events = [json.loads(line) for line in events_file.read_text().splitlines()]
    diagnosis = next(e for e in events if e["kind"] == "diagnosis")
    assert diagnosis["op"] in config.read_text() and f"at step {diagnosis['step']}" in config.read_text()
    assert events[-1]["kind"] == "recovered"
    # the terminal says it: each event as it happens, then the one-line summary of the run
    terminal = result.stdout + result.stderr
    assert f"deepep_lightning health: step {diagnosis['step']}: recovered" in terminal
    # the divergence is chaotic: whether the lowered rate diverges again later depends on the last bits of the CPU
    # kernels (torch's version), so the line is checked against the run's own events: every incident recovers
    kinds = [e["kind"] for e in events]
    assert kinds.count("detected") >= 1 and kinds.count("stopped") == 0
    assert kinds.count("recovered") + kinds.count("transient") == kinds.count("detected")
    counts = (kinds.count(kind) for kind in ("detected", "rollback", "transient", "recovered", "stopped"))
    assert "health: {} detected, {} rolled back, {} transient, {} recovered, {} stopped".format(*counts) in terminal
    assert f"tensorboard --logdir {events_file.parent}" in terminal and "train/episode_return_100=" in terminal
    assert "return_100=" in result.stderr  # the progress bar (tqdm writes to stderr)
