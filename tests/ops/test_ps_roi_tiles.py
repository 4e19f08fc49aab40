"""The tile gathers of ps_roi_pool's and ps_roi_align's backwards (extensions/csrc/ps_roi_tiles.h).

Every grad_input element is one float sum of its terms in torchvision's CPU order (RoI, then sample and corner),
so in float32 and float64 the result is torchvision's CPU kernel's, bit for bit; the negative control shows
that those bits depend on the order (torchvision's own kernel with the RoIs reversed gives others), so the
equality is not a tolerance in disguise. The cases cross the kernels' edges: more RoIs than a step lists
(256), more output channels than an item sums (16), planes that are not whole tiles, boxes of no image of the
batch, degenerate boxes. 16-bit gradients are summed in float and rounded once. On the GPU (marked): the CUDA
kernel gives the CPU bits, repeats them and runs inside CUDA-graph capture.
"""

import pytest
import torch

pytest.importorskip("torchvision")
import torchvision.ops  # noqa: E402, F401 - registers torchvision's ops

from deepep_lightning.ops import extension_available, ps_roi_align, ps_roi_pool  # noqa: E402, F401 - their fakes

pytestmark = pytest.mark.skipif(not extension_available(), reason="deepep_lightning extension not buildable here")

OPS = ("ps_roi_pool", "ps_roi_align", "ps_roi_align_adaptive")
SAMPLING = {"ps_roi_align": 2, "ps_roi_align_adaptive": -1}
POOLED = 3


def _case(op, dtype=torch.float32, device="cpu", rois=300, channels_out=2, size=(24, 40), batch=2, seed=0):
    """Many overlapping boxes (some beyond the map, some tiny, some of no image) and a gradient of mixed scales."""
    generator = torch.Generator().manual_seed(seed)
    height, width = size
    corner = torch.rand(rois, 2, generator=generator) * torch.tensor([width * 4.4, height * 4.4]) - 8
    extent = torch.rand(rois, 2, generator=generator) ** 2 * torch.tensor([width * 3.0, height * 3.0]) + 0.1
    image = torch.randint(0, batch, (rois, 1), generator=generator).float()
    boxes = torch.cat([image, corner, corner + extent], dim=1)
    grad = torch.randn(rois, channels_out, POOLED, POOLED, generator=generator, dtype=torch.float64)
    grad = grad * torch.exp2(torch.randint(-6, 6, grad.shape, generator=generator).double())
    mapping = torch.arange(channels_out * POOLED * POOLED, dtype=torch.int32).view(1, channels_out, POOLED, POOLED)
    return {
        "grad": grad.to(dtype).to(device),
        "rois": boxes.to(dtype).to(device),
        "mapping": mapping.expand(rois, -1, -1, -1).contiguous().to(device),
        "shape": (batch, channels_out * POOLED * POOLED, height, width),
    }


def _run(namespace, op, case, grad=None, rois=None):
    grad = case["grad"] if grad is None else grad
    rois = case["rois"] if rois is None else rois
    if op in SAMPLING:
        backward = getattr(
            namespace, "_ps_roi_align_backward" if namespace is torch.ops.torchvision else "ps_roi_align_backward"
        )
        return backward(grad, rois, case["mapping"], 0.25, POOLED, POOLED, SAMPLING[op], *case["shape"])
    if namespace is torch.ops.torchvision:
        return namespace._ps_roi_pool_backward(grad, rois, case["mapping"], 0.25, POOLED, POOLED, *case["shape"])
    return namespace.ps_roi_pool_backward(grad, rois, 0.25, POOLED, POOLED, *case["shape"])


def _ours(op, case, **kwargs):
    return _run(torch.ops.deepep_lightning, op, case, **kwargs)


def _torchvision(op, case, **kwargs):
    return _run(torch.ops.torchvision, op, case, **kwargs)


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
    assert not torch.equal(_torchvision(op, case, grad=case["grad"][order], rois=case["rois"][order]), expected)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_sums_in_float_and_rounds_once(op, dtype):
    case = _case(op, dtype)
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
    kept = rois[:, 0] >= 0
    kept &= rois[:, 0] < 2
    expected = _torchvision(op, case, grad=case["grad"][kept], rois=case["rois"][kept])
    assert torch.equal(_ours(op, case, rois=rois), expected)


EDGES = {
    "one_pixel": {"size": (1, 1), "rois": 20},
    "narrow": {"size": (3, 11), "rois": 20},
    "a_tile_and_one": {"size": (9, 33), "rois": 20},
    "one_row_of_tiles": {"size": (1, 70), "rois": 20},
    "one_roi": {"size": (20, 20), "rois": 1},
    "one_image": {"size": (17, 23), "rois": 20, "batch": 1},
}


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("edge", EDGES)
def test_edge_shapes_give_torchvision_cpu_kernels_bits(op, edge):
    case = _case(op, **EDGES[edge])
    assert torch.equal(_ours(op, case), _torchvision(op, case))


@pytest.mark.parametrize("op", OPS)
def test_empty_inputs_and_opcheck(op):
    case = _case(op, rois=12)
    empty = {**case, "mapping": case["mapping"][:0]}
    assert torch.equal(_ours(op, empty, grad=case["grad"][:0], rois=case["rois"][:0]), torch.zeros(case["shape"]))
    no_image = {**case, "shape": (0, *case["shape"][1:])}
    assert _ours(op, no_image).shape == (0, *case["shape"][1:])
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
