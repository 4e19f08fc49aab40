"""CPU tests of deepep_lightning::ctc_loss_backward (schema, opcheck, PyTorch's gradient, errors) and its routes."""

import pytest
import torch
import torch.nn.functional as F

from deepep_lightning.ops import extension_available
from deepep_lightning.ops._routes import registered_routes
from deepep_lightning.ops.ctc_loss import ctc_loss_backward, ctc_loss_backward_reference, unsupported_reason

needs_extension = pytest.mark.skipif(not extension_available(), reason="needs the compiled deepep_lightning extension")


def ctc_case(steps=12, batch=3, classes=5, max_target=4, concatenated=False, dtype=torch.float64, seed=0, blank=0):
    """Forward outputs of aten::_ctc_loss and a per-sample grad, as the backward receives them."""
    generator = torch.Generator().manual_seed(seed)
    log_probs = torch.randn(steps, batch, classes, dtype=dtype, generator=generator).log_softmax(2)
    labels = [c for c in range(classes) if c != blank]
    targets = torch.tensor(labels)[torch.randint(0, len(labels), (batch, max_target), generator=generator)]
    input_lengths = [steps - (b % 3) for b in range(batch)]
    target_lengths = [max(0, max_target - b) for b in range(batch)]
    if concatenated:
        targets = torch.cat([targets[b, : target_lengths[b]] for b in range(batch)])
    nll, log_alpha = torch.ops.aten._ctc_loss(log_probs, targets, input_lengths, target_lengths, blank, False)
    grad = torch.rand(batch, dtype=dtype, generator=generator)
    return grad, log_probs, targets, input_lengths, target_lengths, nll, log_alpha, blank


@needs_extension
@pytest.mark.parametrize("concatenated", [False, True])
@pytest.mark.parametrize("zero_infinity", [False, True])
def test_matches_pytorch_cpu_backward(concatenated, zero_infinity):
    args = ctc_case(concatenated=concatenated)
    ours = ctc_loss_backward(*args, zero_infinity=zero_infinity)
    expected = ctc_loss_backward_reference(*args, zero_infinity=zero_infinity)
    torch.testing.assert_close(ours, expected, rtol=0, atol=0)
    assert ours.shape == args[1].shape


@needs_extension
def test_matches_autograd_of_f_ctc_loss():
    """End to end: the gradient of F.ctc_loss(reduction="sum") is this op with grad = ones."""
    grad, log_probs, targets, input_lengths, target_lengths, nll, log_alpha, blank = ctc_case(seed=4)
    leaf = log_probs.detach().requires_grad_()
    F.ctc_loss(leaf, targets, input_lengths, target_lengths, blank=blank, reduction="sum").backward()
    ours = ctc_loss_backward(torch.ones_like(grad), leaf.detach(), targets, input_lengths, target_lengths, nll,
                             log_alpha, blank)  # fmt: skip
    torch.testing.assert_close(ours, leaf.grad)
    wrong = ctc_loss_backward(torch.ones_like(grad), leaf.detach(), targets.flip(1), input_lengths, target_lengths,
                              nll, log_alpha, blank)  # fmt: skip
    assert not torch.allclose(wrong, leaf.grad)  # negative control: other targets, other gradient


@needs_extension
def test_infinite_loss_and_zero_infinity():
    # Target longer than the input can emit: the loss is infinite.
    grad, log_probs, targets, _, target_lengths, _, _, blank = ctc_case(steps=3, batch=2, max_target=4)
    input_lengths = [3, 3]
    nll, log_alpha = torch.ops.aten._ctc_loss(log_probs, targets, input_lengths, target_lengths, blank, False)
    assert torch.isinf(nll).any()
    for zero_infinity in (False, True):
        ours = ctc_loss_backward(grad, log_probs, targets, input_lengths, target_lengths, nll, log_alpha, blank,
                                 zero_infinity)  # fmt: skip
        expected = ctc_loss_backward_reference(grad, log_probs, targets, input_lengths, target_lengths, nll,
                                               log_alpha, blank, zero_infinity)  # fmt: skip
        torch.testing.assert_close(ours, expected, equal_nan=True)
    assert torch.all(ours[:, torch.isinf(nll)] == 0)


@needs_extension
def test_opcheck_and_tensor_lengths():
    grad, log_probs, targets, input_lengths, target_lengths, nll, log_alpha, blank = ctc_case(dtype=torch.float32)
    lengths = (torch.tensor(input_lengths), torch.tensor(target_lengths, dtype=torch.int32))
    ours = ctc_loss_backward(grad, log_probs, targets.int(), *lengths, nll, log_alpha, blank)
    expected = ctc_loss_backward_reference(grad, log_probs, targets, input_lengths, target_lengths, nll, log_alpha, 0)
    torch.testing.assert_close(ours, expected)
    args = (grad, log_probs, targets, lengths[0], lengths[1].long(), nll, log_alpha, blank, False)
    torch.library.opcheck(torch.ops.deepep_lightning.ctc_loss_backward.default, args)


@needs_extension
def test_non_contiguous_log_probs_and_blank_last():
    grad, log_probs, targets, input_lengths, target_lengths, nll, log_alpha, blank = ctc_case(blank=4, seed=2)
    transposed = log_probs.transpose(0, 1).contiguous().transpose(0, 1)  # [T, N, C] with batch-major strides
    ours = ctc_loss_backward(grad, transposed, targets, input_lengths, target_lengths, nll, log_alpha, blank)
    expected = ctc_loss_backward_reference(grad, log_probs, targets, input_lengths, target_lengths, nll, log_alpha, 4)
    torch.testing.assert_close(ours, expected, rtol=0, atol=0)


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda a: {**a, "log_probs": a["log_probs"][0]}, "3-D"),
        (lambda a: {**a, "log_probs": a["log_probs"].half()}, "float32/float64"),
        (lambda a: {**a, "grad": a["grad"].float()}, "dtype"),
        (lambda a: {**a, "grad": a["grad"][:1]}, "N = 3"),
        (lambda a: {**a, "log_alpha": a["log_alpha"][:, :, :-1]}, "log_alpha"),
        (lambda a: {**a, "targets": a["targets"].double()}, "targets"),
        (lambda a: {**a, "input_lengths": [12, 12]}, "input_lengths"),
        (lambda a: {**a, "blank": 5}, "blank"),
    ],
)
def test_bad_arguments_name_what_is_wrong(change, match):
    names = ("grad", "log_probs", "targets", "input_lengths", "target_lengths", "neg_log_likelihood", "log_alpha",
             "blank")  # fmt: skip
    args = change(dict(zip(names, ctc_case())))
    with pytest.raises(ValueError, match=match):
        ctc_loss_backward(**args)
    assert unsupported_reason(*args.values()) is not None


def test_both_overloads_are_routed_and_cpu_is_left_to_pytorch():
    routes = registered_routes()
    for name in ("_ctc_loss_backward", "_ctc_loss_backward.Tensor"):
        assert routes[name].covers(*ctc_case()) is not None  # CPU tensors: PyTorch's kernel
