"""Rollback replays under DeterminismCallback(reseed_every_step=True): dropout draws from the global RNG."""

import pytest
import torch

from deepep_lightning.determinism import DeterminismCallback
from deepep_lightning.health import FaultInjectionCallback, NaNRollbackCallback, NumericalHealthCallback

from .conftest import ToyModule, make_trainer


def _fit(tmp_path, fault, replay_hook=True):
    torch.manual_seed(0)
    module = ToyModule()
    determinism = DeterminismCallback(seed=3, seekable_data=False)
    if not replay_hook:  # negative control: the replay does not reseed like the original step did
        determinism.on_replay_batch_start = lambda *args: None
    callbacks = [
        determinism,
        NumericalHealthCallback(check_every_n_steps=1, spike_detection=False),
        NaNRollbackCallback(snapshot_every_n_steps=4, policy="stop"),
    ]
    if fault:
        callbacks.append(FaultInjectionCallback(target="loss", steps=(6,), mode="once"))
    make_trainer(tmp_path, callbacks, max_steps=10).fit(module)
    torch.use_deterministic_algorithms(False)
    return {k: v.clone() for k, v in module.state_dict().items()}


@pytest.mark.parametrize("replay_hook", [True, False])
def test_transient_fault_replay_is_bitwise_with_per_step_reseeding(tmp_path, replay_hook):
    clean = _fit(tmp_path / "clean", fault=False)
    faulty = _fit(tmp_path / "faulty", fault=True, replay_hook=replay_hook)
    equal = all(torch.equal(clean[k], faulty[k]) for k in clean)
    assert equal is replay_hook
