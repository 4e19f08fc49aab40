"""NaNRollbackCallback: transient faults leave no trace; persistent ones get the policy, a retry cap, a clean stop."""

import json
import os
from pathlib import Path

import pytest
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException

from deepep_lightning.health import FaultInjectionCallback, NaNRollbackCallback, NumericalHealthCallback

from .conftest import fit, state_equal

MAX_STEPS = 20  # crosses the epoch boundary at step 16 (64 samples / batch 4)


@pytest.fixture(scope="module")
def clean_state(tmp_path_factory):
    path = tmp_path_factory.mktemp("clean")
    health = NumericalHealthCallback(check_every_n_steps=1)
    trainer, module = fit(path, [health, NaNRollbackCallback(snapshot_every_n_steps=4)], max_steps=MAX_STEPS)
    assert health.events.events == []  # no incident in the clean run
    return {k: v.clone() for k, v in module.state_dict().items()}, trainer.optimizers[0].state_dict()


def _kinds(health):
    return [(e["kind"], e["step"]) for e in health.events.events]


@pytest.mark.parametrize("check_every", [1, 3])
@pytest.mark.parametrize("target", ["loss", "gradient", "parameter", "batch"])
def test_transient_fault_leaves_weights_bitwise_equal(tmp_path, clean_state, target, check_every):
    health = NumericalHealthCallback(check_every_n_steps=check_every)
    rollback = NaNRollbackCallback(snapshot_every_n_steps=4)
    trainer, module = fit(tmp_path, [FaultInjectionCallback(target, steps=[6]), health, rollback], max_steps=MAX_STEPS)
    kinds = _kinds(health)
    assert kinds[0] == ("detected", 6) and ("transient", 6) in kinds
    assert trainer.global_step == MAX_STEPS
    assert state_equal(module.state_dict(), clean_state[0])
    # optimizer state too (Adam moments and step counters)
    opt = trainer.optimizers[0].state_dict()["state"]
    assert all(torch.equal(opt[i][k], clean_state[1]["state"][i][k]) for i in opt for k in opt[i])


def test_without_rollback_the_fault_changes_the_weights(tmp_path, clean_state):
    """Negative control for the bitwise test: the injected fault really corrupts training."""
    health = NumericalHealthCallback(check_every_n_steps=1, on_nonfinite="warn")
    with pytest.warns(UserWarning):
        _, module = fit(tmp_path, [FaultInjectionCallback("gradient", steps=[6]), health], max_steps=MAX_STEPS)
    assert not state_equal(module.state_dict(), clean_state[0])


def test_callback_order_does_not_matter(tmp_path, clean_state):
    health = NumericalHealthCallback(check_every_n_steps=2)
    callbacks = [NaNRollbackCallback(snapshot_every_n_steps=4), FaultInjectionCallback("loss", steps=[9]), health]
    _, module = fit(tmp_path, callbacks, max_steps=MAX_STEPS)
    assert ("transient", 9) in _kinds(health)
    assert state_equal(module.state_dict(), clean_state[0])


def test_persistent_fault_skip_policy_recovers(tmp_path):
    health = NumericalHealthCallback(check_every_n_steps=2)
    rollback = NaNRollbackCallback(snapshot_every_n_steps=4, policy="skip", skip_batches=2)
    with pytest.warns(UserWarning, match="NaNRollbackCallback diagnosis at step 7"):
        trainer, module = fit(
            tmp_path, [FaultInjectionCallback("loss", steps=[7], mode="always"), health, rollback], max_steps=MAX_STEPS
        )
    kinds = [k for k, _ in _kinds(health)]
    assert kinds == ["detected", "rollback", "reproducible", "diagnosis", "policy", "rollback", "recovered"]
    assert rollback.state_dict()["skip_steps"] == [7, 8]
    assert trainer.global_step == MAX_STEPS and not rollback.stopped
    assert all(torch.isfinite(p).all() for p in module.parameters())
    diagnosis = next(e for e in health.events.events if e["kind"] == "diagnosis")
    assert diagnosis["op"] == "aten.mul.Tensor" and "fault_injection.py" in diagnosis["report"]


def test_lower_lr_policy_respects_retry_cap_and_stops_at_snapshot(tmp_path):
    health = NumericalHealthCallback(check_every_n_steps=1)
    rollback = NaNRollbackCallback(snapshot_every_n_steps=4, policy="lower_lr", lr_factor=0.5, max_retries=2)
    with pytest.warns(UserWarning, match="NaNRollbackCallback stopped training"):
        trainer, module = fit(
            tmp_path,
            [FaultInjectionCallback("gradient", steps=[9], mode="always"), health, rollback],
            max_steps=MAX_STEPS,
        )
    kinds = [k for k, _ in _kinds(health)]
    assert kinds.count("policy") == 2 and kinds.count("rollback") == 3 and kinds[-1] == "stopped"
    # each retry restarts one snapshot further back (strictly before the bad step)
    assert [s for k, s in _kinds(health) if k == "rollback"] == [8, 8, 4]
    assert rollback.stopped and trainer.global_step == 10  # stopped cleanly after the failing step
    report = rollback.stop_report
    assert report["weights_at_step"] == 8 and report["lr_scale"] == 0.25 and report["attempts"] == 2
    assert all(torch.isfinite(p).all() for p in module.parameters())
    # the weights are those of the snapshot: equal to a clean run stopped at step 8
    _, reference = fit(tmp_path / "ref", [], max_steps=8)
    assert state_equal(module.state_dict(), reference.state_dict())


def test_stop_policy_writes_json_report_in_log_dir(tmp_path):
    from lightning.pytorch.loggers import TensorBoardLogger

    logger = TensorBoardLogger(str(tmp_path), name="run")
    health = NumericalHealthCallback(check_every_n_steps=1)
    rollback = NaNRollbackCallback(snapshot_every_n_steps=4, policy="stop")
    with pytest.warns(UserWarning, match="NaNRollbackCallback stopped training"):
        fit(
            tmp_path,
            [FaultInjectionCallback("parameter", steps=[5], mode="always"), health, rollback],
            max_steps=MAX_STEPS,
            logger=logger,
        )
    path = os.path.join(logger.log_dir, "health_events.jsonl")
    events = [json.loads(line) for line in Path(path).read_text().splitlines()]
    assert [e["kind"] for e in events][-1] == "stopped"
    diagnosis = next(e for e in events if e["kind"] == "diagnosis")
    # the parameter is poisoned inside the step, so the locator names the planting write and its frame
    assert "fault_injection.py" in diagnosis["report"] and diagnosis["phase"] == "forward"
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(logger.log_dir))


def test_disk_snapshots_with_corrupt_latest_fall_back(tmp_path, clean_state):
    health = NumericalHealthCallback(check_every_n_steps=1)
    rollback = NaNRollbackCallback(snapshot_every_n_steps=4, keep_snapshots=3, snapshot_dir=str(tmp_path / "snaps"))

    class Corrupter(FaultInjectionCallback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 10:  # the newest snapshot (step 8) gets truncated on disk
                path = rollback.ring.files()[-1]
                data = Path(path).read_bytes()
                Path(path).write_bytes(data[: len(data) // 2])

    with pytest.warns(UserWarning, match="truncated.*falling back to the previous snapshot"):
        _, module = fit(tmp_path, [Corrupter("loss", steps=[10]), health, rollback], max_steps=MAX_STEPS)
    kinds = _kinds(health)
    assert ("corrupt_snapshot", 11) in kinds or any(k == "corrupt_snapshot" for k, _ in kinds)
    assert ("rollback", 4) in kinds and ("transient", 10) in kinds  # the previous snapshot was used
    assert state_equal(module.state_dict(), clean_state[0])


def test_a_snapshot_the_full_disk_refuses_falls_back_to_the_previous_one(tmp_path, clean_state, monkeypatch):
    import errno

    from deepep_lightning.checkpointing import atomic_file

    write_all = atomic_file._write_all

    def full_at_step_8(handle, data):  # the step-8 snapshot fails half-way, as on a full disk
        if "step000000008" in handle.name:
            write_all(handle, data[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")
        write_all(handle, data)

    monkeypatch.setattr(atomic_file, "_write_all", full_at_step_8)
    health = NumericalHealthCallback(check_every_n_steps=1)
    rollback = NaNRollbackCallback(snapshot_every_n_steps=4, keep_snapshots=3, snapshot_dir=str(tmp_path / "snaps"))
    with pytest.warns(UserWarning, match=r"step000000008.*ENOSPC.*needs \d+ bytes.*keeps the snapshot of step 4"):
        _, module = fit(tmp_path, [FaultInjectionCallback("loss", steps=[10]), health, rollback], max_steps=MAX_STEPS)
    kinds = _kinds(health)
    assert ("rollback", 4) in kinds and ("transient", 10) in kinds  # the step-4 snapshot was used
    assert state_equal(module.state_dict(), clean_state[0])
    names = os.listdir(rollback.ring.directory)
    assert not [n for n in names if "step000000008" in n or ".tmp." in n], names  # no partial file


def test_setup_says_where_snapshots_go_and_how_many_bytes_they_may_use(tmp_path, monkeypatch):
    import re
    import shutil

    from deepep_lightning.health import rollback as rollback_module

    said: list[str] = []
    monkeypatch.setattr(rollback_module, "rank_zero_info", said.append)
    explicit = NaNRollbackCallback(snapshot_dir=str(tmp_path / "a"), snapshot_max_bytes=10**6)
    default = NaNRollbackCallback(snapshot_dir=str(tmp_path / "b"))
    for rollback in (explicit, default):
        fit(tmp_path, [NumericalHealthCallback(), rollback], max_steps=1)
    lines = [line for line in said if "NaNRollbackCallback: snapshots in" in line]
    assert len(lines) == 2, lines
    assert repr(str(tmp_path / "a" / "rank0")) in lines[0] and "at most 2 and 1000000 bytes" in lines[0]
    default_bytes = int(re.search(r"and (\d+) bytes", lines[1]).group(1))
    assert default_bytes == default.ring.max_bytes <= shutil.disk_usage(tmp_path).free  # half the free space


def test_needs_health_callback(tmp_path):
    with pytest.raises(MisconfigurationException, match="NumericalHealthCallback"):
        fit(tmp_path, [NaNRollbackCallback()], max_steps=2)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"snapshot_every_n_steps": 0}, "snapshot_every_n_steps"),
        ({"keep_snapshots": 0}, "keep_snapshots"),
        ({"policy": "pray"}, "policy"),
        ({"skip_batches": 0}, "skip_batches"),
        ({"lr_factor": 1.5}, "lr_factor"),
        ({"lr_factor": 0}, "lr_factor"),
        ({"max_retries": -1}, "max_retries"),
        ({"snapshot_dir": 3}, "snapshot_dir"),
        ({"locate": "false"}, "locate"),
        ({"rollback_on_spike": 1}, "rollback_on_spike"),
        ({"keep_snapshots": 10**6}, "keep_snapshots"),
        ({"max_skipped_steps": 0}, "max_skipped_steps"),
        ({"lr_factor": float("nan")}, "lr_factor"),
        ({"snapshot_max_bytes": 0}, "snapshot_max_bytes"),
    ],
)
def test_bad_arguments_name_argument_and_value(kwargs, name):
    with pytest.raises(MisconfigurationException, match=name) as info:
        NaNRollbackCallback(**kwargs)
    assert repr(next(iter(kwargs.values()))) in str(info.value)


def test_diagnosed_step_is_reseeded_like_a_replayed_one(tmp_path):
    """on_replay_batch_start runs before every re-run step: the replays and the step run under the locator."""
    import lightning.pytorch as pl

    class Seen(pl.Callback):
        def __init__(self):
            self.steps = []

        def on_replay_batch_start(self, trainer, pl_module, batch, batch_idx, epoch):
            self.steps.append(trainer.global_step)

    seen = Seen()
    rollback = NaNRollbackCallback(snapshot_every_n_steps=4, policy="stop")
    with pytest.warns(UserWarning, match="NaNRollbackCallback diagnosis at step 6"):
        fit(
            tmp_path,
            [
                FaultInjectionCallback("loss", steps=[6], mode="always"),
                NumericalHealthCallback(check_every_n_steps=1),
                rollback,
                seen,
            ],
            max_steps=10,
        )
    assert seen.steps == [4, 5, 6] + [4, 5, 6]  # the replay that fails again, then the diagnosis up to and at step 6


def _cursor_fit(tmp_path, module_class, fault: bool):
    callbacks = [NumericalHealthCallback(check_every_n_steps=1), NaNRollbackCallback(snapshot_every_n_steps=4)]
    if fault:
        callbacks.insert(0, FaultInjectionCallback("loss", steps=[6]))
    _, module = fit(tmp_path, callbacks, max_steps=10, module=module_class)
    return module


def test_rollback_restores_the_rollout_state_of_any_rollout_stateful_module(tmp_path):
    from deepep_lightning.protocols import RolloutStateful

    from .conftest import CursorModule, CursorModuleWithoutProtocol

    assert isinstance(CursorModule(), RolloutStateful) and not isinstance(
        CursorModuleWithoutProtocol(), RolloutStateful
    )
    clean = _cursor_fit(tmp_path / "clean", CursorModule, fault=False)
    faulty = _cursor_fit(tmp_path / "faulty", CursorModule, fault=True)
    assert int(faulty.cursor) == int(clean.cursor) == 10  # the replayed steps left the cursor where a clean run does
    assert state_equal(faulty.state_dict(), clean.state_dict())
    # negative control: without the protocol the replay starts from the advanced cursor, and it shows
    clean = _cursor_fit(tmp_path / "clean_plain", CursorModuleWithoutProtocol, fault=False)
    faulty = _cursor_fit(tmp_path / "faulty_plain", CursorModuleWithoutProtocol, fault=True)
    assert int(faulty.cursor) > int(clean.cursor)
    assert not state_equal(faulty.state_dict(), clean.state_dict())


def test_state_key_and_checkpoint_round_trip(tmp_path):
    from .conftest import checkpoint_round_trip

    health = NumericalHealthCallback(check_every_n_steps=1)
    rollback = NaNRollbackCallback(snapshot_every_n_steps=4, policy="skip", skip_batches=2)
    with pytest.warns(UserWarning, match="NaNRollbackCallback diagnosis at step 7"):
        trainer, _ = fit(
            tmp_path, [FaultInjectionCallback("loss", steps=[7], mode="always"), health, rollback], max_steps=12
        )
    twin = NaNRollbackCallback(snapshot_every_n_steps=4, policy="skip", skip_batches=2)
    saved = checkpoint_round_trip(tmp_path, trainer, rollback, twin)
    assert saved["skip_steps"] == [7, 8] and saved["incidents"][0]["reason"] == "nonfinite_loss"
    assert type(saved["incidents"][0]["reason"]) is str  # enums are stored as plain strings
    assert twin.incidents == rollback.incidents and twin.state_dict()["skip_steps"] == [7, 8]
    # identifying arguments are in the key, so two differently configured instances may coexist
    assert NaNRollbackCallback(snapshot_every_n_steps=4, policy="stop").state_key != rollback.state_key


def test_skip_policy_keeps_the_step_output_and_lightning_warns_nothing(tmp_path, recwarn):
    """A skipped step returns its loss (Lightning refuses None under DDP and warns about it alone)."""
    from lightning.pytorch.loops.optimization.automatic import Closure

    Closure.warning_cache.clear()  # Lightning warns once per process: an earlier test must not hide it
    health = NumericalHealthCallback(check_every_n_steps=2)
    rollback = NaNRollbackCallback(snapshot_every_n_steps=4, policy="skip", skip_batches=2)
    trainer, module = fit(
        tmp_path, [FaultInjectionCallback("loss", steps=[7], mode="always"), health, rollback], max_steps=MAX_STEPS
    )
    messages = [str(w.message) for w in recwarn]
    assert any("NaNRollbackCallback diagnosis at step 7" in m for m in messages)  # warnings are recorded
    assert not any("returned `None`" in m for m in messages)
    assert [k for k, _ in _kinds(health)][-1] == "recovered" and rollback.state_dict()["skip_steps"] == [7, 8]
    assert trainer.global_step == MAX_STEPS and all(torch.isfinite(p).all() for p in module.parameters())


def test_skipped_steps_leave_weights_and_optimizer_state_as_before_them(tmp_path):
    """The skip drops the update of exactly its steps: weights and Adam state are those before step 7."""
    seen = {}

    class Probe(FaultInjectionCallback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen[trainer.global_step] = {k: v.clone() for k, v in pl_module.state_dict().items()}

    health = NumericalHealthCallback(check_every_n_steps=1)
    rollback = NaNRollbackCallback(snapshot_every_n_steps=4, policy="skip", skip_batches=2, locate=False)
    fit(tmp_path, [Probe("loss", steps=[7], mode="always"), health, rollback], max_steps=10)
    assert state_equal(seen[9], seen[7])  # after the skipped steps 7 and 8: unchanged since step 6's update
    assert not state_equal(seen[10], seen[9])  # negative control: step 9 updates again


def test_skip_policy_stops_at_max_skipped_steps(tmp_path):
    """A NaN on every step must not skip all of training: past the cap the run stops, weights finite."""
    health = NumericalHealthCallback(check_every_n_steps=1)
    rollback = NaNRollbackCallback(snapshot_every_n_steps=4, policy="skip", max_skipped_steps=3, locate=False)
    fault = FaultInjectionCallback("loss", steps=list(range(5, MAX_STEPS)), mode="always")
    with pytest.warns(UserWarning, match="max_skipped_steps=3"):
        trainer, module = fit(tmp_path, [fault, health, rollback], max_steps=MAX_STEPS)
    assert rollback.stopped and rollback.state_dict()["skip_steps"] == [5, 6, 7]
    assert "max_skipped_steps=3" in rollback.stop_report["why"] and trainer.global_step < MAX_STEPS
    assert all(torch.isfinite(p).all() for p in module.parameters())


def _stopping_trainer(tmp_path, callbacks, max_steps):
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    checkpoint = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_last=True, save_top_k=0)
    return pl.Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        logger=False,
        callbacks=[*callbacks, checkpoint],
        default_root_dir=str(tmp_path),
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
    )


def test_last_checkpoint_after_a_stop_holds_the_snapshot_and_a_resume_trains_on(tmp_path):
    """A stopped state must not come back from the checkpoint: the resume would skip every step, silently."""
    import lightning.pytorch as pl

    from .conftest import ToyModule

    def callbacks(fault):
        faults = [FaultInjectionCallback("loss", steps=[5], mode="always")] if fault else []
        return [*faults, NumericalHealthCallback(check_every_n_steps=1), NaNRollbackCallback(4, policy="stop")]

    pl.seed_everything(0, verbose=False)
    first = _stopping_trainer(tmp_path, callbacks(True), MAX_STEPS)
    with pytest.warns(UserWarning, match="stopped training"):
        first.fit(ToyModule())
    last = tmp_path / "ckpt" / "last.ckpt"
    checkpoint = torch.load(last, map_location="cpu", weights_only=True)
    rollback = next(cb for cb in first.callbacks if isinstance(cb, NaNRollbackCallback))
    saved = checkpoint["callbacks"][rollback.state_key]
    assert saved["stopped"] and saved["stop_report"]["weights_at_step"] == 4
    assert saved["stop_report"]["stopped_at_step"] == checkpoint["global_step"] == 6
    _, reference = fit(tmp_path / "ref", [], max_steps=4)
    assert state_equal(checkpoint["state_dict"], reference.state_dict())  # what the report says: step 4's weights

    second = _stopping_trainer(tmp_path / "resume", callbacks(False), MAX_STEPS)
    module = ToyModule()
    with pytest.warns(UserWarning, match="written after a rollback stop at step 6.*weights are those of step 4"):
        second.fit(module, ckpt_path=str(last))
    assert second.global_step == MAX_STEPS
    assert not state_equal(module.state_dict(), checkpoint["state_dict"])  # it trained


def _corrupt_every_snapshot(rollback):
    class CorruptAll(FaultInjectionCallback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 6:
                for path in rollback.ring.files():
                    Path(path).write_bytes(b"garbage")

        def _poison_loss(self, step, output):  # an infinite loss value with finite gradients
            return output + output.detach() * float("inf") if self._fire(step) else output

    return CorruptAll


def test_stop_without_a_usable_snapshot_keeps_finite_current_weights(tmp_path):
    health = NumericalHealthCallback(check_every_n_steps=1)
    rollback = NaNRollbackCallback(4, keep_snapshots=1, policy="stop", snapshot_dir=str(tmp_path / "s"))
    corrupt = _corrupt_every_snapshot(rollback)("loss", steps=[6], mode="always")  # the loss value: weights finite
    with pytest.warns(UserWarning) as caught:
        _, module = fit(tmp_path, [corrupt, health, rollback], max_steps=MAX_STEPS)
    stopped = [str(w.message) for w in caught if "stopped training" in str(w.message)]
    assert stopped and "current (finite) ones of step 7" in stopped[0] and "step None" not in stopped[0]
    assert rollback.stopped and rollback.stop_report["weights_at_step"] == 7
    assert all(torch.isfinite(p).all() for p in module.parameters())


def test_stop_without_a_usable_snapshot_and_non_finite_weights_raises(tmp_path):
    health = NumericalHealthCallback(check_every_n_steps=1)
    rollback = NaNRollbackCallback(4, keep_snapshots=1, policy="stop", snapshot_dir=str(tmp_path / "s"))
    corrupt = _corrupt_every_snapshot(rollback)("parameter", steps=[6], mode="always")
    with pytest.warns(UserWarning, match="falling back"), pytest.raises(RuntimeError, match="cannot stop with finite"):
        fit(tmp_path, [corrupt, health, rollback], max_steps=MAX_STEPS)


class BlowUpAdam(torch.optim.Adam):
    """Adam whose update turns the output layer's weight infinite while ``armed`` (loss and gradients stay finite)."""

    armed = False

    def step(self, closure=None):
        loss = super().step(closure)
        if self.armed:
            with torch.no_grad():
                self.param_groups[0]["params"][2].mul_(float("inf"))
        return loss


def _blow_up_module(step):
    from .conftest import ToyModule

    class BlowUpModule(ToyModule):
        def training_step(self, batch, batch_idx):
            self.trainer.optimizers[0].armed = self.trainer.global_step == step  # in replays and the diagnosis too
            return super().training_step(batch, batch_idx)

        def configure_optimizers(self):
            return BlowUpAdam(self.parameters(), lr=self.lr)

    return BlowUpModule()


@pytest.mark.parametrize("check_every", [1, 4])
def test_persistent_parameter_inf_from_the_update_is_reproducible_and_named(tmp_path, check_every):
    """With a window of 4 steps the check reports a later step than the update: still reproducible, and the
    diagnosis names the optimizer and the parameter (forward and backward of the step are finite)."""
    health = NumericalHealthCallback(check_every_n_steps=check_every)
    rollback = NaNRollbackCallback(snapshot_every_n_steps=4, policy="stop")
    with pytest.warns(UserWarning, match="NaNRollbackCallback diagnosis at step 5"):
        _, module = fit(tmp_path, [health, rollback], max_steps=MAX_STEPS, module=_blow_up_module(5))
    detected = next(e for e in health.events.events if e["kind"] == "detected")
    assert detected["step"] == (5 if check_every == 1 else 6)  # the window's check sees the symptom one step later
    assert rollback.incidents[0].classification == "reproducible"
    diagnosis = next(e for e in health.events.events if e["kind"] == "diagnosis")
    assert diagnosis["phase"] == "optimizer" and diagnosis["optimizer"] == "BlowUpAdam (optimizer 0)"
    assert diagnosis["parameter"] == "inner.3.weight" and "parameter: inner.3.weight" in diagnosis["report"]
    assert rollback.stop_report["weights_at_step"] == 4 and all(torch.isfinite(p).all() for p in module.parameters())


def test_unwritable_snapshot_dir_is_named(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(
        MisconfigurationException, match="`snapshot_dir` must be a path in a writable directory"
    ) as info:
        NaNRollbackCallback(snapshot_dir=str(blocker / "snaps"))  # absolute: checked at construction
    assert "a_file" in str(info.value)
    rollback = NaNRollbackCallback(snapshot_dir="snaps")  # relative: inside the log directory, checked at setup
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "snaps").write_text("x")  # the log directory is writable, the snapshot directory is not
    with pytest.raises(MisconfigurationException, match="snapshot_dir='snaps'.*must be a writable directory"):
        fit(tmp_path / "run", [NumericalHealthCallback(), rollback], max_steps=2)
