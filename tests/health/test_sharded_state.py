"""Sharded (DTensor) state in one process: digests, snapshot copies, health flags and the layout check.

A fake process group of world size 2 (this process is rank 0; collectives return at once) gives real
``DTensor`` parameters and AdamW state without other processes; the multi-process behaviour is in
``tests/strategies/test_model_parallel_multiprocess.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from lightning.fabric.utilities.exceptions import MisconfigurationException
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from deepep_lightning.determinism.checkpoint_integrity import (
    CheckpointIntegrityError,
    digest,
    local_shards_digest,
    model_digest,
)
from deepep_lightning.determinism.resume_checks import stamp_digests, verify_digests
from deepep_lightning.health.flags import StepFlags
from deepep_lightning.health.sharded_layouts import check_sharded_layout
from deepep_lightning.health.state_copies import restore_module, restore_optimizer, to_host


@pytest.fixture(scope="module")
def mesh():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield init_device_mesh("cpu", (2,), mesh_dim_names=("data_parallel",))
    dist.destroy_process_group()


def _sharded(mesh, local: torch.Tensor, placement=None) -> DTensor:
    return DTensor.from_local(local, mesh, [placement or Shard(0)], run_check=False)


class _Sharded(torch.nn.Module):
    def __init__(self, mesh) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.weight = torch.nn.Parameter(_sharded(mesh, torch.randn(4, 3, generator=generator)))
        self.bias = torch.nn.Parameter(_sharded(mesh, torch.empty(0)))  # a tensor smaller than the mesh


def _stepped(mesh) -> tuple[_Sharded, torch.optim.AdamW]:
    module = _Sharded(mesh)
    optimizer = torch.optim.AdamW(module.parameters(), lr=0.1)
    for param in module.parameters():
        param.grad = _sharded(mesh, torch.ones_like(param.to_local()))
    optimizer.step()
    return module, optimizer


def test_digest_covers_the_local_shard_and_its_layout(mesh):
    local = torch.arange(6.0).reshape(3, 2)
    base = digest({"w": _sharded(mesh, local)})
    assert base == digest({"w": _sharded(mesh, local.clone())})
    flipped = local.clone()
    flipped.view(torch.int32)[0, 0] ^= 1
    assert digest({"w": _sharded(mesh, flipped)}) != base  # one bit of the shard
    assert digest({"w": _sharded(mesh, local, Replicate())}) != base  # same bytes, another placement
    state = {"w": _sharded(mesh, local)}
    assert model_digest(state) is None and local_shards_digest(state) == base
    assert local_shards_digest({"w": local}) is None  # a plain state_dict keeps its one digest


def test_resume_compares_this_ranks_shards_with_the_digest_it_wrote(mesh):
    saved = {"w": _sharded(mesh, torch.ones(2, 2))}
    state = {"seed": 1}
    stamp_digests(state, {"state_dict": saved}, [local_shards_digest(saved), "rank 1's digest"])
    checkpoint_without_weights: dict = {}  # a sharded directory: the weights went into the module
    verify_digests("ckpt", state, checkpoint_without_weights, saved, rank=0, world_size=2)
    corrupt = {"w": _sharded(mesh, torch.ones(2, 2) * 2)}
    with pytest.raises(CheckpointIntegrityError, match="rank 0's shards"):
        verify_digests("ckpt", state, checkpoint_without_weights, corrupt, rank=0, world_size=2)
    # another world size: the layout check refuses it before, the digests are not compared
    verify_digests("ckpt", state, checkpoint_without_weights, corrupt, rank=0, world_size=1)


def test_snapshot_restores_shards_in_place_keeping_the_dtensors(mesh):
    module, optimizer = _stepped(mesh)
    model_copy = to_host(module.state_dict(), [])
    optimizer_copy = to_host(optimizer.state_dict(), [])
    assert model_copy["weight"]["layout"] == "(Shard(dim=0),) [8, 3]"
    saved_weight = module.weight.to_local().clone()
    saved_moment = optimizer.state[module.weight]["exp_avg"].to_local().clone()
    weight, moment = module.weight, optimizer.state[module.weight]["exp_avg"]
    optimizer.step()  # moves the weights and the moments on
    assert not torch.equal(module.weight.to_local(), saved_weight)
    restore_module(module, model_copy)  # type: ignore[arg-type]
    restore_optimizer(optimizer, optimizer_copy)
    assert module.weight is weight and optimizer.state[weight]["exp_avg"] is moment  # in place
    assert isinstance(module.weight, DTensor) and module.weight.placements == (Shard(0),)
    assert torch.equal(module.weight.to_local(), saved_weight)
    assert torch.equal(moment.to_local(), saved_moment)


def test_missing_optimizer_state_is_rebuilt_in_the_parameters_layout(mesh):
    module, optimizer = _stepped(mesh)
    optimizer_copy = to_host(optimizer.state_dict(), [])
    saved_moment = optimizer.state[module.weight]["exp_avg_sq"].to_local().clone()
    optimizer.state.clear()  # as a fresh optimizer
    restore_optimizer(optimizer, optimizer_copy)
    moment = optimizer.state[module.weight]["exp_avg_sq"]
    assert isinstance(moment, DTensor) and moment.placements == module.weight.placements
    assert moment.shape == module.weight.shape and torch.equal(moment.to_local(), saved_moment)


def test_a_snapshot_of_another_layout_is_refused(mesh):
    module, _ = _stepped(mesh)
    model_copy = to_host(module.state_dict(), [])
    module.weight = torch.nn.Parameter(_sharded(mesh, torch.zeros(4, 3), Replicate()))
    with pytest.raises(RuntimeError, match=r"'weight'.*\(Shard\(dim=0\),\) \[8, 3\].*Replicate"):
        restore_module(module, model_copy)  # type: ignore[arg-type]


def test_flags_read_local_shards_and_skip_empty_ones(mesh):
    flags = StepFlags(capacity=2)
    flags.begin(0)
    grad = torch.zeros(4, 3)
    grad[1, 2] = float("nan")
    flags.record_grads(0, [_sharded(mesh, grad), _sharded(mesh, torch.empty(0))])
    flags.record_params(0, [_sharded(mesh, torch.ones(4, 3)), _sharded(mesh, torch.empty(0))])
    (record,), _ = flags.read([0])
    assert not record.grads_finite and record.params_finite


def test_layout_check_refuses_an_optimizer_it_cannot_shard_snapshot(mesh):
    module = _Sharded(mesh)
    check_sharded_layout(module, [torch.optim.AdamW(module.parameters())])  # served
    with pytest.raises(MisconfigurationException, match=r"optimizer='LBFGS'.*'weight'.*HINT: use one of SGD"):
        check_sharded_layout(module, [torch.optim.LBFGS(module.parameters())])
    plain = torch.nn.Linear(2, 2)
    check_sharded_layout(plain, [torch.optim.LBFGS(plain.parameters())])  # not sharded: nothing to refuse
