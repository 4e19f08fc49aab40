"""CPU tests of the deterministic deform_conv2d backward (deepep_lightning/ops/deform_conv2d.py): its input,
weight, offset and mask gradients (deepep_lightning::deform_conv2d_grad_input and deform_conv2d_sample_grads
between two matmuls) match a float64 oracle and torchvision's CPU kernel, over one chunk of images and
several, bad arguments are refused in Python, and the route on ``torchvision::_deform_conv2d_backward``
(installed at the CPU key here) serves ``deform_conv2d`` in deterministic mode only."""

import dataclasses

import pytest
import torch

pytest.importorskip("torchvision")
import torchvision.ops  # noqa: E402

from deepep_lightning.ops import _routes, extension_available, routed_aten_ops  # noqa: E402
from deepep_lightning.ops.deform_conv2d import deform_conv2d_backward  # noqa: E402
from tests.ops._roi_oracle import deform_conv2d_oracle  # noqa: E402

pytestmark = pytest.mark.skipif(not extension_available(), reason="deepep_lightning extension not buildable here")

ROUTE = "torchvision::_deform_conv2d_backward"


@pytest.fixture(autouse=True)
def _restore_global_state():
    was = torch.are_deterministic_algorithms_enabled()
    yield
    _routes.disable_routes()
    torch.use_deterministic_algorithms(was)


def _case(offset_groups=2, use_mask=True, dtype=torch.float64, stride=1, padding=1, dilation=1, seed=0, batch=2):
    generator = torch.Generator().manual_seed(seed)
    channels, out_channels, height, width, kernel = 4, 3, 7, 9, 3
    input = torch.randn(batch, channels, height, width, generator=generator, dtype=dtype)
    weight = torch.randn(out_channels, channels, kernel, kernel, generator=generator, dtype=dtype)
    out_h = (height + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1
    out_w = (width + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1
    # offsets up to 3 pixels: samples leave the map, a few land on integers (corners dropped)
    offset = (
        torch.randn(batch, 2 * offset_groups * kernel * kernel, out_h, out_w, generator=generator, dtype=dtype) * 1.5
    )
    offset[:, :, 0, 0] = 1.0
    mask = torch.rand(batch, offset_groups * kernel * kernel, out_h, out_w, generator=generator, dtype=dtype)
    return input, weight, offset, (mask if use_mask else None), stride, padding, dilation, offset_groups


def _backward_args(input, weight, offset, mask, stride, padding, dilation, offset_groups, grad, groups=1):
    use_mask = mask is not None
    mask_arg = mask if use_mask else torch.zeros(input.shape[0], 1, dtype=input.dtype)  # as torchvision passes it
    bias = torch.zeros(weight.shape[0], dtype=input.dtype)
    return (
        grad,
        input,
        weight,
        offset,
        mask_arg,
        bias,
        stride,
        stride,
        padding,
        padding,
        dilation,
        dilation,
        groups,
        offset_groups,
        use_mask,
    )


@pytest.mark.parametrize("offset_groups, use_mask, stride, dilation", [(2, True, 1, 1), (1, False, 2, 2)])
def test_gradients_match_the_float64_oracle_and_torchvision_cpu(offset_groups, use_mask, stride, dilation):
    input, weight, offset, mask, *rest = _case(offset_groups, use_mask, stride=stride, dilation=dilation)
    leaves = [t.clone().requires_grad_(True) for t in (input, weight, offset)]
    mask_leaf = mask.clone().requires_grad_(True) if use_mask else None
    out = deform_conv2d_oracle(*leaves, mask_leaf, *rest)
    grad = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(1))
    expected = torch.autograd.grad(out, leaves + ([mask_leaf] if use_mask else []), grad)
    args = _backward_args(input, weight, offset, mask, *rest, grad)
    ours = deform_conv2d_backward(*args)
    theirs = torch.ops.torchvision._deform_conv2d_backward(*args)
    mine = (ours[0], ours[1], ours[2]) + ((ours[3],) if use_mask else ())
    for name, value, oracle in zip(("input", "weight", "offset", "mask"), mine, expected):
        torch.testing.assert_close(value, oracle, rtol=1e-12, atol=1e-12, msg=lambda m, name=name: f"grad {name}: {m}")
    for value, torchvision_grad in zip(ours, theirs):
        torch.testing.assert_close(value, torchvision_grad, rtol=1e-10, atol=1e-10)


def test_batches_past_one_chunk_and_weight_groups_match_torchvision_cpu():
    """34 images go in two chunks of 17 (torchvision's n_parallel_imgs); two weight groups."""
    input, weight, offset, mask, *rest = _case(offset_groups=2, batch=34)
    weight = weight[:, :2].repeat(2, 1, 1, 1)[:4].contiguous()  # 4 output channels, 2 input channels per group
    grad = torch.randn(34, 4, 7, 9, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    args = _backward_args(input, weight, offset, mask, *rest, grad, groups=2)
    for value, torchvision_grad in zip(
        deform_conv2d_backward(*args), torch.ops.torchvision._deform_conv2d_backward(*args)
    ):
        torch.testing.assert_close(value, torchvision_grad, rtol=1e-10, atol=1e-10)


def test_an_empty_batch_and_non_contiguous_inputs_match_torchvision_cpu():
    input, weight, offset, mask, *rest = _case(batch=0)
    args = _backward_args(input, weight, offset, mask, *rest, torch.zeros(0, 3, 7, 9, dtype=torch.float64))
    for mine, theirs in zip(deform_conv2d_backward(*args), torch.ops.torchvision._deform_conv2d_backward(*args)):
        assert mine.shape == theirs.shape and torch.equal(mine, theirs)
    input, weight, offset, mask, *rest = _case()
    grad = torch.randn(2, 3, 7, 9, dtype=torch.float64, generator=torch.Generator().manual_seed(3))

    def strided(tensor):  # the same values, W-major strides
        return tensor.transpose(-1, -2).contiguous().transpose(-1, -2)

    channels_last = input.to(memory_format=torch.channels_last)
    args = _backward_args(channels_last, strided(weight), strided(offset), strided(mask), *rest, strided(grad))
    assert not any(t.is_contiguous() for t in (args[0], args[1], args[2], args[3], args[4]))
    for mine, theirs in zip(deform_conv2d_backward(*args), torch.ops.torchvision._deform_conv2d_backward(*args)):
        torch.testing.assert_close(mine, theirs, rtol=1e-10, atol=1e-10)


def test_opcheck_and_bad_arguments():
    input, weight, offset, mask, *rest = _case()
    grad = torch.randn(2, 3, 7, 9, dtype=torch.float64)
    args = _backward_args(input, weight, offset, mask, *rest, grad)
    columns = torch.randn(4, 9, 2, 63, dtype=torch.float64)  # [C, K, N, L]
    torch.library.opcheck(
        torch.ops.deepep_lightning.deform_conv2d_grad_input.default,
        (columns, offset, mask, 7, 9, 3, 3, 1, 1, 1, 1, 1, 1, 2, True),
    )
    torch.library.opcheck(
        torch.ops.deepep_lightning.deform_conv2d_sample_grads.default,
        (columns, input, offset, mask, 3, 3, 1, 1, 1, 1, 1, 1, 2, True),
    )
    bad = list(args)
    bad[3] = offset[:, :4]
    with pytest.raises(ValueError, match=r"deform_conv2d_backward: grad .* / offset \(2, 4, 7, 9\) do not match"):
        deform_conv2d_backward(*bad)
    bad = list(args)
    bad[13] = 3
    with pytest.raises(ValueError, match="do not split into groups 1 / offset_groups 3"):
        deform_conv2d_backward(*bad)


def test_route_serves_deform_conv2d_in_deterministic_mode_only(monkeypatch):
    assert ROUTE in routed_aten_ops()
    calls = []
    route = _routes.registered_routes()[ROUTE]
    monkeypatch.setitem(
        _routes._routes,
        ROUTE,
        dataclasses.replace(route, deterministic=lambda *a: calls.append(1) or route.deterministic(*a)),
    )
    input, weight, offset, mask, *_ = _case(dtype=torch.float32)
    leaves = [t.clone().requires_grad_(True) for t in (input, weight, offset, mask)]

    def grads():
        out = torchvision.ops.deform_conv2d(leaves[0], leaves[2], leaves[1], padding=1, mask=leaves[3])
        return torch.autograd.grad(out.square().sum(), leaves)

    expected = grads()
    _routes.enable_routes("CPU")
    grads()
    assert calls == []  # negative control: outside deterministic mode torchvision's kernel runs
    torch.use_deterministic_algorithms(True)
    routed = grads()
    assert calls == [1]
    assert torch.are_deterministic_algorithms_enabled()
    for mine, theirs in zip(routed, expected):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
