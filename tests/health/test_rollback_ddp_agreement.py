"""Rollback decisions agreed by 2 gloo processes: a fault on one rank recovered bitwise, skip on every rank,
one fallback snapshot, one regression rollback.

Every scenario's fits run in one 2-process job (``_ddp_scenarios.py``, a module-scoped fixture); each
rank writes its weights, health events and step per fit.
"""

import json
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).with_name("_ddp_scenarios.py")
SCENARIOS = ["skip", "corrupt", "fault", "regression"]  # "corrupt" also fits "clean", the reference of two

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed"),
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, fit_process):
    out = tmp_path_factory.mktemp("ddp_scenarios")
    process = fit_process(SCRIPT, [str(out), *SCENARIOS], log_path=out / "log.txt")
    assert process.wait() == 0, process.output_tail()
    names = ["skip", "clean", "corrupt", "faulty", "regression"]
    return {name: [json.loads((out / f"{name}.rank{r}.json").read_text()) for r in (0, 1)] for name in names}


def test_fault_on_one_rank_agreed_and_recovered_bitwise(runs):
    """An infinite loss value on rank 1 only (gradients finite: no all-reduce carries it to rank 0).

    Rank 0 sees nothing wrong: only the agreed verdict makes it roll back too. Without agreement,
    rank 1 would replay alone and its extra all-reduces would hang the job.
    """
    clean, faulty = runs["clean"], runs["faulty"]
    for rank in (0, 1):
        # both ranks take the same decision although only rank 1 saw a non-finite loss
        assert [tuple(e) for e in faulty[rank]["events"]] == [("detected", 5), ("rollback", 4), ("transient", 5)]
        assert clean[rank]["events"] == []
        assert faulty[rank]["state"] == clean[rank]["state"] and faulty[rank]["step"] == 10
    assert faulty[0]["state"] == faulty[1]["state"]  # the ranks stayed in sync


def test_skip_policy_under_ddp_skips_the_step_on_every_rank(runs):
    """Lightning refuses a None training step under DDP: the skip must not return one."""
    ranks = runs["skip"]
    for rank in ranks:
        kinds = [kind for kind, _ in rank["events"]]
        assert kinds == ["detected", "rollback", "reproducible", "policy", "rollback", "recovered"]
        assert rank["rollback"]["skip_steps"] == [5] and rank["step"] == 10
    assert ranks[0]["state"] == ranks[1]["state"]  # the ranks stayed in sync


def test_corrupt_newest_snapshot_on_one_rank_falls_back_on_all_ranks(runs):
    """Rank 1 cannot load its newest snapshot: both ranks restore the older one (else the replays differ and hang)."""
    for rank in (0, 1):
        rollbacks = [step for kind, step in runs["corrupt"][rank]["events"] if kind == "rollback"]
        assert rollbacks == [4] and ("transient", 9) in [tuple(e) for e in runs["corrupt"][rank]["events"]]
        assert runs["corrupt"][rank]["state"] == runs["clean"][rank]["state"]  # recovered bitwise
    assert ("corrupt_snapshot", 10) in [tuple(e) for e in runs["corrupt"][1]["events"]]
    assert not any(kind == "corrupt_snapshot" for kind, _ in runs["corrupt"][0]["events"])


def test_regression_on_one_rank_rolls_back_every_rank(runs):
    """Rank 1's metric collapses alone: the metric averaged over ranks triggers the same rollback on both."""
    ranks = runs["regression"]
    for rank in ranks:
        events = [tuple(e) for e in rank["events"]]
        assert events == [("regression", 24), ("rollback", 20), ("policy", 24), ("recovered", 24)]
        assert rank["step"] == 30 and rank["rollback"]["lr_scale"] == 0.5
    assert ranks[0]["state"] == ranks[1]["state"]  # rank 1's blown-up weights were replaced on both: in sync again
