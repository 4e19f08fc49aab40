"""Incident: the checkpointed form keeps the keys an incident has always been saved under, and reads back."""

import pytest

from deepep_lightning.health import Classification, Incident, NaNRollbackCallback, Outcome

# incidents as a NaNRollbackCallback checkpoint holds them (``state_dict()["incidents"]``)
SAVED_FAILURE = {
    "step": 7,
    "reason": "nonfinite_loss",
    "detected_at": 8,
    "attempts": 1,
    "classification": "reproducible",
    "diagnosis": {"op": "aten.log.default", "module_path": "inner.0", "phase": "forward"},
    "outcome": "recovered",
}
SAVED_UNLOCATED = {"step": 5, "reason": "nonfinite_grad", "detected_at": 6, "attempts": 0, "diagnosis": None}
SAVED_TRANSIENT = {"step": 5, "reason": "nonfinite_grad", "detected_at": 6, "attempts": 0, "outcome": "transient"}
SAVED_REGRESSION = {
    "step": 24,
    "reason": "regression",
    "detected_at": 24,
    "attempts": 1,
    "monitor": "train/score",
    "value": -3.5,
    "best": -0.25,
    "best_step": 20,
    "outcome": "recovered",
    "recovered_at": 30,
}


@pytest.mark.parametrize("saved", [SAVED_FAILURE, SAVED_UNLOCATED, SAVED_TRANSIENT, SAVED_REGRESSION])
def test_a_saved_incident_reads_back_to_the_same_keys_and_values(saved):
    incident = Incident.from_dict(saved)
    assert incident.to_dict() == saved
    assert list(incident.to_dict()) == list(saved)  # the key order of the event fields too


def test_fields_are_typed_and_unset_ones_write_no_key():
    incident = Incident.from_dict(SAVED_FAILURE)
    assert incident.classification is Classification.REPRODUCIBLE and incident.outcome is Outcome.RECOVERED
    assert type(incident.to_dict()["outcome"]) is str  # checkpoints hold plain strings (weights_only loads)
    assert Incident(step=3, reason="nonfinite_loss", detected_at=4).to_dict() == {
        "step": 3,
        "reason": "nonfinite_loss",
        "detected_at": 4,
        "attempts": 0,
    }
    # a locator that found no op is recorded (None); one that never ran is not (negative control)
    assert "diagnosis" in Incident.from_dict(SAVED_UNLOCATED).to_dict()
    assert "diagnosis" not in Incident.from_dict(SAVED_TRANSIENT).to_dict()


def test_event_fields_name_the_step_incident_step():
    fields = Incident.from_dict(SAVED_TRANSIENT).event_fields()
    assert fields == {"reason": "nonfinite_grad", "detected_at": 6, "attempts": 0, "outcome": "transient"} | {
        "incident_step": 5
    }


def test_callback_state_with_saved_incidents_loads_and_saves_unchanged():
    saved = {
        "skip_steps": [7],
        "lr_scale": 0.5,
        "incidents": [SAVED_FAILURE, SAVED_REGRESSION],
        "stopped": False,
        "stop_report": None,
        "regression": None,
    }
    rollback = NaNRollbackCallback()
    rollback.load_state_dict(saved)
    assert [incident.step for incident in rollback.incidents] == [7, 24]
    assert rollback.state_dict() == saved
