import math

import pytest
import torch

from deepep_lightning.health import StepFlags


def _read(flags, steps):
    records, _ = flags.read(steps)
    return {r.step: r for r in records}


def test_a_nan_in_one_gradient_element_flags_that_step_only():
    flags = StepFlags(4)
    for step in range(4):
        flags.begin(step)
        grads = [torch.ones(3, 5), torch.ones(7)]
        if step == 2:
            grads[1][4] = float("nan")
        flags.record_grads(step, grads)
        flags.record_loss(step, torch.tensor(float(step)))
    records = _read(flags, range(4))
    assert [records[s].reason for s in range(4)] == [None, None, "nonfinite_grad", None]
    assert records[1].grad_norm == pytest.approx(math.sqrt(22))
    assert records[3].loss == 3.0


def test_huge_finite_gradients_are_not_nonfinite_but_a_huge_norm_passed_in_is_inf():
    flags = StepFlags(2)
    flags.begin(0)
    flags.record_grads(0, [torch.full((4,), 1e30)])  # sum of squares overflows float32
    flags.begin(1)
    flags.record_grad_norm(1, torch.tensor(float("inf")))  # a precomputed norm (the CUDA-graph path)
    records = _read(flags, [0, 1])
    assert records[0].grads_finite and math.isinf(records[0].grad_norm)
    assert not records[1].grads_finite and records[1].reason == "nonfinite_grad"


def test_a_new_step_does_not_inherit_the_values_of_the_step_that_used_its_row():
    # Negative control for the host bookkeeping: row 0 holds step 0's NaNs when step 2 reuses it.
    flags = StepFlags(2)
    flags.begin(0)
    flags.record_loss(0, torch.tensor(float("nan")))
    flags.record_grads(0, [torch.tensor([float("nan"), 1.0])])
    assert _read(flags, [0])[0].reason == "nonfinite_loss"
    flags.begin(2)
    record = _read(flags, [2])[2]
    assert record.finite and record.loss is None and record.grad_norm == 0.0


def test_two_gradient_records_in_one_step_combine():
    flags = StepFlags(1)
    flags.begin(0)
    flags.record_grads(0, [torch.tensor([3.0, 0.0])])
    flags.record_grads(0, [torch.tensor([-4.0])])  # a one-element gradient is a gradient, not a norm
    record = _read(flags, [0])[0]
    assert record.grad_norm == pytest.approx(5.0) and record.finite
    assert flags._rows[0, 1].item() == 4.0  # max-abs: |-4|
    flags.record_grad_norm(0, torch.tensor([float("inf")]))
    assert _read(flags, [0])[0].reason == "nonfinite_grad"


def test_params_and_a_non_scalar_loss():
    flags = StepFlags(1)
    flags.begin(0)
    flags.record_loss(0, torch.tensor([1.0, float("-inf")]))
    norm = flags.record_params(0, [torch.tensor([3.0, 4.0])])
    assert norm.item() == pytest.approx(5.0)
    record = _read(flags, [0])[0]
    assert record.reason == "nonfinite_loss" and record.params_finite
    flags.record_params(0, [torch.tensor([float("nan")])])
    assert not _read(flags, [0])[0].params_finite


def test_reading_a_step_that_was_not_begun_or_too_many_steps_is_refused():
    flags = StepFlags(2)
    flags.begin(0)
    with pytest.raises(RuntimeError, match="step 1 was not begun"):
        flags.read([1])
    with pytest.raises(RuntimeError, match="cannot read 3 steps from a ring of 2"):
        flags.read([0, 1, 2])


def test_a_graph_path_step_writes_two_tensors_and_computes_nothing():
    """The CUDA-graph path records a scalar loss and grad norm every step: that must stay two copies, with
    no reduction, no finiteness kernel and nothing to open the step (the old flags ran ~18 ops)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    flags = StepFlags(10)
    loss, grad_norm = torch.tensor(1.5), torch.tensor(2.0)
    flags.begin(0)
    with _Ops() as mode:
        flags.begin(1)
        flags.record_loss(1, loss)
        flags.record_grad_norm(1, grad_norm)
    computing = [
        op for op in mode.ops if op.split(".")[1] not in {"select", "slice", "view", "expand", "alias", "detach"}
    ]
    assert computing == ["aten.copy_.default", "aten.copy_.default"], mode.ops
    record = _read(flags, [1])[1]
    assert record.loss == 1.5 and record.grad_norm == 2.0 and record.finite
