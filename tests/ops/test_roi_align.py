"""CPU tests of deepep_lightning::roi_align_backward (deepep_lightning/ops/roi_align.py) and of its routes: the float64
oracle and torchvision's CPU kernel agree with it, bad arguments are refused in Python, and routing
``torchvision::_roi_align_backward`` (installed at the CPU key here) and torchvision's Python entry is on in
deterministic mode, off otherwise, and reversible."""

import sys
import types

import pytest
import torch

pytest.importorskip("torchvision")
import torchvision.ops  # noqa: E402
import torchvision.ops.poolers  # noqa: E402

from deepep_lightning.ops import _routes, _torchvision_entry, extension_available, routed_aten_ops  # noqa: E402
from deepep_lightning.ops.roi_align import roi_align_backward  # noqa: E402
from tests.ops._roi_oracle import roi_align_backward_oracle  # noqa: E402

pytestmark = pytest.mark.skipif(not extension_available(), reason="deepep_lightning extension not buildable here")

ROUTE = "torchvision::_roi_align_backward"
ORIGINAL_ROI_ALIGN = vars(sys.modules["torchvision.ops.roi_align"])["roi_align"]


def _rois(generator: torch.Generator, count: int, batch: int, extent: float, dtype=torch.float64) -> torch.Tensor:
    """Boxes over [-4, extent + 4] (some partly outside the map), a few degenerate, in random image order."""
    corners = torch.rand(count, 4, generator=generator, dtype=torch.float64) * (extent + 8) - 4
    x1, x2 = corners[:, 0].minimum(corners[:, 2]), corners[:, 0].maximum(corners[:, 2])
    y1, y2 = corners[:, 1].minimum(corners[:, 3]), corners[:, 1].maximum(corners[:, 3])
    index = torch.randint(0, batch, (count,), generator=generator).double()
    rois = torch.stack([index, x1, y1, x2, y2], dim=1)
    rois[0, 3] = rois[0, 1]  # zero width
    return rois.to(dtype)


def _case(sampling_ratio: int, aligned: bool, dtype=torch.float64, count: int = 9, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    batch, channels, height, width, pooled = 2, 11, 13, 17, (3, 4)
    rois = _rois(generator, count, batch, 2 * width, dtype)
    # non-contiguous grad: a transposed view
    grad = torch.randn(count, channels, pooled[1], pooled[0], generator=generator, dtype=dtype).transpose(2, 3)
    return (grad, rois, 0.5, pooled[0], pooled[1], batch, channels, height, width, sampling_ratio, aligned)


@pytest.fixture(autouse=True)
def _restore_global_state():
    was = torch.are_deterministic_algorithms_enabled()
    yield
    _routes.disable_routes()
    torch.use_deterministic_algorithms(was)


@pytest.mark.parametrize("aligned", [False, True])
@pytest.mark.parametrize("sampling_ratio", [2, 1, -1])
def test_kernel_matches_the_float64_oracle(sampling_ratio, aligned):
    args = _case(sampling_ratio, aligned)
    torch.testing.assert_close(roi_align_backward(*args), roi_align_backward_oracle(*args), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("sampling_ratio", [2, 0])
def test_kernel_matches_torchvision_cpu_kernel_in_float32(sampling_ratio):
    args = _case(sampling_ratio, False, torch.float32, count=40, seed=1)
    expected = torch.ops.torchvision._roi_align_backward(*args)
    torch.testing.assert_close(roi_align_backward(*args), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_narrow_dtypes_accumulate_in_float(dtype):
    args = _case(2, True, dtype)
    expected = roi_align_backward_oracle(*args).to(dtype)
    torch.testing.assert_close(roi_align_backward(*args), expected, rtol=2e-2, atol=2e-2)


def test_chunks_of_a_large_adaptive_rois_add_up():
    """One RoI of ~1.2 M adaptive samples runs in several chunks; their sums add up to the oracle's."""
    rois = torch.tensor([[0.0, 0.0, 0.0, 1100.0, 1100.0], [0.0, 3.0, 2.0, 9.0, 7.0]], dtype=torch.float64)
    grad = torch.randn(2, 2, 7, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    args = (grad, rois, 1 / 32, 7, 7, 1, 2, 40, 36, -1, False)
    torch.testing.assert_close(roi_align_backward(*args), roi_align_backward_oracle(*args), rtol=1e-12, atol=1e-12)


def test_empty_rois_and_repeats_are_bitwise_equal():
    args = _case(-1, False, torch.float32, count=30)
    first = roi_align_backward(*args)
    assert all(torch.equal(first, roi_align_backward(*args)) for _ in range(3))
    empty = (torch.zeros(0, 11, 3, 4), torch.zeros(0, 5), *args[2:])
    assert torch.equal(roi_align_backward(*empty), torch.zeros(2, 11, 13, 17))


def test_opcheck():
    args = _case(2, False, torch.float32)
    torch.library.opcheck(torch.ops.deepep_lightning.roi_align_backward.default, args)


@pytest.mark.parametrize(
    "change, match",
    [
        ({1: torch.zeros(9, 4, dtype=torch.float64)}, "rois of shape"),
        ({0: torch.zeros(9, 11, 3, 4, dtype=torch.int64)}, "dtype"),
        ({3: 0}, "pooled sizes must be positive"),
        ({6: 12}, r"grad of shape .* is not \[K, 12"),
        ({5: 2**20, 7: 2**10, 8: 2**10}, "below 2\\^31"),
    ],
)
def test_bad_arguments_raise_a_value_error_naming_them(change, match):
    args = list(_case(2, False))
    for position, value in change.items():
        args[position] = value
    with pytest.raises(ValueError, match=f"roi_align_backward: .*{match}"):
        roi_align_backward(*args)


def _spy(monkeypatch) -> list[int]:
    """Counts the route's deterministic calls (the registry's route, wrapped)."""
    import dataclasses

    calls: list[int] = []
    route = _routes.registered_routes()[ROUTE]

    def counted(*args):
        calls.append(1)
        return route.deterministic(*args)

    monkeypatch.setitem(_routes._routes, ROUTE, dataclasses.replace(route, deterministic=counted))
    return calls


def test_routes_serve_torchvision_backward_in_deterministic_mode_only(monkeypatch):
    assert ROUTE in routed_aten_ops()
    calls = _spy(monkeypatch)
    generator = torch.Generator().manual_seed(4)
    features = torch.randn(2, 5, 16, 16, generator=generator, requires_grad=True)
    boxes = [torch.tensor([[1.0, 2.0, 9.0, 12.0]]), torch.tensor([[0.0, 0.0, 15.0, 15.0], [4.0, 4.0, 6.0, 5.0]])]
    expected = torch.autograd.grad(torchvision.ops.roi_align(features, boxes, 3, 1.0, -1).sum(), features)[0]

    _routes.enable_routes("CPU")
    torch.autograd.grad(torchvision.ops.roi_align(features, boxes, 3, 1.0, -1).sum(), features)
    assert calls == []  # negative control: outside deterministic mode torchvision's kernel runs
    torch.use_deterministic_algorithms(True)
    routed = torch.autograd.grad(torchvision.ops.roi_align(features, boxes, 3, 1.0, -1).sum(), features)[0]
    assert calls == [1]
    torch.testing.assert_close(routed, expected, rtol=1e-5, atol=1e-6)
    _routes.disable_routes()
    torch.autograd.grad(torchvision.ops.roi_align(features, boxes, 3, 1.0, -1).sum(), features)
    assert calls == [1]  # routing off: torchvision's kernel again


def test_python_entry_reaches_the_dispatcher_while_routed_and_is_restored():
    user_module = types.ModuleType("user_detection_head")
    user_module.pool = ORIGINAL_ROI_ALIGN  # imported by another name
    sys.modules[user_module.__name__] = user_module
    try:
        assert torchvision.ops.roi_align is ORIGINAL_ROI_ALIGN
        _routes.enable_routes("CPU")
        assert _torchvision_entry.dispatcher_roi_align_in_use()
        replaced = _torchvision_entry.roi_align
        assert torchvision.ops.roi_align is replaced
        assert torchvision.ops.poolers.roi_align is replaced
        assert vars(sys.modules["torchvision.ops.roi_align"])["roi_align"] is replaced
        assert user_module.pool is replaced
        _routes.disable_routes()
        assert not _torchvision_entry.dispatcher_roi_align_in_use()
        for holder in (torchvision.ops, torchvision.ops.poolers, sys.modules["torchvision.ops.roi_align"]):
            assert vars(holder)["roi_align"] is ORIGINAL_ROI_ALIGN
        assert user_module.pool is ORIGINAL_ROI_ALIGN
    finally:
        del sys.modules[user_module.__name__]


def test_python_entry_gives_torchvision_results():
    generator = torch.Generator().manual_seed(5)
    features = torch.randn(2, 3, 10, 12, generator=generator)
    boxes = torch.tensor([[1.0, 0.5, 0.5, 8.0, 7.0], [0.0, 2.0, 1.0, 4.0, 9.0]])
    for output_size, kwargs in ((2, {}), ((3, 2), {"sampling_ratio": 2, "aligned": True, "spatial_scale": 0.5})):
        expected = ORIGINAL_ROI_ALIGN(features, boxes, output_size, **kwargs)
        as_list = [boxes[1:, 1:], boxes[:1, 1:]]
        as_list_expected = ORIGINAL_ROI_ALIGN(features, as_list, output_size, **kwargs)
        assert torch.equal(_torchvision_entry.roi_align(features, boxes, output_size, **kwargs), expected)
        assert torch.equal(_torchvision_entry.roi_align(features, as_list, output_size, **kwargs), as_list_expected)
    with pytest.raises(AssertionError):  # torchvision's own error for boxes of a wrong shape
        _torchvision_entry.roi_align(features, torch.zeros(2, 3), 2)


def test_python_entry_traces_in_one_graph_under_torch_compile():
    generator = torch.Generator().manual_seed(6)
    features = torch.randn(2, 3, 10, 12, generator=generator)
    boxes = torch.tensor([[1.0, 0.5, 0.5, 8.0, 7.0], [0.0, 2.0, 1.0, 4.0, 9.0]])
    _routes.enable_routes("CPU")
    compiled = torch.compile(lambda x, b: torchvision.ops.roi_align(x, b, 2, 1.0, 2), backend="eager", fullgraph=True)
    try:
        assert torch.equal(compiled(features, boxes), ORIGINAL_ROI_ALIGN(features, boxes, 2, 1.0, 2))
    finally:
        torch._dynamo.reset()
