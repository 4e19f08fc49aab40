"""LossSpikeDetector: warm-up, z-score threshold, persistence, state round trip, argument checks."""

import pytest
from lightning.fabric.utilities.exceptions import MisconfigurationException

from deepep_lightning.health.spike import LossSpikeDetector


def _noisy(n, base=1.0):
    return [base + 0.01 * ((i * 7919) % 13 - 6) for i in range(n)]


def test_spike_confirmed_after_persistence_and_start_reported():
    det = LossSpikeDetector(window=20, z_threshold=5.0, warmup=10, persistence=2)
    for step, loss in enumerate(_noisy(30)):
        assert not det.update(step, loss)
    assert not det.update(30, 50.0)  # first spiking loss: not yet confirmed
    assert det.update(31, 60.0)
    assert det.spike_start == 30


def test_blip_is_ignored_with_persistence_two():
    det = LossSpikeDetector(window=20, z_threshold=5.0, warmup=10, persistence=2)
    for step, loss in enumerate(_noisy(30)):
        det.update(step, loss)
    assert not det.update(30, 50.0)
    assert not det.update(31, 1.0)  # back to normal: the run resets
    assert det.spike_start is None


def test_no_judgement_during_warmup():
    det = LossSpikeDetector(window=5, z_threshold=1.0, warmup=5, persistence=1)
    assert not any(det.update(i, v) for i, v in enumerate([1.0, 100.0, 1.0, 1000.0, 1.0]))
    assert det.update(5, 1e6)  # negative control: after warm-up a jump is caught


def test_spiking_losses_do_not_enter_window():
    det = LossSpikeDetector(window=10, z_threshold=5.0, warmup=5, persistence=3)
    for step, loss in enumerate(_noisy(10)):
        det.update(step, loss)
    det.update(10, 100.0)
    assert 100.0 not in det.state_dict()["history"]


def test_a_run_longer_than_the_window_becomes_the_new_level():
    det = LossSpikeDetector(window=10, z_threshold=5.0, warmup=5, persistence=2)
    for step, loss in enumerate(_noisy(10)):
        det.update(step, loss)
    shifted = [det.update(10 + i, loss) for i, loss in enumerate(_noisy(25, base=50.0))]
    assert shifted[0] is False and all(shifted[1:9])  # confirmed, then flagged while shorter than the window
    assert not any(shifted[9:])  # the tenth spiking loss in a row makes 50 the level: no flag against 1.0 forever
    assert min(det.state_dict()["history"]) > 40.0
    assert det.update(35, 5000.0) is False and det.update(36, 5000.0) is True  # still catches a spike on top of it


def test_state_dict_round_trip_gives_same_decisions():
    a = LossSpikeDetector(window=10, z_threshold=4.0, warmup=5, persistence=2)
    for step, loss in enumerate(_noisy(12)):
        a.update(step, loss)
    a.update(12, 40.0)
    b = LossSpikeDetector(window=10, z_threshold=4.0, warmup=5, persistence=2)
    b.load_state_dict(a.state_dict())
    assert a.update(13, 45.0) == b.update(13, 45.0) is True


def test_nonfinite_loss_is_rejected():
    with pytest.raises(ValueError, match="non-finite"):
        LossSpikeDetector().update(0, float("nan"))


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"window": 1}, "spike_window"),
        ({"z_threshold": 0}, "spike_z_threshold"),
        ({"warmup": 1}, "spike_warmup"),
        ({"persistence": 0}, "spike_persistence"),
        ({"window": 3.5}, "spike_window"),
    ],
)
def test_bad_arguments(kwargs, name):
    with pytest.raises(MisconfigurationException, match=name):
        LossSpikeDetector(**kwargs)
