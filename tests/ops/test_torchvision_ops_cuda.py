"""GPU tests of the deterministic torchvision backwards (deepep_lightning/ops/roi_align.py, roi_pool.py,
ps_roi_align.py, ps_roi_pool.py, deform_conv2d.py): torchvision's CUDA kernels agree to rounding, repeats are
bitwise equal, images do not affect each other, plain deterministic mode refuses what the routes serve, and
the routed roi_align and deform_conv2d backwards run under torch.compile and in a CUDA graph."""

import pytest
import torch

pytest.importorskip("torchvision")
import torchvision.ops  # noqa: E402

from tests.ops._roi_oracle import roi_align_backward_oracle  # noqa: E402

pytestmark = pytest.mark.gpu

ROI_ALIGN_MODULE = __import__("sys").modules["torchvision.ops.roi_align"]


def _features_and_boxes(dtype=torch.float32, images=2, rois_per_image=128, channels=64, size=(50, 84), seed=0):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    features = torch.randn(images, channels, *size, device="cuda", dtype=dtype, generator=generator)
    scale = 1 / 8  # boxes in image pixels of a 400 x 672 input
    boxes = []
    for _ in range(images):
        xy = torch.rand(rois_per_image, 2, device="cuda", generator=generator) * torch.tensor(
            [672.0, 400.0], device="cuda"
        )
        wh = torch.rand(rois_per_image, 2, device="cuda", generator=generator) * 300 + 4
        boxes.append(torch.cat([xy, xy + wh], dim=1).to(dtype))
    return features, boxes, scale


def _grad(features, boxes, scale, output_size=7, sampling_ratio=2, aligned=False):
    features = features.detach().requires_grad_(True)
    out = torchvision.ops.roi_align(features, boxes, output_size, scale, sampling_ratio, aligned)
    # a gradient per RoI that does not depend on the other images' RoIs (batch independence compares them)
    weights = torch.linspace(-1, 1, out[0].numel(), device=out.device, dtype=out.dtype).view_as(out[0])
    (grad,) = torch.autograd.grad((out * weights).sum(), features)
    return grad


@pytest.mark.parametrize("aligned", [False, True])
@pytest.mark.parametrize("sampling_ratio, output_size", [(2, 7), (-1, 14), (0, 7)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_roi_align_matches_torchvision_cuda_kernel(cuda_kernels, dtype, sampling_ratio, output_size, aligned):
    features, boxes, scale = _features_and_boxes(dtype)
    expected = _grad(features, boxes, scale, output_size, sampling_ratio, aligned)  # torchvision's atomic kernel
    from deepep_lightning.ops import refused_ops_routing

    torch.use_deterministic_algorithms(True)
    with refused_ops_routing():
        routed = _grad(features, boxes, scale, output_size, sampling_ratio, aligned)
    tolerance = {torch.float64: 1e-10, torch.float32: 1e-4}[dtype]
    torch.testing.assert_close(routed, expected, rtol=tolerance, atol=tolerance)


def test_half_precision_roi_align_is_left_to_torchvision_on_cuda(cuda_kernels):
    from deepep_lightning.ops.roi_align import roi_align_backward_unsupported_reason

    grad = torch.ones(4, 8, 7, 7, device="cuda", dtype=torch.float16)
    rois = torch.zeros(4, 5, device="cuda", dtype=torch.float16)
    assert "left to torchvision" in roi_align_backward_unsupported_reason(
        grad, rois, 0.125, 7, 7, 1, 8, 50, 84, 2, False
    )
    assert (
        roi_align_backward_unsupported_reason(grad.float(), rois.float(), 0.125, 7, 7, 1, 8, 50, 84, 2, False) is None
    )


def test_roi_align_matches_the_float64_oracle(cuda_kernels):
    from deepep_lightning.ops.roi_align import roi_align_backward

    features, boxes, scale = _features_and_boxes(torch.float64, rois_per_image=16, channels=5)
    rois = torchvision.ops._utils.convert_boxes_to_roi_format(boxes)
    grad = torch.randn(rois.shape[0], 5, 7, 7, device="cuda", dtype=torch.float64)
    args = (grad, rois, scale, 7, 7, 2, 5, *features.shape[2:], -1, True)
    torch.testing.assert_close(
        roi_align_backward(*args).cpu(), roi_align_backward_oracle(*args), rtol=1e-12, atol=1e-12
    )


def test_roi_align_backward_is_bitwise_reproducible_and_batch_independent(deterministic_routing, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("torchvision's pure-PyTorch _roi_align ran: the dispatcher path was bypassed")

    monkeypatch.setattr(ROI_ALIGN_MODULE, "_roi_align", refuse)
    features, boxes, scale = _features_and_boxes(rois_per_image=512, channels=256, size=(100, 168))
    first = _grad(features, boxes, scale)
    for _ in range(19):
        assert torch.equal(first, _grad(features, boxes, scale))
    alone = _grad(features[:1], boxes[:1], scale)  # image 0 without image 1's RoIs
    assert torch.equal(alone, first[:1])


def test_plain_deterministic_mode_refuses_the_torchvision_kernel(cuda_kernels):
    features, boxes, scale = _features_and_boxes(rois_per_image=8)
    rois = torchvision.ops._utils.convert_boxes_to_roi_format(boxes)
    grad = torch.ones(rois.shape[0], 64, 7, 7, device="cuda")
    torch.use_deterministic_algorithms(True)
    with pytest.raises(RuntimeError, match="deterministic"):
        torch.ops.torchvision._roi_align_backward(grad, rois, scale, 7, 7, 2, 64, 50, 84, 2, False)
    from deepep_lightning.ops import refused_ops_routing

    with refused_ops_routing():
        torch.ops.torchvision._roi_align_backward(grad, rois, scale, 7, 7, 2, 64, 50, 84, 2, False)


def test_roi_align_backward_under_torch_compile(deterministic_routing):
    features, boxes, scale = _features_and_boxes(rois_per_image=32)
    rois = torchvision.ops._utils.convert_boxes_to_roi_format(boxes)

    def loss(x):
        return torchvision.ops.roi_align(x, rois, 7, scale, 2).square().sum()

    compiled = torch.compile(loss, fullgraph=False)
    eager_input = features.detach().requires_grad_(True)
    (eager,) = torch.autograd.grad(loss(eager_input), eager_input)
    compiled_input = features.detach().requires_grad_(True)
    (traced,) = torch.autograd.grad(compiled(compiled_input), compiled_input)
    torch.testing.assert_close(traced, eager, rtol=1e-5, atol=1e-5)


def _replayed(step):
    """``step()``'s outputs from one replay of a CUDA graph that captured it (after two warm-up calls)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_outputs = step()
    graph.replay()
    return static_outputs


def test_roi_align_backward_in_a_cuda_graph(deterministic_routing):
    features, boxes, scale = _features_and_boxes(rois_per_image=64)
    rois = torchvision.ops._utils.convert_boxes_to_roi_format(boxes)
    static_input = features.detach().clone().requires_grad_(True)

    def step():
        out = torchvision.ops.roi_align(static_input, rois, 7, scale, 2)
        return torch.autograd.grad(out.square().sum(), static_input)[0]

    assert torch.equal(_replayed(step), step())


def _pool_grads(op, features, rois, **kwargs):
    features = features.detach().requires_grad_(True)
    out = op(features, rois, **kwargs)
    weights = torch.linspace(-1, 1, out.numel(), device=out.device, dtype=out.dtype).view_as(out)
    return torch.autograd.grad((out * weights).sum(), features)[0]


@pytest.mark.parametrize(
    "name, kwargs",
    [
        ("roi_pool", {"output_size": 7, "spatial_scale": 1 / 8}),
        ("ps_roi_pool", {"output_size": 3, "spatial_scale": 1 / 8}),
        ("ps_roi_align", {"output_size": 3, "spatial_scale": 1 / 8, "sampling_ratio": 2}),
        ("ps_roi_align", {"output_size": 3, "spatial_scale": 1 / 8, "sampling_ratio": -1}),
    ],
)
def test_pooling_backwards_match_torchvision_and_repeat_bitwise(cuda_kernels, name, kwargs):
    from deepep_lightning.ops import refused_ops_routing

    op = getattr(torchvision.ops, name)
    features, boxes, _ = _features_and_boxes(channels=63 if name.startswith("ps_") else 64, rois_per_image=256)
    rois = torchvision.ops._utils.convert_boxes_to_roi_format(boxes)
    expected = _pool_grads(op, features, rois, **kwargs)
    torch.use_deterministic_algorithms(True)
    with pytest.raises(RuntimeError, match="deterministic"):  # plain deterministic mode refuses these
        _pool_grads(op, features, rois, **kwargs)
        torch.cuda.synchronize()
    with refused_ops_routing():
        first = _pool_grads(op, features, rois, **kwargs)
        for _ in range(19):
            assert torch.equal(first, _pool_grads(op, features, rois, **kwargs))
    torch.testing.assert_close(first, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "dtype, offset_groups, with_mask", [(torch.float32, 1, True), (torch.float32, 2, False), (torch.float64, 1, True)]
)
def test_deform_conv2d_backward_matches_torchvision_and_repeats_bitwise(cuda_kernels, dtype, offset_groups, with_mask):
    """DCNv2 at a ResNet-50 stage-3 shape (256 channels, 28 x 28, 3 x 3)."""
    from deepep_lightning.ops import refused_ops_routing

    generator = torch.Generator(device="cuda").manual_seed(0)
    options = dict(device="cuda", dtype=dtype)
    input = torch.randn(4, 256, 28, 28, generator=generator, **options)
    weight = torch.randn(256, 256, 3, 3, generator=generator, **options) * 0.02
    offset = torch.randn(4, 2 * offset_groups * 9, 28, 28, generator=generator, **options) * 2
    mask = torch.rand(4, offset_groups * 9, 28, 28, generator=generator, **options) if with_mask else None

    def grads():
        leaves = [t.detach().requires_grad_(True) for t in (input, offset, weight)]
        out = torchvision.ops.deform_conv2d(leaves[0], leaves[1], leaves[2], padding=1, mask=mask)
        return torch.autograd.grad(out.square().sum(), leaves)

    expected = grads()
    torch.use_deterministic_algorithms(True)
    with pytest.raises(RuntimeError, match="deterministic"):  # plain deterministic mode refuses it
        grads()
    with refused_ops_routing():
        first = grads()
        for _ in range(19):
            assert all(torch.equal(a, b) for a, b in zip(first, grads()))
    tolerance = 1e-3 if dtype == torch.float32 else 1e-9
    for mine, theirs in zip(first, expected):
        torch.testing.assert_close(mine, theirs, rtol=tolerance, atol=tolerance)


def _deform_case(images=2, channels=64, size=(20, 24)):
    generator = torch.Generator(device="cuda").manual_seed(0)
    input = torch.randn(images, channels, *size, device="cuda", generator=generator)
    weight = torch.randn(channels, channels, 3, 3, device="cuda", generator=generator) * 0.05
    offset = torch.randn(images, 18, *size, device="cuda", generator=generator) * 2
    mask = torch.rand(images, 9, *size, device="cuda", generator=generator)
    return input, weight, offset, mask


def _deform_loss(input, weight, offset, mask):
    return torchvision.ops.deform_conv2d(input, offset, weight, padding=1, mask=mask).square().sum()


def test_deform_conv2d_backward_under_torch_compile(deterministic_routing):
    tensors = _deform_case()
    compiled = torch.compile(_deform_loss, fullgraph=False)
    grads = []
    for loss in (_deform_loss, compiled):
        leaves = [t.detach().requires_grad_(True) for t in tensors]
        grads.append(torch.autograd.grad(loss(*leaves), leaves))
    for traced, eager in zip(grads[1], grads[0]):
        torch.testing.assert_close(traced, eager, rtol=1e-5, atol=1e-5)


def test_deform_conv2d_backward_in_a_cuda_graph(deterministic_routing):
    """The routed backward, matmuls, sort and gather included, captures; replays give the eager bits.
    Only the backward is captured: torchvision's forward launches its kernels on the legacy default stream."""
    input, weight, offset, mask = _deform_case()
    out = torchvision.ops.deform_conv2d(input, offset, weight, padding=1, mask=mask)
    args = (2 * out, input, weight, offset, mask, torch.zeros(weight.shape[0], device="cuda"))
    args += (1, 1, 1, 1, 1, 1, 1, 1, True)

    def step():
        return torch.ops.torchvision._deform_conv2d_backward(*args)

    for replayed, eager in zip(_replayed(step), step()):
        assert torch.equal(replayed, eager)
