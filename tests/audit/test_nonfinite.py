"""locate_nonfinite: names the planted op, its module and frame, in forward and in backward."""

import pytest
import torch
from torch import nn

from deepep_lightning.audit.nonfinite import DEFAULT_ALLOW_INF_OPS, locate_nonfinite


class Inner(nn.Module):
    def __init__(self, plant: str) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.plant = plant

    def forward(self, x):
        y = self.lin(x)
        if self.plant == "forward":
            return torch.log(y * 0)  # PLANTED-FORWARD: log of zero
        if self.plant == "backward":
            return torch.sqrt(y * 0)  # PLANTED-BACKWARD: finite forward, d sqrt(0) = inf
        return torch.tanh(y)


class Net(nn.Module):
    def __init__(self, plant: str = "none") -> None:
        super().__init__()
        self.encoder = nn.Linear(3, 3)
        self.inner = Inner(plant)

    def forward(self, x):
        return self.inner(torch.relu(self.encoder(x))).sum()


def test_forward_plant_named_with_module_inputs_and_frame():
    net = Net("forward")
    found = locate_nonfinite(net, torch.randn(4, 3), module=net)
    assert found is not None
    assert found.op == "aten.log.default" and found.phase == "forward"
    assert found.module_path == "inner"  # the qualified path of named_modules(), not the class
    assert found.output_inf and not found.output_nan and found.output_shape == (4, 3)
    assert found.inputs[0]["max"] == 0.0 and found.inputs[0]["zeros"] == 12 and found.inputs_finite
    assert "test_nonfinite.py" in found.user_frame and "PLANTED-FORWARD" in found.user_frame
    assert "aten.log.default" in found.describe()


def test_backward_plant_named_with_autograd_node_and_forward_frame():
    net = Net("backward")
    x = torch.randn(4, 3)
    assert torch.isfinite(net(x))  # the forward really is finite
    found = locate_nonfinite(net, x, module=net)
    assert found is not None and found.phase == "backward"
    assert found.autograd_node == "SqrtBackward0"
    assert found.module_path == "inner"  # the qualified path of named_modules(), not the class
    assert "PLANTED-BACKWARD" in found.user_frame


def test_clean_model_reports_nothing():
    net = Net("none")
    assert locate_nonfinite(net, torch.randn(4, 3), module=net) is None


def test_nonfinite_parameter_reported_before_running():
    net = Net("none")
    with torch.no_grad():
        net.encoder.bias[1] = float("nan")
    found = locate_nonfinite(net, torch.randn(4, 3), module=net)
    assert found.op == "parameter" and found.module_path == "encoder.bias" and found.output_nan


def test_allow_list_for_intentional_inf_masking():
    def masked_softmax(x):
        mask = torch.tensor([True, False, True])
        return torch.softmax(x.masked_fill(~mask, float("-inf")), dim=-1).sum()

    x = torch.randn(2, 3, requires_grad=True)
    assert "aten.masked_fill.Scalar" in DEFAULT_ALLOW_INF_OPS
    assert locate_nonfinite(masked_softmax, x) is None
    # negative control: without the allow-list the masking op is reported
    found = locate_nonfinite(masked_softmax, x, allow_inf_ops=())
    assert found is not None and found.op.startswith("aten.masked_fill")


def test_nan_is_never_allowed():
    def nan_fill(x):
        return x.masked_fill(x > 0, float("nan")).sum()

    found = locate_nonfinite(nan_fill, torch.ones(3, requires_grad=True))
    assert found is not None and found.output_nan


def test_without_module_no_path_but_op_found():
    found = locate_nonfinite(lambda x: torch.log(x - x).sum(), torch.ones(3, requires_grad=True), backward=False)
    assert found.op == "aten.log.default" and found.module_path is None


def test_update_locator_names_the_optimizer_and_the_parameter():
    from deepep_lightning.audit.nonfinite import locate_nonfinite_update

    def run(lr):
        torch.manual_seed(0)
        net = Net()
        optimizers = [torch.optim.SGD(net.encoder.parameters(), lr=0.1), torch.optim.SGD(net.inner.parameters(), lr=lr)]
        net(torch.randn(4, 3)).backward()
        return locate_nonfinite_update(optimizers, net)

    assert run(0.1) is None  # negative control: a finite update is not reported
    found = run(float("inf"))
    assert found is not None and found.phase == "optimizer" and found.optimizer == "SGD (optimizer 1)"
    assert found.parameter == found.module_path == "inner.lin.weight"
    assert "optimizer: SGD (optimizer 1), parameter: inner.lin.weight" in found.describe()


@pytest.mark.parametrize("plant, phase", [("forward", "forward"), ("backward", "backward")])
@pytest.mark.parametrize("planted", [1, 2])
def test_a_plant_in_one_of_identical_blocks_is_named_by_its_index(plant, phase, planted):
    """Blocks called from training_step: ModTracker alone names each of them by its class (``_Attn``)."""
    from _planted import IdenticalBlocks

    torch.manual_seed(0)
    module = IdenticalBlocks(planted=planted, plant=plant)
    found = locate_nonfinite(lambda: module.training_step(torch.randn(3, 4), 0), module=module)
    assert found is not None and found.phase == phase
    assert found.module_path == f"blocks.{planted}.attn"


def test_unwritten_part_of_fsdp_gather_buffer_is_not_reported():
    # FSDP2 gathers into a buffer it gets uninitialised: the slices of the other ranks may hold NaN bit
    # patterns until the all-gather lands, and that garbage is not an op's output
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives  # noqa: F401  registers fsdp::

    def copy_in(shard, buffer):
        return torch.ops.fsdp.all_gather_copy_in([shard], buffer, [shard.numel()], shard.numel(), 0)

    garbage = torch.full((6,), float("nan"))  # NaN bit patterns, as an uninitialised buffer may hold
    assert locate_nonfinite(copy_in, torch.ones(3), garbage, backward=False) is None
    found = locate_nonfinite(copy_in, torch.tensor([1.0, float("nan"), 1.0]), garbage, backward=False)
    assert found is not None and found.op == "fsdp.all_gather_copy_in.default"  # this rank's slice is checked
