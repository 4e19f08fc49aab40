"""Rollback decisions agreed by 2 gloo processes: skip on every rank, one fallback snapshot, one regression rollback."""

import json

import pytest
import torch

SCRIPT = __file__.replace("test_rollback_ddp_agreement.py", "_ddp_scenarios.py")


def _run(fit_process, tmp_path, scenario, names):
    process = fit_process(SCRIPT, [scenario, str(tmp_path)], log_path=tmp_path / f"{scenario}.log")
    assert process.wait() == 0, process.output_tail()
    return {name: [json.loads((tmp_path / f"{name}.rank{r}.json").read_text()) for r in (0, 1)] for name in names}


pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed"),
]


def test_skip_policy_under_ddp_skips_the_step_on_every_rank(tmp_path, fit_process):
    """Lightning refuses a None training step under DDP: the skip must not return one."""
    ranks = _run(fit_process, tmp_path, "skip", ["skip"])["skip"]
    for rank in ranks:
        kinds = [kind for kind, _ in rank["events"]]
        assert kinds == ["detected", "rollback", "reproducible", "policy", "rollback", "recovered"]
        assert rank["rollback"]["skip_steps"] == [5] and rank["step"] == 10
    assert ranks[0]["state"] == ranks[1]["state"]  # the ranks stayed in sync


def test_corrupt_newest_snapshot_on_one_rank_falls_back_on_all_ranks(tmp_path, fit_process):
    """Rank 1 cannot load its newest snapshot: both ranks restore the older one (else the replays differ and hang)."""
    runs = _run(fit_process, tmp_path, "corrupt", ["clean", "corrupt"])
    for rank in (0, 1):
        rollbacks = [step for kind, step in runs["corrupt"][rank]["events"] if kind == "rollback"]
        assert rollbacks == [4] and ("transient", 9) in [tuple(e) for e in runs["corrupt"][rank]["events"]]
        assert runs["corrupt"][rank]["state"] == runs["clean"][rank]["state"]  # recovered bitwise
    assert ("corrupt_snapshot", 10) in [tuple(e) for e in runs["corrupt"][1]["events"]]
    assert not any(kind == "corrupt_snapshot" for kind, _ in runs["corrupt"][0]["events"])


def test_regression_on_one_rank_rolls_back_every_rank(tmp_path, fit_process):
    """Rank 1's metric collapses alone: the metric averaged over ranks triggers the same rollback on both."""
    ranks = _run(fit_process, tmp_path, "regression", ["regression"])["regression"]
    for rank in ranks:
        events = [tuple(e) for e in rank["events"]]
        assert events == [("regression", 24), ("rollback", 20), ("policy", 24), ("recovered", 24)]
        assert rank["step"] == 30 and rank["rollback"]["lr_scale"] == 0.5
    assert ranks[0]["state"] == ranks[1]["state"]  # rank 1's blown-up weights were replaced on both: in sync again
