"""The tile gathers of roi_pool's, ps_roi_pool's and ps_roi_align's backwards (extensions/csrc/roi_tiles.h).

Every grad_input element is one float sum of its terms in torchvision's CPU order (RoI, then bin, or sample and
corner),
so in float32 and float64 the result is torchvision's CPU kernel's, bit for bit; the negative control shows
that those bits depend on the order (torchvision's own kernel with the RoIs reversed gives others), so the
equality is not a tolerance in disguise. The cases cross the kernels' edges: more RoIs than a step lists
(256), more channels than an item sums (16), planes that are not whole tiles, many planes, boxes of no image of
the batch, degenerate boxes. 16-bit gradients are summed in float and rounded once. On the GPU (marked): the CUDA
kernel gives the CPU bits, repeats them and runs inside CUDA-graph capture, and roi_pool's backward reads the
CUDA forward's argmax as torchvision's CPU backward does.
"""

import pytest
import torch

pytest.importorskip("torchvision")
import torchvision.ops  # noqa: E402, F401 - registers torchvision's ops

from deepep_lightning.ops import extension_available, ps_roi_align, ps_roi_pool, roi_pool  # noqa: E402, F401 - fakes
from tests.ops._roi_oracle import (  # noqa: E402
    ps_roi_align_backward_oracle,
    ps_roi_pool_backward_oracle,
    roi_pool_backward_oracle,
)

pytestmark = pytest.mark.skipif(not extension_available(), reason="deepep_lightning extension not buildable here")

OPS = ("roi_pool", "ps_roi_pool", "ps_roi_align", "ps_roi_align_adaptive")
SAMPLING = {"ps_roi_align": 2, "ps_roi_align_adaptive": -1}
POOLED = 3


def _case(
    op, dtype=torch.float32, device="cpu", rois=300, channels_out=2, size=(24, 40), batch=2, seed=0, whole_bins=False
):
    """Many overlapping boxes (some beyond the map, some tiny) and a gradient of mixed scales.

    ``whole_bins``: boxes of whole pixels at scale 1/4 whose roi_pool extents are multiples of the bins, so that
    every dtype computes the bins of float64 (16-bit roi_pool, whose argmax comes from a float64 forward).
    """
    generator = torch.Generator().manual_seed(seed)
    height, width = size
    corner = torch.rand(rois, 2, generator=generator) * torch.tensor([width * 4.4, height * 4.4]) - 8
    extent = torch.rand(rois, 2, generator=generator) ** 2 * torch.tensor([width * 3.0, height * 3.0]) + 0.1
    if whole_bins:
        corner = (corner / 4).floor() * 4
        extent = ((extent / 12).floor() * 3 + 2) * 4  # extent / 4 + 1 pixels: a multiple of 3
    image = torch.randint(0, batch, (rois, 1), generator=generator).float()
    boxes = torch.cat([image, corner, corner + extent], dim=1)
    grad = torch.randn(rois, channels_out, POOLED, POOLED, generator=generator, dtype=torch.float64)
    grad = grad * torch.exp2(torch.randint(-6, 6, grad.shape, generator=generator).double())
    planes = 1 if op == "roi_pool" else POOLED * POOLED
    if op == "roi_pool":  # the "mapping" is the forward's argmax
        features = torch.randn(batch, channels_out, height, width, generator=generator, dtype=torch.float64)
        mapping = torch.ops.torchvision.roi_pool(features, boxes.double(), 0.25, POOLED, POOLED)[1]
    else:
        mapping = torch.arange(channels_out * planes, dtype=torch.int32).view(1, channels_out, POOLED, POOLED)
        mapping = mapping.expand(rois, -1, -1, -1).contiguous()
    return {
        "grad": grad.to(dtype).to(device),
        "rois": boxes.to(dtype).to(device),
        "mapping": mapping.to(device),
        "shape": (batch, channels_out * planes, height, width),
    }


def _arguments(case, grad, rois, rows):
    """``case``'s tensors, or those of its RoIs ``rows`` (an index), or another grad/rois."""
    if rows is not None:
        case = {**case, "grad": case["grad"][rows], "rois": case["rois"][rows], "mapping": case["mapping"][rows]}
    return (case["grad"] if grad is None else grad), (case["rois"] if rois is None else rois), case["mapping"]


def _ours(op, case, grad=None, rois=None, rows=None):
    grad, rois, mapping = _arguments(case, grad, rois, rows)
    ops = torch.ops.deepep_lightning
    if op == "roi_pool":
        return ops.roi_pool_backward(grad, rois, mapping, 0.25, *case["shape"])
    if op in SAMPLING:
        return ops.ps_roi_align_backward(grad, rois, mapping, 0.25, POOLED, POOLED, SAMPLING[op], *case["shape"])
    return ops.ps_roi_pool_backward(grad, rois, 0.25, POOLED, POOLED, *case["shape"])


def _torchvision(op, case, grad=None, rois=None, rows=None):
    grad, rois, mapping = _arguments(case, grad, rois, rows)
    ops = torch.ops.torchvision
    if op in SAMPLING:
        return ops._ps_roi_align_backward(grad, rois, mapping, 0.25, POOLED, POOLED, SAMPLING[op], *case["shape"])
    backward = ops._roi_pool_backward if op == "roi_pool" else ops._ps_roi_pool_backward
    return backward(grad, rois, mapping, 0.25, POOLED, POOLED, *case["shape"])


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("channels_out", [2, 18])
def test_gives_torchvision_cpu_kernels_bits(op, dtype, channels_out):
    case = _case(op, dtype, channels_out=channels_out)
    expected = _torchvision(op, case)
    assert expected.abs().sum() > 0
    assert torch.equal(_ours(op, case), expected)
    # negative control: the same terms in another order give other bits
    order = torch.arange(case["grad"].shape[0] - 1, -1, -1)
    assert not torch.equal(_torchvision(op, case, rows=order), expected)


def _oracle(op, case):
    grad, rois, shape = case["grad"], case["rois"], case["shape"]
    if op == "roi_pool":
        return roi_pool_backward_oracle(grad, rois, case["mapping"], *shape)
    if op in SAMPLING:
        return ps_roi_align_backward_oracle(grad, rois, 0.25, POOLED, POOLED, SAMPLING[op], *shape)
    return ps_roi_pool_backward_oracle(grad, rois, 0.25, POOLED, POOLED, *shape)


@pytest.mark.parametrize("op", OPS)
def test_float64_equals_the_pure_pytorch_oracle(op):
    case = _case(op, torch.float64, rois=120, channels_out=3)
    rois = case["rois"].clone()
    rois[::7, 0] = 2.0  # boxes of no image of the batch add nothing
    case = {**case, "rois": rois}
    expected = _oracle(op, case)
    assert expected.abs().sum() > 0
    torch.testing.assert_close(_ours(op, case), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_sums_in_float_and_rounds_once(op, dtype):
    case = _case(op, dtype, whole_bins=op == "roi_pool")
    exact = _torchvision(op, {**case, "grad": case["grad"].double(), "rois": case["rois"].double()})
    ours = _ours(op, case)
    assert ours.dtype == dtype
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(ours.double(), exact, rtol=8 * eps, atol=8 * eps * exact.abs().max())


@pytest.mark.parametrize("op", OPS)
def test_non_finite_terms_give_torchvision_cpu_kernels_values(op):
    case = _case(op, rois=60)
    flat = case["grad"].view(-1)
    flat[0], flat[1], flat[7], flat[flat.numel() // 2] = float("nan"), float("inf"), float("-inf"), float("inf")
    ours, theirs = _ours(op, case), _torchvision(op, case)
    assert ours.isnan().any() and ours.isinf().any()
    assert torch.equal(ours.nan_to_num(), theirs.nan_to_num()) and torch.equal(ours.isnan(), theirs.isnan())


@pytest.mark.parametrize("op", OPS)
def test_boxes_of_no_image_add_nothing(op):
    case = _case(op, rois=40)
    rois = case["rois"].clone()
    rois[::3, 0] = 2.0  # the batch holds images 0 and 1
    rois[1::3, 0] = -1.0
    kept = (rois[:, 0] >= 0) & (rois[:, 0] < 2)
    assert torch.equal(_ours(op, case, rois=rois), _torchvision(op, case, rows=kept))


EDGES = {
    "one_pixel": {"size": (1, 1), "rois": 20},
    "narrow": {"size": (3, 11), "rois": 20},
    "a_tile_and_one": {"size": (9, 33), "rois": 20},
    "one_row_of_tiles": {"size": (1, 70), "rois": 20},
    "one_roi": {"size": (20, 20), "rois": 1},
    "one_image": {"size": (17, 23), "rois": 20, "batch": 1},
    "many_channels": {"size": (2, 3), "rois": 8, "channels_out": 300},
    "large_plane": {"size": (200, 300), "rois": 60},
}


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("edge", EDGES)
def test_edge_shapes_give_torchvision_cpu_kernels_bits(op, edge):
    case = _case(op, **EDGES[edge])
    assert torch.equal(_ours(op, case), _torchvision(op, case))


@pytest.mark.parametrize("op", OPS)
def test_empty_inputs_and_opcheck(op):
    case = _case(op, rois=12)
    assert torch.equal(_ours(op, case, rows=slice(0, 0)), torch.zeros(case["shape"]))
    no_image = {**case, "shape": (0, *case["shape"][1:])}
    assert _ours(op, no_image).shape == (0, *case["shape"][1:])
    if op == "roi_pool":
        args = (case["grad"], case["rois"], case["mapping"], 0.25, *case["shape"])
        torch.library.opcheck(torch.ops.deepep_lightning.roi_pool_backward.default, args)
        return
    if op in SAMPLING:
        args = (case["grad"], case["rois"], case["mapping"], 0.25, POOLED, POOLED, SAMPLING[op], *case["shape"])
        torch.library.opcheck(torch.ops.deepep_lightning.ps_roi_align_backward.default, args)
    else:
        args = (case["grad"], case["rois"], 0.25, POOLED, POOLED, *case["shape"])
        torch.library.opcheck(torch.ops.deepep_lightning.ps_roi_pool_backward.default, args)


def test_direct_callers_get_the_ops_checks():
    case = _case("ps_roi_pool", rois=4)
    with pytest.raises(RuntimeError, match="ps_roi_pool_backward: batch_size, height, width must be >= 0 and channels"):
        torch.ops.deepep_lightning.ps_roi_pool_backward(case["grad"], case["rois"], 0.25, POOLED, POOLED, 2, 17, 24, 40)
    with pytest.raises(RuntimeError, match="ps_roi_align_backward: rois must be \\[K, 5\\]"):
        torch.ops.deepep_lightning.ps_roi_align_backward(
            case["grad"], case["rois"][:2], case["mapping"], 0.25, POOLED, POOLED, 2, *case["shape"]
        )


def _to_cuda(case):
    return {key: value.cuda() if isinstance(value, torch.Tensor) else value for key, value in case.items()}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
def test_gpu_cuda_gives_the_cpu_bits_and_repeats_them(op, dtype):
    case = _case(op, dtype, rois=1000, channels_out=21, size=(50, 84))
    on_cpu = _ours(op, case)
    on_cuda = _to_cuda(case)
    first = _ours(op, on_cuda)
    assert torch.equal(first.cpu(), on_cpu)
    for _ in range(19):
        assert torch.equal(_ours(op, on_cuda), first)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("edge", EDGES)
def test_gpu_edge_shapes_give_the_cpu_bits(op, edge):
    case = _case(op, **EDGES[edge])
    assert torch.equal(_ours(op, _to_cuda(case)).cpu(), _ours(op, case))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gpu_roi_pool_reads_the_cuda_forwards_argmax(dtype):
    # the argmax of torchvision's CUDA forward, in the dtype's own bin geometry: every term lands where
    # torchvision's atomic backward puts it (a term the tile gather missed would be off by a whole gradient)
    generator = torch.Generator().manual_seed(3)
    features = torch.randn(2, 64, 50, 84, generator=generator).to(dtype).cuda()
    case = _case("roi_pool", dtype, rois=1000, channels_out=64, size=(50, 84))
    rois = case["rois"].cuda()
    out, argmax = torch.ops.torchvision.roi_pool(features, rois, 0.25, POOLED, POOLED)
    grad = torch.randn(out.shape, generator=generator).to(dtype).cuda()
    ours = torch.ops.deepep_lightning.roi_pool_backward(grad, rois, argmax, 0.25, 2, 64, 50, 84)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(False)
    try:
        theirs = torch.ops.torchvision._roi_pool_backward(grad, rois, argmax, 0.25, POOLED, POOLED, 2, 64, 50, 84)
    finally:
        torch.use_deterministic_algorithms(was)
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(ours.float(), theirs.float(), rtol=8 * eps, atol=8 * eps * theirs.abs().max().item())
    if dtype == torch.float32:  # and torchvision's CPU backward, in RoI order, gives the same bits
        cpu = torch.ops.torchvision._roi_pool_backward(
            grad.cpu(), rois.cpu(), argmax.cpu(), 0.25, POOLED, POOLED, 2, 64, 50, 84
        )
        assert torch.equal(ours.cpu(), cpu)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("op", OPS)
def test_gpu_runs_inside_cuda_graph_capture(op):
    case = _to_cuda(_case(op))
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
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
