"""The op-hash dispatch mode and the first divergent op (deepep_lightning/audit/op_hashes.py, causes.py)."""

import types

import torch
from _planted import _NoisyGate
from torch import nn

from deepep_lightning.audit.causes import base_name, likely_cause
from deepep_lightning.audit.op_hashes import OpHashMode, first_divergence


class _Net(nn.Module):
    def __init__(self, noisy: bool) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.block = nn.Sequential(nn.Tanh(), _NoisyGate() if noisy else nn.Identity())
        self.out = nn.Linear(8, 1)

    def forward(self, x):
        return self.out(self.block(self.inp(x))).sum()


def _logged(net, x):
    net.zero_grad(set_to_none=True)  # else the second backward accumulates: a different op sequence
    with OpHashMode(net) as log:
        net(x).backward()
    return log


def test_identical_runs_have_no_divergence():
    torch.manual_seed(0)
    net, x = _Net(noisy=False), torch.randn(5, 4)
    a, b = _logged(net, x), _logged(net, x)
    assert len(a.records) > 5 and {r.phase for r in a.records} == {"forward", "backward"}
    assert first_divergence(a, b) is None


def test_planted_generator_is_the_first_divergent_op_with_module_and_stack():
    torch.manual_seed(0)
    net, x = _Net(noisy=True), torch.randn(5, 4)
    divergence = first_divergence(_logged(net, x), _logged(net, x))
    assert divergence is not None
    assert base_name(divergence.op) == "randn" and divergence.phase == "forward"
    assert divergence.module_path.endswith("block.1")  # the _NoisyGate
    assert divergence.inputs_identical and divergence.cause == "RNG"
    assert divergence.max_abs_diff > 0
    assert any("_planted.py" in frame and "randn" in frame for frame in divergence.stack)
    assert "first divergent op" in divergence.describe()


def test_backward_difference_is_located_in_backward():
    calls = {"n": 0}

    class _Scale(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            calls["n"] += 1
            return grad * (2 + calls["n"])  # planted: backward depends on the call count

    x = torch.randn(3, requires_grad=True)
    logs = []
    for _ in range(2):
        with OpHashMode() as log:
            _Scale.apply(x).sum().backward()
        logs.append(log)
    divergence = first_divergence(*logs)
    assert divergence.phase == "backward" and divergence.cause == "Python state"


def test_control_flow_divergence():
    x = torch.randn(4)
    logs = []
    for branch in (True, False):
        with OpHashMode() as log:
            (x.exp() if branch else x.sin()).sum()
        logs.append(log)
    assert first_divergence(*logs).cause == "control flow"


def test_keep_bytes_zero_keeps_nothing_and_validates():
    with OpHashMode(keep_bytes=0) as log:
        torch.randn(3).exp()
    assert log.kept == {} and log.records
    try:
        OpHashMode(keep_bytes=-1)
    except ValueError as error:
        assert "keep_bytes" in str(error)
    else:
        raise AssertionError("keep_bytes=-1 accepted")


def _record(op, **kw):
    return types.SimpleNamespace(
        op=op,
        accumulate=kw.get("accumulate", False),
        deterministic_arg=kw.get("deterministic_arg"),
        uninitialised_inputs=kw.get("uninitialised", []),
        input_producers=kw.get("producers", []),
    )


def test_cause_heuristics():
    assert likely_cause(_record("aten.index_add_.default"), inputs_identical=True)[0] == "atomic accumulation"
    assert (
        likely_cause(_record("aten.upsample_bilinear2d_backward.default"), inputs_identical=True)[0]
        == "atomic accumulation"
    )
    assert (
        likely_cause(_record("aten.index_put_.default", accumulate=True), inputs_identical=True)[0]
        == "atomic accumulation"
    )
    assert likely_cause(_record("aten.index_put_.default"), inputs_identical=True)[0] == "unknown"
    assert (
        likely_cause(_record("deepep.all_action_q_backward.default", deterministic_arg=False), inputs_identical=True)[0]
        == "atomic accumulation"
    )
    assert likely_cause(_record("aten.bernoulli_.float"), inputs_identical=True)[0] == "RNG"
    assert (
        likely_cause(
            _record("aten.add.Tensor", uninitialised=[0], producers=["aten.empty.memory_format"]), inputs_identical=True
        )[0]
        == "uninitialised memory"
    )
    assert (
        likely_cause(
            _record("aten.add.Tensor"), inputs_identical=False, differing_input_producers=["aten.empty_like.default"]
        )[0]
        == "uninitialised memory"
    )
    assert (
        likely_cause(_record("aten.add.Tensor"), inputs_identical=False, differing_input_producers=[None])[0]
        == "input from outside"
    )
    assert likely_cause(_record("aten.mm.default"), inputs_identical=True)[0] == "unknown"


def test_module_paths_are_qualified_names_in_forward_and_backward():
    """Blocks called from a LightningModule's training_step are named by index, not by class."""
    from _planted import IdenticalBlocks

    module = IdenticalBlocks(plant="none")
    with OpHashMode(module) as log:
        module.training_step(torch.randn(3, 4), 0).backward()
    forward = {r.module_path for r in log.records if r.phase == "forward"}
    backward = {r.module_path for r in log.records if r.phase == "backward"}
    expected = {f"blocks.{i}.{name}" for i in range(4) for name in ("norm", "attn.lin")} | {"head"}
    assert expected <= forward and {"blocks.2.attn.lin", "blocks.0.norm", "head"} <= backward
    assert not any(path and path.startswith(("_Block", "_Attn", "LayerNorm", "Linear")) for path in forward | backward)
