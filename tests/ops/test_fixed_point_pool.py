"""The fixed-point roi_pool backward (extensions/csrc/roi_fixed_point.cpp, fixed_point_sum.h).

Each sum is exact in fixed-point quanta, so it cannot depend on the order of its terms: reordering the RoIs
leaves every bit in place, where torchvision's float sums (its CPU kernel, in RoI order) change — the negative
control. Against the float64 sum the error stays within float32 rounding; non-finite terms give what a float
sum gives; the chunks of channels (forced here by a large plane) cover every output; the op passes opcheck and
refuses float64 by name. On the GPU (marked): the CUDA kernels give the CPU kernels' bits, repeat bitwise and
run inside CUDA-graph capture.
"""

import pytest
import torch

pytest.importorskip("torchvision")
import torchvision.ops  # noqa: E402, F401 - registers torchvision's ops

from deepep_lightning.ops import extension_available, roi_pool  # noqa: E402, F401 - its fake

pytestmark = pytest.mark.skipif(not extension_available(), reason="deepep_lightning extension not buildable here")

OPS = ("roi_pool",)


def _case(op, dtype=torch.float32, device="cpu", rois=400, channels=None, size=(24, 30), seed=0, spread=12):
    """Many overlapping boxes on a small map (hundreds of terms per pixel) and a gradient of mixed magnitudes."""
    generator = torch.Generator().manual_seed(seed)
    height, width = size
    channels = channels or 4
    corner = torch.rand(rois, 2, generator=generator) * torch.tensor([width * 4.0, height * 4.0])
    extent = torch.rand(rois, 2, generator=generator) * torch.tensor([width * 3.0, height * 3.0]) + 1
    batch = torch.randint(0, 2, (rois, 1), generator=generator).float()
    boxes = torch.cat([batch, corner, corner + extent], dim=1)
    features = torch.randn(2, channels, height, width, generator=generator, dtype=torch.float64)
    out, argmax = torch.ops.torchvision.roi_pool(features, boxes.double(), 0.25, 3, 3)
    grad = torch.randn(out.shape, generator=generator, dtype=torch.float64)
    grad = grad * torch.exp2(torch.randint(-spread, spread, out.shape, generator=generator).double())
    return {
        "grad": grad.to(dtype).to(device),
        "rois": boxes.to(dtype).to(device),
        "argmax": argmax.to(device),
        "shape": (2, channels, height, width),
    }


def _ours(op, case, order=None):
    grad, rois, argmax = case["grad"], case["rois"], case["argmax"]
    if order is not None:
        grad, rois, argmax = grad[order], rois[order], argmax[order]
    return torch.ops.deepep_lightning.roi_pool_backward(grad, rois, argmax, *case["shape"])


def _torchvision(op, case, dtype=None, order=None):
    grad, rois, argmax = case["grad"], case["rois"], case["argmax"]
    if order is not None:
        grad, rois, argmax = grad[order], rois[order], argmax[order]
    if dtype is not None:
        grad, rois = grad.to(dtype), rois.to(dtype)
    backward = getattr(torch.ops.torchvision, f"_{op}_backward")
    return backward(grad, rois, argmax, 0.25, 3, 3, *case["shape"])


@pytest.mark.parametrize("op", OPS)
def test_reordering_the_rois_leaves_every_bit_where_float_sums_change(op):
    case = _case(op)
    order = torch.randperm(case["grad"].shape[0], generator=torch.Generator().manual_seed(1))
    assert torch.equal(_ours(op, case), _ours(op, case, order))
    # negative control: torchvision's CPU kernel sums in RoI order, and its float32 bits follow the order
    assert not torch.equal(_torchvision(op, case), _torchvision(op, case, order=order))


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_equals_the_exact_sum_rounded(op, dtype):
    case = _case(op, dtype, spread=12 if dtype == torch.float32 else 3)
    exact = _torchvision(op, case, dtype=torch.float64)  # the dtype's terms summed in float64
    ours = _ours(op, case)
    assert ours.dtype == dtype and exact.abs().max() > 0
    eps, tiny = torch.finfo(dtype).eps, torch.finfo(dtype).tiny * torch.finfo(dtype).eps
    # the terms are the gradient's values: one rounding of the exact sum (two for 16 bits)
    error = (ours.double() - exact).abs()
    assert (error <= eps * exact.abs() + tiny + exact.abs().max() * 2**-40).all(), error.max()


@pytest.mark.parametrize("op", OPS)
def test_non_finite_terms_give_what_a_float_sum_gives(op):
    case = _case(op, rois=60)
    grad = case["grad"].clone()
    flat = grad.view(-1)
    flat[0], flat[1], flat[7], flat[flat.numel() // 2] = float("nan"), float("inf"), float("-inf"), float("inf")
    case["grad"] = grad
    ours, theirs = _ours(op, case), _torchvision(op, case)
    assert ours.isnan().any() and ours.isinf().any()
    assert torch.equal(ours.isnan(), theirs.isnan())
    assert torch.equal(ours.isposinf(), theirs.isposinf()) and torch.equal(ours.isneginf(), theirs.isneginf())
    finite = ours.isfinite()
    torch.testing.assert_close(ours[finite], theirs[finite], rtol=1e-5, atol=1e-5)


def test_empty_rois_opcheck_and_a_float64_gradient_refused_by_name():
    case = _case("roi_pool", rois=8)
    empty = {**case, "grad": case["grad"][:0], "rois": case["rois"][:0], "argmax": case["argmax"][:0]}
    assert torch.equal(_ours("roi_pool", empty), torch.zeros(case["shape"]))
    args = (case["grad"], case["rois"], case["argmax"], *case["shape"])
    torch.library.opcheck(torch.ops.deepep_lightning.roi_pool_backward.default, args)
    with pytest.raises(RuntimeError, match="roi_pool_backward: grad must be float32, float16 or bfloat16"):
        _ours("roi_pool", {**case, "grad": case["grad"].double(), "rois": case["rois"].double()})


# plane sizes that are not whole flag words or warps, one pixel, more planes than a grid's y extent (65535), and
# a 512 x 512 plane whose sums take 4.7 MB a channel, so its 16 channels go in chunks of 3
EDGE_SHAPES = {
    "chunked": {"rois": 300, "channels": 16, "size": (512, 512)},
    "one_pixel": {"rois": 30, "channels": 4, "size": (1, 1)},
    "odd_plane": {"rois": 30, "channels": 5, "size": (3, 11)},
    "plane_of_33": {"rois": 30, "channels": 3, "size": (1, 33)},
    "many_planes": {"rois": 4, "channels": 33000, "size": (2, 3)},
}


@pytest.mark.parametrize("shape", EDGE_SHAPES)
def test_edge_shapes_equal_the_exact_sum(shape):
    case = _case("roi_pool", **EDGE_SHAPES[shape])
    exact = _torchvision("roi_pool", case, dtype=torch.float64)
    torch.testing.assert_close(_ours("roi_pool", case).double(), exact, rtol=2e-7, atol=1e-9)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", EDGE_SHAPES)
def test_gpu_edge_shapes_give_the_cpu_bits(shape):
    case = _case("roi_pool", **EDGE_SHAPES[shape])
    on_cuda = {key: value.cuda() if isinstance(value, torch.Tensor) else value for key, value in case.items()}
    assert torch.equal(_ours("roi_pool", on_cuda).cpu(), _ours("roi_pool", case))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gpu_cuda_gives_the_cpu_bits_and_repeats_them(op, dtype):
    case = _case(op, dtype, rois=2000, channels=64, size=(50, 84))
    on_cpu = _ours(op, case)
    on_cuda = {key: value.cuda() if isinstance(value, torch.Tensor) else value for key, value in case.items()}
    first = _ours(op, on_cuda)
    assert torch.equal(first.cpu(), on_cpu)
    for _ in range(19):
        assert torch.equal(_ours(op, on_cuda), first)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("op", OPS)
def test_gpu_runs_inside_cuda_graph_capture(op):
    case = {key: value.cuda() if isinstance(value, torch.Tensor) else value for key, value in _case(op).items()}
    eager = _ours(op, case)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _ours(op, case)  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _ours(op, case)
    graph.replay()
    assert torch.equal(captured, eager)
