"""GPU tests of the deterministic CTC backward and its _ctc_loss_backward routes.

Run on the GPU machine: ``python -m pytest tests/ops/test_ctc_loss_cuda.py -q``.
"""

import pytest
import torch
import torch.nn.functional as F

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("cuda_kernels")]

CASES = {  # name: (T, N, C, max target length, concatenated targets)
    "small": (12, 3, 5, 4, False),
    "speech_T200_N32_C29": (200, 32, 29, 40, False),  # PyTorch's large-problem (atomic) path
    "concatenated": (50, 4, 29, 12, True),
    "large_alphabet": (60, 8, 2000, 20, False),
    "long_targets_strided": (1000, 2, 6, 600, False),  # 2 L + 1 > 1024: target positions strided per thread
    "long_targets_global_beta": (2400, 2, 6, 1600, False),  # double rows past 48 KB: beta from global memory
}


def _case(name, dtype=torch.float32, seed=0, blank=0):
    steps, batch, classes, max_target, concatenated = CASES[name]
    generator = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(steps, batch, classes, device="cuda", dtype=dtype, generator=generator)
    labels = torch.randint(1, classes, (batch, max_target), device="cuda", generator=generator)
    input_lengths = torch.tensor([steps - (b % 4) for b in range(batch)], device="cuda")
    target_lengths = torch.tensor([max(1, max_target - 3 * (b % 3)) for b in range(batch)], device="cuda")
    targets = labels
    if concatenated:
        targets = torch.cat([labels[b, : target_lengths[b]] for b in range(batch)])
    return logits, targets, input_lengths, target_lengths


def _grad(logits, targets, input_lengths, target_lengths, reduction="mean", zero_infinity=False, blank=0):
    leaf = logits.detach().clone().requires_grad_()
    loss = F.ctc_loss(
        leaf.log_softmax(2), targets, input_lengths, target_lengths, blank=blank, reduction=reduction,
        zero_infinity=zero_infinity,
    )  # fmt: skip
    loss.sum().backward()
    return loss.detach(), leaf.grad


def _oracle(logits, targets, input_lengths, target_lengths, **kwargs):
    loss, grad = _grad(logits.double().cpu(), targets.cpu(), input_lengths.cpu(), target_lengths.cpu(), **kwargs)
    return loss, grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_oracle_and_pytorch_and_repeats_bitwise(name, dtype, deterministic_routing):
    inputs = _case(name, dtype)
    loss, ours = _grad(*inputs)
    for _ in range(20):
        assert torch.equal(_grad(*inputs)[1], ours)
    assert torch.isfinite(loss).all() and torch.isfinite(ours).all()
    _, oracle = _oracle(*inputs)
    torch.use_deterministic_algorithms(False)
    _, theirs = _grad(*inputs)  # PyTorch's own CUDA backward
    scale = oracle.abs().max().item()
    floor = (1e-6 if dtype == torch.float32 else 1e-12) * scale
    # Log-space recursions over T steps lose ~T ulps in either kernel: ours must be as close as PyTorch's.
    their_error = (theirs.double().cpu() - oracle).abs().max().item()
    our_error = (ours.double().cpu() - oracle).abs().max().item()
    assert our_error <= 2 * their_error + floor, (our_error, their_error)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("zero_infinity", [False, True])
def test_reductions_and_infinite_losses(reduction, zero_infinity, deterministic_routing):
    logits, targets, input_lengths, target_lengths = _case("concatenated")
    input_lengths = input_lengths.clone()
    input_lengths[1] = 5  # shorter than the target: infinite loss
    loss, ours = _grad(logits, targets, input_lengths, target_lengths, reduction, zero_infinity)
    oracle_loss, oracle = _oracle(logits, targets, input_lengths, target_lengths, reduction=reduction,
                                  zero_infinity=zero_infinity)  # fmt: skip
    torch.use_deterministic_algorithms(False)
    _, theirs = _grad(logits, targets, input_lengths, target_lengths, reduction, zero_infinity)  # PyTorch's kernel
    torch.use_deterministic_algorithms(True)
    ours, theirs = ours.double().cpu(), theirs.double().cpu()
    # The infinite loss (zero_infinity=False) makes the same entries non-finite as in the oracle.
    finite = oracle.isfinite()
    assert torch.equal(ours.isfinite(), finite)
    # "sum"/"none" gradients are not divided by target length and batch: compare with PyTorch's own error.
    their_error = (theirs - oracle)[finite & theirs.isfinite()].abs().max().item()
    our_error = (ours - oracle)[finite].abs().max().item()
    assert our_error <= 2 * their_error + 1e-6 * oracle[finite].abs().max().item(), (our_error, their_error)
    if zero_infinity:
        assert torch.all(ours[:, 1] == 0)
        assert torch.isfinite(ours).all()


def test_int32_targets_and_blank_last(deterministic_routing):
    logits, targets, input_lengths, target_lengths = _case("small")
    blank = logits.shape[2] - 1
    targets = (targets - 1).int()  # labels 0 .. C - 2, the blank is C - 1
    _, ours = _grad(logits, targets, input_lengths, target_lengths, blank=blank)
    _, oracle = _oracle(logits, targets.long(), input_lengths, target_lengths, blank=blank)
    torch.testing.assert_close(ours.double().cpu(), oracle, rtol=0, atol=1e-5)


def test_pytorch_refuses_without_the_route(cuda_kernels):
    from deepep_lightning.ops import refused_ops_routing

    torch.use_deterministic_algorithms(True)
    with refused_ops_routing(False), pytest.raises(RuntimeError, match="does not have a deterministic implementation"):
        _grad(*_case("speech_T200_N32_C29"))
    with refused_ops_routing():
        _grad(*_case("speech_T200_N32_C29"))


def test_a_sample_does_not_depend_on_the_batch(deterministic_routing):
    logits, targets, input_lengths, target_lengths = _case("speech_T200_N32_C29")
    _, whole = _grad(logits, targets, input_lengths, target_lengths, reduction="sum")
    _, alone = _grad(logits[:, 5:6], targets[5:6], input_lengths[5:6], target_lengths[5:6], reduction="sum")
    assert torch.equal(alone, whole[:, 5:6])


def test_under_torch_compile(deterministic_routing):
    inputs = _case("speech_T200_N32_C29")
    _, eager = _grad(*inputs)
    compiled = torch.compile(_grad)
    _, first = compiled(*inputs)
    _, again = compiled(*inputs)
    assert torch.equal(again, first)
    torch.testing.assert_close(first, eager, rtol=1e-5, atol=1e-6)


def test_tensor_overload_in_a_cuda_graph(deterministic_routing):
    """``_ctc_loss_backward.Tensor`` with lengths on the GPU: no host sync, so it captures."""
    logits, targets, input_lengths, target_lengths = _case("speech_T200_N32_C29")
    log_probs = logits.log_softmax(2)
    nll, log_alpha = torch.ops.aten._ctc_loss.Tensor(log_probs, targets, input_lengths, target_lengths, 0, False)
    grad = torch.ones_like(nll)
    args = (grad, log_probs, targets, input_lengths, target_lengths, nll, log_alpha, 0, False)
    eager = torch.ops.aten._ctc_loss_backward.Tensor(*args)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.ops.aten._ctc_loss_backward.Tensor(*args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = torch.ops.aten._ctc_loss_backward.Tensor(*args)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
    grad.mul_(0.5)
    graph.replay()
    torch.testing.assert_close(captured, eager * 0.5)
