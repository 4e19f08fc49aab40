"""Snapshots: exact in-place restore (model, optimizer, scheduler, RNG); atomic checksummed files."""

import copy
import io
import os
from pathlib import Path

import pytest
import torch

from deepep_lightning.health import NumericalHealthCallback, snapshot_file
from deepep_lightning.health.snapshot import (
    CorruptSnapshotError,
    Snapshot,
    SnapshotRing,
    clone_update_state,
    load_snapshot_file,
    restore_update_state,
    save_snapshot_file,
)
from deepep_lightning.health.state_copies import restore_optimizer, to_host

from .conftest import fit


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    trainer, module = fit(tmp_path_factory.mktemp("snap"), [NumericalHealthCallback()], max_steps=5)
    return trainer, module


def _optimizer_tensors(trainer):
    state = trainer.optimizers[0].state_dict()["state"]
    return {(i, k): v.clone() for i in state for k, v in state[i].items() if isinstance(v, torch.Tensor)}


def _mutate(trainer, module):
    with torch.no_grad():
        for p in module.parameters():
            p.add_(1.0)
    for s in trainer.optimizers[0].state.values():
        for v in s.values():
            v.add_(3.0)
    trainer.lr_scheduler_configs[0].scheduler.step()
    torch.rand(10)


def test_restore_is_exact_and_in_place(trained):
    trainer, module = trained
    snapshot = Snapshot.capture(trainer, module, {"x": 1}, lr_scale=1.0)
    params = {n: p.detach().clone() for n, p in module.named_parameters()}
    opt = _optimizer_tensors(trainer)
    live_ids = {id(v) for s in trainer.optimizers[0].state.values() for v in s.values()}
    sched = trainer.lr_scheduler_configs[0].scheduler.state_dict()
    lr = trainer.optimizers[0].param_groups[0]["lr"]
    expected_rand = torch.rand(5)
    torch.set_rng_state(snapshot.rng["torch"])

    _mutate(trainer, module)
    assert not torch.equal(next(module.parameters()), next(iter(params.values())))  # negative control
    snapshot.restore(trainer, module)

    assert all(torch.equal(p, params[n]) for n, p in module.named_parameters())
    restored = _optimizer_tensors(trainer)
    assert restored.keys() == opt.keys() and all(torch.equal(restored[k], opt[k]) for k in opt)
    assert {id(v) for s in trainer.optimizers[0].state.values() for v in s.values()} == live_ids  # in place
    assert trainer.lr_scheduler_configs[0].scheduler.state_dict() == sched
    assert trainer.optimizers[0].param_groups[0]["lr"] == lr
    assert torch.equal(torch.rand(5), expected_rand)


def test_disk_round_trip(trained, tmp_path):
    trainer, module = trained
    snapshot = Snapshot.capture(trainer, module, {"spike": None}, lr_scale=0.5)
    path = str(tmp_path / "s.pt")
    save_snapshot_file(snapshot, path)
    loaded = load_snapshot_file(path)
    assert loaded.step == snapshot.step and loaded.lr_scale == 0.5
    payload = Path(path).read_bytes()[len(snapshot_file._MAGIC) + snapshot_file._HEADER.size :]
    torch.load(io.BytesIO(payload), weights_only=True)  # tensors and plain values only (RNG states too)
    _mutate(trainer, module)
    loaded.restore(trainer, module)
    assert all(torch.equal(p, snapshot.model[n]["__snapshot_tensor__"]) for n, p in module.state_dict().items())
    assert not [f for f in os.listdir(tmp_path) if ".tmp." in f]  # the temporary file was renamed away


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda b: b[: len(b) // 2], "truncated"),
        (lambda b: b[:-10] + bytes(10), "checksum"),
        (lambda b: b"garbage" + b, "bad header"),
        (lambda b: b[:5], "bad header"),
    ],
)
def test_corrupt_files_are_rejected_clearly(trained, tmp_path, damage, message):
    trainer, module = trained
    path = str(tmp_path / "s.pt")
    save_snapshot_file(Snapshot.capture(trainer, module, {}, 1.0), path)
    data = Path(path).read_bytes()
    Path(path).write_bytes(damage(data))
    with pytest.raises(CorruptSnapshotError, match=message):
        load_snapshot_file(path)


def test_ring_keeps_last_n_and_falls_back_past_corrupt(trained, tmp_path):
    trainer, module = trained
    ring = SnapshotRing(keep=2, directory=str(tmp_path))
    for index in range(3):
        snapshot = Snapshot.capture(trainer, module, {}, 1.0)
        snapshot.step = 10 * index
        ring.push(snapshot)
    assert ring.steps() == [10, 20] and len(os.listdir(tmp_path)) == 2
    newest = ring.files()[-1]
    Path(newest).write_bytes(Path(newest).read_bytes()[:100])
    seen = []
    assert ring.latest(lambda path, error: seen.append((path, str(error)))).step == 10
    assert seen and seen[0][0] == newest and "truncated" in seen[0][1]


def _push_steps(ring, trained, steps):
    trainer, module = trained
    kept = []
    for step in steps:
        snapshot = Snapshot.capture(trainer, module, {}, 1.0)
        snapshot.step = step
        kept.append(ring.push(snapshot))
    return kept


def _file_bytes(directory) -> int:
    return sum(path.stat().st_size for path in Path(directory).iterdir())


def test_disk_ring_is_bounded_in_bytes_and_keeps_the_newest(trained, tmp_path):
    one = SnapshotRing(keep=1, directory=str(tmp_path / "one"))
    _push_steps(one, trained, [0])
    size = _file_bytes(tmp_path / "one")
    ring = SnapshotRing(keep=10, directory=str(tmp_path / "bounded"), max_bytes=int(2.5 * size))
    for step in range(1, 6):
        assert _push_steps(ring, trained, [step]) == [True]
        assert _file_bytes(tmp_path / "bounded") <= 2.5 * size  # the bound holds after every write
    assert ring.steps() == [4, 5] and ring.latest().step == 5
    tiny = SnapshotRing(keep=10, directory=str(tmp_path / "tiny"), max_bytes=1)  # the newest is always kept
    _push_steps(tiny, trained, [1, 2])
    assert tiny.steps() == [2]
    # negative control: bounded by count only, the same pushes keep five files
    unbounded = SnapshotRing(keep=10, directory=str(tmp_path / "unbounded"))
    _push_steps(unbounded, trained, range(1, 6))
    assert len(unbounded.steps()) == 5 and _file_bytes(tmp_path / "unbounded") > 4 * size


def test_a_snapshot_that_cannot_be_written_keeps_the_previous_one(trained, tmp_path, monkeypatch):
    import errno

    from deepep_lightning.checkpointing import atomic_file

    write_all = atomic_file._write_all

    def full_disk(handle, data):
        if "step000000002" in handle.name:
            write_all(handle, data[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")
        write_all(handle, data)

    monkeypatch.setattr(atomic_file, "_write_all", full_disk)
    ring = SnapshotRing(keep=2, directory=str(tmp_path))
    assert _push_steps(ring, trained, [1]) == [True]
    with pytest.warns(UserWarning, match=r"snapshot '.*step000000002.pt'.*ENOSPC.*needs \d+ bytes.*free.*step 1"):
        assert _push_steps(ring, trained, [2]) == [False]
    assert ring.steps() == [1] and ring.latest().step == 1
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(ring.files()[0])]  # no partial, no temporary file
    # negative control: the write itself fails; only the ring turns it into a warning
    with pytest.raises(snapshot_file.SnapshotWriteError, match="step000000002"):
        save_snapshot_file(Snapshot.capture(*trained, {}, 1.0), str(tmp_path / "snapshot-step000000002.pt"))


def test_host_ring_drops_oldest(trained):
    trainer, module = trained
    ring = SnapshotRing(keep=2)
    for step in (1, 2, 3):
        snapshot = Snapshot.capture(trainer, module, {}, 1.0)
        snapshot.step = step
        ring.push(snapshot)
    assert ring.steps() == [2, 3] and ring.latest().step == 3


def _addresses(trainer, module):
    optimizer = trainer.optimizers[0]
    state = [v for p in module.parameters() for v in optimizer.state[p].values()]
    return [t.data_ptr() for t in [*module.parameters(), *state]]


def test_restore_copies_into_the_live_tensors(trained):
    """A captured CUDA graph points at these tensors: a restore must copy into them, never replace them."""
    trainer, module = trained
    snapshot = Snapshot.capture(trainer, module, {}, lr_scale=1.0)
    params = [p.detach().clone() for p in module.parameters()]
    before = _addresses(trainer, module)
    _mutate(trainer, module)
    snapshot.restore(trainer, module)
    assert _addresses(trainer, module) == before
    assert all(torch.equal(p, q) for p, q in zip(module.parameters(), params))
    # negative control: the optimizer's own load_state_dict replaces its state tensors, and the check sees it
    trainer.optimizers[0].load_state_dict(copy.deepcopy(trainer.optimizers[0].state_dict()))
    assert _addresses(trainer, module) != before


def test_restore_before_the_first_step_keeps_adam_state_in_place_and_exact():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    fresh = torch.nn.Linear(3, 2)
    fresh.load_state_dict(model.state_dict())
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    reference = torch.optim.Adam(fresh.parameters(), lr=0.1)
    empty = to_host(optimizer.state_dict(), [])  # before any step: no state

    def train(net, opt, steps):
        for step in range(steps):
            opt.zero_grad()
            net(torch.full((4, 3), float(step + 1))).square().sum().backward()
            opt.step()

    train(model, optimizer, 2)
    live = {id(v): v.data_ptr() for s in optimizer.state.values() for v in s.values()}
    restore_optimizer(optimizer, empty)
    assert {id(v): v.data_ptr() for s in optimizer.state.values() for v in s.values()} == live  # kept, in place
    assert all(not v.any() for s in optimizer.state.values() for v in s.values())  # step 0, zero moments
    with torch.no_grad():
        model.weight.copy_(fresh.weight)
        model.bias.copy_(fresh.bias)
    train(model, optimizer, 3)
    train(fresh, reference, 3)  # a fresh Adam creating its state lazily: the same bits
    assert torch.equal(model.weight, fresh.weight) and torch.equal(model.bias, fresh.bias)


def test_update_state_round_trip_is_in_place(trained):
    trainer, module = trained
    saved = clone_update_state(module, trainer.optimizers)
    params = [p.detach().clone() for p in module.parameters()]
    before = _addresses(trainer, module)
    _mutate(trainer, module)
    restore_update_state(module, trainer.optimizers, saved)
    assert _addresses(trainer, module) == before
    assert all(torch.equal(p, q) for p, q in zip(module.parameters(), params))


def test_corrupt_file_is_deleted_after_the_fallback(trained, tmp_path):
    trainer, module = trained
    ring = SnapshotRing(keep=2, directory=str(tmp_path), run_id="run-a")
    for step in (10, 20):
        snapshot = Snapshot.capture(trainer, module, {}, 1.0)
        snapshot.step = step
        ring.push(snapshot)
    newest = ring.files()[-1]
    assert "run-a" in os.path.basename(newest)  # the run id is in the name: runs sharing a directory never clash
    Path(newest).write_bytes(b"garbage")
    assert ring.latest().step == 10
    assert not os.path.exists(newest) and os.listdir(tmp_path) == [os.path.basename(ring.files()[-1])]


def test_a_file_of_another_run_is_refused(trained, tmp_path):
    trainer, module = trained
    path = str(tmp_path / "s.pt")
    snapshot = Snapshot.capture(trainer, module, {}, 1.0)
    snapshot.run_id = "run-a"
    save_snapshot_file(snapshot, path)
    assert load_snapshot_file(path, run_id="run-a").run_id == "run-a"  # negative control: its own run loads it
    with pytest.raises(CorruptSnapshotError, match="written by run 'run-a', not by this run \\('run-b'\\)"):
        load_snapshot_file(path, run_id="run-b")


def test_temporary_files_of_dead_writers_are_removed(tmp_path):
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_file = tmp_path / f"snapshot-step000000004.pt.tmp.{int(dead.stdout)}"
    live_file = tmp_path / f"snapshot-step000000008.pt.tmp.{os.getppid()}"  # a live writer: kept
    kept = tmp_path / "snapshot-step000000004.pt"
    for path in (dead_file, live_file, kept):
        path.write_bytes(b"x")
    SnapshotRing(keep=2, directory=str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == sorted([live_file.name, kept.name])
