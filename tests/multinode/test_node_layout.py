"""Node layouts in one process: the fingerprint's layout fields, the world-size check, gradient_reduction."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from deepep_lightning.determinism.fingerprint import collect_fingerprint, describe_layout, diff_fingerprints
from deepep_lightning.strategies import DeterministicDDPStrategy, WorldSizeMismatchError
from deepep_lightning.strategies.rank_state import check_world_size


def test_layout_is_described_in_words():
    assert describe_layout(2, 2) == "2 nodes x 2 processes"
    assert describe_layout(1, 1) == "1 node x 1 process"


def test_fingerprint_records_the_layout_but_compares_the_world_size_only():
    two_by_two, one_by_four = collect_fingerprint(4, num_nodes=2), collect_fingerprint(4, num_nodes=1)
    assert (two_by_two["num_nodes"], two_by_two["node_layout"]) == ("2", "2 nodes x 2 processes")
    assert one_by_four["node_layout"] == "1 node x 4 processes"
    assert diff_fingerprints(two_by_two, one_by_four) == {}  # the strategy judges a layout change
    assert diff_fingerprints(two_by_two, collect_fingerprint(2, num_nodes=2)) == {"world_size": ("4", "2")}


@pytest.mark.parametrize(
    ("world_size", "num_nodes", "match"),
    [(0, 1, r"`world_size`.*got 0"), (4, True, r"`num_nodes`.*got True"), (4, 3, r"num_nodes=3.*world_size=4")],
)
def test_fingerprint_refuses_a_bad_layout(world_size, num_nodes, match):
    with pytest.raises(ValueError, match=match):
        collect_fingerprint(world_size, num_nodes=num_nodes)


def test_world_size_check_names_both_layouts():
    saved = {"world_size": 4, "num_nodes": 2, "processes_per_node": 2}
    check_world_size(saved, 4, num_nodes=1)  # negative control: another layout of the same size passes
    with pytest.raises(
        WorldSizeMismatchError,
        match=r"world_size=4, this run has world_size=3 \(the checkpoint's 2 nodes x 2 processes vs this run's 1 node"
        r" x 3 processes\)",
    ):
        check_world_size(saved, 3, num_nodes=1)


def _strategy(quiet_trainer, devices: int, **kwargs) -> DeterministicDDPStrategy:
    return quiet_trainer(devices=devices, strategy=DeterministicDDPStrategy(**kwargs)).strategy


def test_strategy_records_its_layout_and_refuses_another_world_size(quiet_trainer):
    strategy = _strategy(quiet_trainer, 3)
    record = strategy.fingerprint()
    assert record["ddp.num_nodes"] == "1" and record["ddp.node_layout"] == "1 node x 3 processes"
    assert record["ddp.cluster_environment"] == "LightningEnvironment"
    with pytest.raises(WorldSizeMismatchError, match=r"2 nodes x 2 processes vs this run's 1 node x 3 processes"):
        strategy.check_resume({"world_size": 4, "num_nodes": 2, "processes_per_node": 2})


def test_strategy_resumes_another_layout_of_the_same_world_size(quiet_trainer, monkeypatch):
    strategy = _strategy(quiet_trainer, 4)
    saved = {"world_size": 4, "num_nodes": 2, "processes_per_node": 2}
    strategy.check_resume(saved)  # ordered sums: nothing to warn about
    allreduce = _strategy(quiet_trainer, 4, gradient_reduction="allreduce")
    monkeypatch.setattr(allreduce, "_process_group_backend", "nccl")
    with pytest.warns(UserWarning, match=r"2 nodes x 2 processes on 1 node x 4 processes.*another ring"):
        allreduce.check_resume(saved)


def test_gradient_reduction_auto_orders_from_three_ranks_on(quiet_trainer):
    assert _strategy(quiet_trainer, 1).resolved_gradient_reduction == "allreduce"
    assert _strategy(quiet_trainer, 2).resolved_gradient_reduction == "allreduce"  # a + b = b + a
    assert _strategy(quiet_trainer, 4).resolved_gradient_reduction == "ordered"
    assert _strategy(quiet_trainer, 4, gradient_reduction="allreduce").resolved_gradient_reduction == "allreduce"
    assert _strategy(quiet_trainer, 2, gradient_reduction="ordered").fingerprint()["ddp.gradient_reduction"] == (
        "ordered"
    )
    hooked = _strategy(quiet_trainer, 4, ddp_comm_hook=lambda state, bucket: None)
    assert hooked.resolved_gradient_reduction == "ddp_comm_hook"  # the user's hook wins over "auto"


def test_bad_gradient_reduction_is_refused():
    with pytest.raises(MisconfigurationException, match=r"gradient_reduction.*'sum'"):
        DeterministicDDPStrategy(gradient_reduction="sum")  # type: ignore[arg-type]
    with pytest.raises(MisconfigurationException, match=r"gradient_reduction='ordered'.*ddp_comm_hook=.*HINT"):
        DeterministicDDPStrategy(gradient_reduction="ordered", ddp_comm_hook=lambda state, bucket: None)


def test_world_size_invariant_mode_refuses_a_sampler_it_cannot_split():
    from deepep_lightning.determinism.sampler import SeekableSampler
    from deepep_lightning.strategies.train_data import check_virtual_sampler
    from deepep_lightning.strategies.virtual_shards import VirtualShardSampler

    data = range(16)
    check_virtual_sampler(torch.utils.data.DistributedSampler(data, num_replicas=1, rank=0), 2, 1)  # Lightning's
    check_virtual_sampler(
        VirtualShardSampler(data, virtual_world_size=2, num_replicas=1, rank=0, batch_size=4, seed=0), 2, 1
    )
    with pytest.raises(MisconfigurationException, match=r"virtual_world_size=2.*SeekableSampler.*seekable_data=False"):
        check_virtual_sampler(SeekableSampler(data, seed=0), 2, 1)
