"""NumericalHealthCallback: every fault type found on its step, no host reads between checks, norms logged."""

import warnings

import pytest
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException

from deepep_lightning.health import FaultInjectionCallback, NonFiniteError, NumericalHealthCallback
from deepep_lightning.health import flags as flags_module

from .conftest import CaptureLogger, ToyModule, fit

TARGETS = ["loss", "gradient", "parameter", "batch"]


@pytest.mark.parametrize("value", ["nan", "inf"])
@pytest.mark.parametrize("target", TARGETS)
def test_each_fault_detected_on_its_step(tmp_path, target, value):
    health = NumericalHealthCallback(check_every_n_steps=1)
    with pytest.raises(NonFiniteError, match="at step 5"):
        fit(tmp_path, [FaultInjectionCallback(target, steps=[5], value=value), health], max_steps=10)
    assert health.last_verdict.bad_step == 5 and health.last_verdict.end_step == 6


@pytest.mark.parametrize("target", TARGETS)
def test_fault_detected_within_interval(tmp_path, target):
    health = NumericalHealthCallback(check_every_n_steps=4)
    with pytest.raises(NonFiniteError):
        fit(tmp_path, [FaultInjectionCallback(target, steps=[5]), health], max_steps=12)
    verdict = health.last_verdict
    assert verdict.bad_step == 5  # the slot per step names the step, not only the interval
    assert verdict.first_step <= 5 < verdict.end_step <= 5 + 4


def test_clean_run_passes_every_check(tmp_path):
    health = NumericalHealthCallback(check_every_n_steps=2)
    fit(tmp_path, [health], max_steps=10)
    assert health.last_verdict.healthy and health.last_verdict.end_step == 10


def test_no_host_read_between_checks(tmp_path, monkeypatch):
    reads = []
    original = flags_module._read_to_host

    def counting(packed):
        reads.append(trainer_ref[0].global_step)
        return original(packed)

    trainer_ref = []

    class Spy(NumericalHealthCallback):
        def setup(self, trainer, pl_module, stage):
            trainer_ref.append(trainer)
            super().setup(trainer, pl_module, stage)

    monkeypatch.setattr(flags_module, "_read_to_host", counting)
    fit(tmp_path, [Spy(check_every_n_steps=5, spike_detection=False)], max_steps=15)
    assert reads == [5, 10, 15]
    # negative control: per-step checking does read every step, so the counter can see reads
    reads.clear()
    trainer_ref.clear()
    fit(tmp_path, [Spy(check_every_n_steps=1, spike_detection=False)], max_steps=6)
    assert reads == [1, 2, 3, 4, 5, 6]


def test_scalars_logged_at_checks_only_on_the_training_step(tmp_path):
    """At each check: param norm, events since the last check (0: healthy), incidents; at train/loss's step."""
    logger = CaptureLogger(str(tmp_path))
    trainer, _ = fit(
        tmp_path, [NumericalHealthCallback(check_every_n_steps=3)], max_steps=9, logger=logger, log_every_n_steps=1
    )
    written = {step: m for step, m in logger.metrics if "health/param_norm" in m}
    loss_steps = {step for step, m in logger.metrics if "train/loss" in m}
    # once per check (Lightning writes every step here, and would repeat a value logged at a check)
    assert sorted(written) == [2, 5, 8] and loss_steps == set(range(9))  # Lightning's step index of the check
    assert all(m["health/param_norm"] > 0 and m["health/events"] == 0 for m in written.values())
    assert all(m["health/incidents"] == 0 for m in written.values())
    # one gradient norm per run: the training step's to log, not repeated under health/
    assert not any(key.startswith("health/grad_norm") for _, m in logger.metrics for key in m)
    # host values for callbacks (EarlyStopping) and the progress bar, which read them without a device
    assert trainer.callback_metrics["health/incidents"].device.type == "cpu"
    assert trainer.progress_bar_metrics["health/incidents"] == 0


def test_event_count_at_the_check_of_an_incident_then_zero(tmp_path):
    """A NaN rolled back at step 5: health/events counts its events at that check, 0 at the next; incidents stays 1."""
    from deepep_lightning.health import NaNRollbackCallback

    logger = CaptureLogger(str(tmp_path))
    health = NumericalHealthCallback(check_every_n_steps=1, spike_detection=False)
    callbacks = [FaultInjectionCallback("loss", steps=[5]), health, NaNRollbackCallback(snapshot_every_n_steps=2)]
    fit(tmp_path, callbacks, max_steps=8, logger=logger, log_every_n_steps=1)
    events = {step: m["health/events"] for step, m in logger.metrics if "health/events" in m}
    incidents = {step: m["health/incidents"] for step, m in logger.metrics if "health/incidents" in m}
    assert events[5] == len(health.events.events) >= 3  # detected, rollback, transient
    assert all(events[step] == 0 for step in events if step != 5)
    assert [incidents[step] for step in sorted(incidents)] == [0] * 5 + [1] * 3


def test_early_stopping_monitors_a_health_scalar(tmp_path):
    """EarlyStopping(monitor="health/incidents") stops after an incident; a clean run goes on (negative control)."""
    from lightning.pytorch.callbacks import EarlyStopping

    from deepep_lightning.health import NaNRollbackCallback

    def run(directory, faults):
        stopper = EarlyStopping(monitor="health/incidents", mode="min", divergence_threshold=0.5, patience=100)
        callbacks = [
            FaultInjectionCallback("loss", steps=faults),
            NumericalHealthCallback(check_every_n_steps=2, spike_detection=False),
            NaNRollbackCallback(snapshot_every_n_steps=2),
            stopper,
        ]
        trainer, _ = fit(directory, callbacks, max_steps=40)  # 16 batches per epoch
        return trainer

    assert run(tmp_path / "fault", [5]).global_step == 16  # stopped at the end of the incident's epoch
    assert run(tmp_path / "clean", []).global_step == 40


def test_warn_mode_continues_and_weights_go_nonfinite(tmp_path):
    health = NumericalHealthCallback(check_every_n_steps=1, on_nonfinite="warn")
    with pytest.warns(UserWarning, match="nonfinite_loss at step 3"):
        _, module = fit(tmp_path, [FaultInjectionCallback("loss", steps=[3]), health], max_steps=6)
    assert not all(torch.isfinite(p).all() for p in module.parameters())  # why rollback exists
    assert [e["kind"] for e in health.events.events][:1] == ["detected"]


class SpikyModule(ToyModule):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * 1e4 if self.trainer.global_step >= 20 else loss


def test_loss_spike_detected_at_its_start(tmp_path):
    health = NumericalHealthCallback(
        check_every_n_steps=5,
        spike_window=10,
        spike_warmup=10,
        spike_persistence=2,
        spike_z_threshold=6.0,
        on_spike="raise",
    )
    with pytest.raises(NonFiniteError, match="loss_spike at step 20"):
        fit(tmp_path, [health], max_steps=30, module=SpikyModule)
    # negative control: the same run without the spike passes
    health = NumericalHealthCallback(
        check_every_n_steps=5,
        spike_window=10,
        spike_warmup=10,
        spike_persistence=2,
        spike_z_threshold=6.0,
        on_spike="raise",
    )
    fit(tmp_path, [health], max_steps=30)
    assert health.last_verdict.healthy


def test_epoch_end_parameter_threshold(tmp_path):
    module = ToyModule(n_samples=16)
    with pytest.raises(NonFiniteError, match="max \\|w\\|"):
        fit(tmp_path, [NumericalHealthCallback(param_max_abs=1e-3, on_large_param="raise")], max_steps=4, module=module)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        fit(
            tmp_path,
            [NumericalHealthCallback(param_max_abs=1e3, on_large_param="raise")],
            max_steps=4,
            module=ToyModule(n_samples=16),
        )


def test_state_dict_round_trip(tmp_path):
    health = NumericalHealthCallback(check_every_n_steps=2, spike_warmup=2, spike_window=4)
    fit(tmp_path, [health], max_steps=8)
    other = NumericalHealthCallback(check_every_n_steps=2, spike_warmup=2, spike_window=4)
    other.load_state_dict(health.state_dict())
    assert other.state_dict() == health.state_dict() and other.state_dict()["spike"]["history"]


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"check_every_n_steps": 0}, "check_every_n_steps"),
        ({"check_every_n_steps": 2.0}, "check_every_n_steps"),
        ({"on_nonfinite": "ignore"}, "on_nonfinite"),
        ({"on_spike": None}, "on_spike"),
        ({"param_max_abs": -1.0}, "param_max_abs"),
        ({"on_large_param": "boom"}, "on_large_param"),
        ({"spike_window": 1}, "spike_window"),
        ({"check_every_n_steps": 10**6}, "check_every_n_steps"),  # would allocate a row per step at setup
        ({"check_loss": "false"}, "check_loss"),  # a truthy string must not pass as a switch
        ({"check_gradients": 0}, "check_gradients"),
        ({"log_norms": "yes"}, "log_norms"),
        ({"spike_detection": "false"}, "spike_detection"),
        ({"param_max_abs": float("inf")}, "param_max_abs"),
        ({"spike_z_threshold": float("inf")}, "spike_z_threshold"),
        ({"spike_window": 10**9}, "spike_window"),
        ({"events_filename": ""}, "events_filename"),
        ({"events_filename": "logs/events.jsonl"}, "events_filename"),
        ({"events_filename": 3}, "events_filename"),
    ],
)
def test_bad_arguments_name_argument_and_value(kwargs, name):
    with pytest.raises(MisconfigurationException, match=name) as info:
        NumericalHealthCallback(**kwargs)
    assert repr(next(iter(kwargs.values()))) in str(info.value)


def test_state_key_and_checkpoint_round_trip(tmp_path):
    from .conftest import checkpoint_round_trip

    health = NumericalHealthCallback(check_every_n_steps=2, spike_warmup=2, spike_window=4)
    trainer, _ = fit(tmp_path, [health], max_steps=8)
    saved = checkpoint_round_trip(tmp_path, trainer, health, NumericalHealthCallback(check_every_n_steps=2))
    assert saved["next_unchecked"] == 8 and saved["spike"]["history"]
    assert NumericalHealthCallback(check_every_n_steps=3).state_key != health.state_key


def test_rollback_contract_hands_failed_checks_over_and_back(tmp_path):
    class Handler:
        stopped = False

        def skips(self, step):
            return False

    health = NumericalHealthCallback(check_every_n_steps=1)
    health.attach_rollback(Handler())  # a handler that never polls: failed checks are not acted on here
    fit(tmp_path / "attached", [FaultInjectionCallback("loss", steps=[3]), health], max_steps=6)
    assert health.events.events == []
    health.detach_rollback()  # negative control: acting again
    with pytest.raises(NonFiniteError, match="at step 3"):
        fit(tmp_path / "detached", [FaultInjectionCallback("loss", steps=[3]), health], max_steps=6)
    health.resume_checks_at(20)
    assert health.state_dict()["next_unchecked"] == 20


def test_valid_edges_are_accepted():
    """Negative control for the bounds: the largest window and plain bools pass."""
    health = NumericalHealthCallback(check_every_n_steps=10_000, check_loss=False, events_filename="run.jsonl")
    assert health.check_every_n_steps == 10_000 and health.check_loss is False


def test_unwritable_log_directory_is_named_at_setup(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")  # a directory below a file cannot exist, even for root
    with pytest.raises(MisconfigurationException, match="events_filename='health_events.jsonl'.*not writable"):
        fit(blocker / "run", [NumericalHealthCallback()], max_steps=2)


def test_runs_sharing_a_log_dir_write_separate_event_logs(tmp_path):
    for _ in range(2):
        health = NumericalHealthCallback(check_every_n_steps=1, on_nonfinite="warn")
        with pytest.warns(UserWarning, match="at step"):
            fit(tmp_path, [FaultInjectionCallback("loss", steps=[3]), health], max_steps=5)
    first = (tmp_path / "health_events.jsonl").read_text().splitlines()
    second = (tmp_path / "health_events.1.jsonl").read_text().splitlines()
    assert len(first) == len(second) >= 1  # the same events each: none appended to the other run's log
