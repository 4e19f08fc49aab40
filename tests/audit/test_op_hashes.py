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


def test_silent_cudnn_grid_sampler_is_a_known_offender():
    cause, explanation = likely_cause(_record("aten.cudnn_grid_sampler_backward.default"), inputs_identical=True)
    assert cause == "atomic accumulation"
    assert "cuDNN's grid sampler backward" in explanation and "does not flag it" in explanation


_planted_backward_calls = {"n": 0}


@torch.library.custom_op("deepep_audit_test::planted_scale", mutates_args=())
def _planted_scale(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@_planted_scale.register_fake
def _(x):
    return torch.empty_like(x)


def _planted_scale_backward(ctx, grad):
    _planted_backward_calls["n"] += 1
    return grad * (2 + _planted_backward_calls["n"])  # planted: the backward differs on every call


_planted_scale.register_autograd(_planted_scale_backward)


class _Lookup(nn.Module):
    """Used through a method, not ``forward`` (as RAFT's correlation block): no module hook sees the call."""

    def index(self, x):
        return _planted_scale(x)


class _LookupNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lookup = _Lookup()
        self.head = nn.Sequential(nn.Linear(3, 3), nn.Tanh())

    def forward(self, x):
        return self.head(self.lookup.index(x)).sum()


def test_backward_op_is_attributed_to_the_forward_call_that_made_its_node():
    torch.manual_seed(0)
    net, x = _LookupNet(), torch.randn(2, 3, requires_grad=True)
    logs = []
    for _ in range(2):
        x.grad = None
        net.zero_grad(set_to_none=True)
        with OpHashMode(net) as log:
            net(x).backward()
        logs.append(log)
    divergence = first_divergence(*logs)
    assert divergence.phase == "backward" and divergence.autograd_node.startswith("GeneratedBackwardFor")
    # The module tracker alone names the head, whose backward hooks ran last; the op's forward ran in the
    # root module's forward, called from _Lookup.index.
    assert divergence.module_path == "_LookupNet"
    assert divergence.forward_caller.split(" <- ")[0].endswith("in index")
    assert "test_op_hashes.py" in divergence.forward_caller
    assert any("in index" in frame for frame in divergence.stack)
    assert "its forward:" in divergence.describe()
