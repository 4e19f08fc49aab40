"""CPU tests of the dispatcher routing (deepep_lightning.ops._routes, routing.py): on in deterministic mode,
off otherwise, reversible. The routes are installed at the CPU key here (the same wrappers as at CUDA)."""

import dataclasses
import threading

import pytest
import torch
import torch.nn.functional as F

from deepep_lightning.ops import (
    _routes,
    extension_available,
    patch_refused_ops,
    refused_ops_patched,
    refused_ops_routing,
    routed_aten_ops,
)
from deepep_lightning.ops._routes import Route, register_route, route_kernel

pytestmark = pytest.mark.skipif(not extension_available(), reason="deepep_lightning extension not buildable here")

ROUTED_HERE = {
    "nll_loss2d_forward",
    "_adaptive_avg_pool2d_backward",
    "_adaptive_avg_pool3d_backward",
    "avg_pool3d_backward",
    "grid_sampler_2d_backward",
    "upsample_bilinear2d_backward",
    "upsample_linear1d_backward",
    "upsample_bicubic2d_backward",
    "_upsample_bilinear2d_aa_backward",
    "_upsample_bicubic2d_aa_backward",
    "grid_sampler_3d_backward",
    "reflection_pad1d_backward",
    "reflection_pad3d_backward",  # not 2-D: PyTorch's CUDA kernel has a deterministic gather of its own
    *(f"replication_pad{d}d_backward" for d in (1, 2, 3)),
}


@pytest.fixture(autouse=True)
def _restore_global_state():
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    was_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    yield
    _routes.disable_routes()
    torch.use_deterministic_algorithms(was_deterministic, warn_only=was_warn_only)


@pytest.fixture
def spy(monkeypatch):
    """Counts the deterministic calls of every registered route (installed at CPU by the test)."""
    calls: list[str] = []
    for name, route in routed_aten_ops_with_routes().items():

        def counted(*args, _route=route, **kwargs):
            calls.append(_route.aten_op)
            return _route.deterministic(*args, **kwargs)

        monkeypatch.setitem(_routes._routes, name, dataclasses.replace(route, deterministic=counted))
    return calls


def routed_aten_ops_with_routes():
    routed_aten_ops()  # imports every op module
    return _routes.registered_routes()


class _Original:
    def __init__(self):
        self.calls = 0

    def call_boxed(self, keyset, *args, **kwargs):
        self.calls += 1
        return "original"


def test_every_op_of_this_area_is_registered():
    assert ROUTED_HERE <= set(routed_aten_ops())
    assert "reflection_pad2d_backward" not in routed_aten_ops()  # PyTorch's kernel is deterministic there


def test_route_kernel_picks_by_mode_and_coverage():
    covered = {"value": None}
    route = Route("nll_loss2d_forward", lambda *a, **k: "deterministic", lambda *a, **k: covered["value"])
    original = _Original()
    kernel = route_kernel(route, original)
    torch.use_deterministic_algorithms(False)
    assert kernel(None, 1, 2) == "original"
    torch.use_deterministic_algorithms(True)
    assert kernel(None, 1, 2) == "deterministic"
    covered["value"] = "not covered"
    assert kernel(None, 1, 2) == "original"  # negative control: an uncovered case keeps PyTorch's kernel
    torch.use_deterministic_algorithms(True, warn_only=True)
    covered["value"] = None
    assert kernel(None, 1, 2) == "deterministic"
    assert original.calls == 2


def test_route_validates_its_fields():
    with pytest.raises(ValueError, match="aten_op"):
        Route("aten::nll_loss2d_forward", lambda: None)
    with pytest.raises(TypeError, match="deterministic must be callable"):
        Route("nll_loss2d_forward", "not callable")
    with pytest.raises(TypeError, match="route must be"):
        register_route("nll_loss2d_forward")
    with pytest.raises(TypeError, match="dispatch_key must be a str"):
        _routes.enable_routes(1)
    with pytest.raises(ValueError, match="namespace must be a library name"):
        Route("roi_align", lambda: None, namespace="torch vision")
    with pytest.raises(ValueError, match="shape_function is only for aten ops"):
        Route("roi_align", lambda: None, shape_function=lambda: None, namespace="torchvision")
    with pytest.raises(TypeError, match="on_install must be callable"):
        Route("roi_align", lambda: None, namespace="torchvision", on_install=True)
    other = Route("_roi_align_backward", lambda: None, namespace="torchvision")
    assert (other.key, other.qualified_name) == ("torchvision::_roi_align_backward",) * 2
    assert Route("nll_loss2d_forward", lambda: None).key == "nll_loss2d_forward"


def test_enable_disable_are_idempotent_and_report_the_previous_state():
    assert not _routes.routes_enabled()
    assert _routes.enable_routes("CPU") is False
    assert _routes.enable_routes("CPU") is True
    assert set(_routes.installed_ops()) >= ROUTED_HERE
    assert set(_routes.installed_ops().values()) == {"CPU"}
    assert _routes.disable_routes() is True
    assert _routes.disable_routes() is False
    assert _routes.installed_ops() == {}


def _segmentation_step():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 12, 12, generator=generator, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 4, (2, 12, 12), generator=generator)
    target[0, :2] = -100
    weight = torch.rand(4, generator=generator, dtype=torch.float64) + 0.5
    pooled = F.adaptive_avg_pool2d(x, 5)
    logits = torch.cat([pooled, pooled.mean(1, keepdim=True)], 1)
    up = F.interpolate(logits, size=(12, 12), mode="bilinear", align_corners=False)
    volume = F.pad(up.unsqueeze(0), (1, 1, 1, 1, 1, 1), mode="reflect")
    volume = F.avg_pool3d(volume, 3, stride=1, padding=1)[0, :, 1:-1, 1:-1, 1:-1]
    loss = F.cross_entropy(volume, target, weight=weight, ignore_index=-100)
    loss = loss + F.adaptive_avg_pool3d(x.unsqueeze(0), (2, 3, 4)).sum()
    return loss, torch.autograd.grad(loss, x)[0]


def test_routes_at_the_dispatcher_only_in_deterministic_mode(spy):
    reference_loss, reference_grad = _segmentation_step()
    _routes.enable_routes("CPU")
    torch.use_deterministic_algorithms(False)
    _segmentation_step()
    assert spy == []  # outside deterministic mode nothing is routed
    torch.use_deterministic_algorithms(True)
    loss, grad = _segmentation_step()
    # F.cross_entropy reaches nll_loss2d_forward inside C++: only a dispatcher route sees it.
    assert {"nll_loss2d_forward", "_adaptive_avg_pool2d_backward", "_adaptive_avg_pool3d_backward"} <= set(spy)
    assert {"avg_pool3d_backward", "reflection_pad3d_backward"} <= set(spy)
    torch.testing.assert_close(loss, reference_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, reference_grad, rtol=1e-12, atol=1e-12)
    spy.clear()
    _routes.disable_routes()
    _segmentation_step()
    assert spy == []  # reversed: PyTorch's kernels again


def test_direct_aten_callers_are_routed(spy):
    _routes.enable_routes("CPU")
    torch.use_deterministic_algorithms(True)
    x = torch.randn(1, 2, 6, 6, requires_grad=True)
    grid = (torch.rand(1, 4, 4, 2) * 2 - 1).requires_grad_()
    torch.grid_sampler(x, grid, 0, 0, False).sum().backward()
    torch._C._nn.upsample_bilinear2d(x, (9, 9), False).sum().backward()
    torch._C._nn.replication_pad1d(x[0], (2, 3)).sum().backward()
    torch._C._nn.reflection_pad1d(x[0], (1, 2)).sum().backward()
    torch._C._nn.reflection_pad2d(x, (1, 2, 1, 2)).sum().backward()  # PyTorch's own gather: not routed
    assert {
        "grid_sampler_2d_backward",
        "upsample_bilinear2d_backward",
        "replication_pad1d_backward",
        "reflection_pad1d_backward",
    } <= set(spy)
    assert "reflection_pad2d_backward" not in spy


@pytest.mark.parametrize("kwargs", [dict(scale_factor=2.5), dict(size=7, align_corners=True), dict(size=4)])
def test_linear_1d_interpolate_backward_is_routed_and_equal(spy, kwargs):
    x = torch.randn(3, 2, 9, dtype=torch.float64, requires_grad=True)
    grad_output = torch.randn_like(F.interpolate(x, mode="linear", **kwargs))
    (want,) = torch.autograd.grad(F.interpolate(x, mode="linear", **kwargs), x, grad_output)
    assert spy == []
    _routes.enable_routes("CPU")
    torch.use_deterministic_algorithms(True)
    (got,) = torch.autograd.grad(F.interpolate(x, mode="linear", **kwargs), x, grad_output)
    assert spy == ["upsample_linear1d_backward"]
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "kwargs, aten_op",
    [
        (dict(mode="bicubic", scale_factor=1.7), "upsample_bicubic2d_backward"),
        (dict(mode="bicubic", size=(4, 11), align_corners=True), "upsample_bicubic2d_backward"),
        (dict(mode="bilinear", scale_factor=0.4, antialias=True), "_upsample_bilinear2d_aa_backward"),
        (dict(mode="bilinear", size=(3, 9), antialias=True, align_corners=True), "_upsample_bilinear2d_aa_backward"),
        (dict(mode="bicubic", scale_factor=0.5, antialias=True), "_upsample_bicubic2d_aa_backward"),
    ],
)
def test_bicubic_and_antialias_interpolate_backward_is_routed_and_equal(spy, kwargs, aten_op):
    x = torch.randn(2, 3, 6, 7, dtype=torch.float64, requires_grad=True)
    grad_output = torch.randn_like(F.interpolate(x, **kwargs))
    (want,) = torch.autograd.grad(F.interpolate(x, **kwargs), x, grad_output)
    _routes.enable_routes("CPU")
    torch.use_deterministic_algorithms(True)
    (got,) = torch.autograd.grad(F.interpolate(x, **kwargs), x, grad_output)
    assert spy == [aten_op]
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("padding_mode", ["zeros", "border", "reflection"])
@pytest.mark.parametrize("align_corners", [False, True])
@pytest.mark.parametrize(
    "mode, spatial, aten_op",
    [
        ("bilinear", 3, "grid_sampler_3d_backward"),
        ("nearest", 3, "grid_sampler_3d_backward"),
        ("nearest", 2, "grid_sampler_2d_backward"),
        ("bicubic", 2, "grid_sampler_2d_backward"),
    ],
)
def test_decomposed_grid_sample_backward_is_routed_and_equal(spy, padding_mode, align_corners, mode, spatial, aten_op):
    x = torch.randn(2, 3, *(4, 5, 6)[-spatial:], dtype=torch.float64, requires_grad=True)
    grid = ((torch.rand(2, 3, *(2, 4)[: spatial - 1], spatial, dtype=torch.float64) * 2 - 1) * 1.3).requires_grad_()

    def grads():
        out = F.grid_sample(x, grid, mode=mode, padding_mode=padding_mode, align_corners=align_corners)
        return torch.autograd.grad(out, (x, grid), torch.ones_like(out))

    want = grads()
    _routes.enable_routes("CPU")
    torch.use_deterministic_algorithms(True)
    got = grads()
    assert spy == [aten_op]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


def test_uncovered_case_keeps_pytorchs_kernel_and_errors(spy):
    _routes.enable_routes("CPU")
    torch.use_deterministic_algorithms(True)
    logp = torch.randn(2, 3, 4, 4).log_softmax(1)
    target = torch.randint(0, 3, (2, 4, 4))
    F.nll_loss(logp, target, reduction="none")  # not refused by PyTorch: not routed
    x = torch.randn(1, 2, 6, 6, 6, requires_grad=True)
    torch._C._nn.reflection_pad3d(x, (-1, 2, 1, 1, 1, 1)).sum().backward()  # cropping: left to PyTorch
    assert spy == []
    with pytest.raises(RuntimeError, match="[Tt]arget"):
        F.nll_loss(logp, target[:, :3])  # PyTorch's own error, before any compiled op


def test_patch_refused_ops_is_the_cuda_switch():
    assert not refused_ops_patched()
    assert patch_refused_ops(True) is False
    assert refused_ops_patched() and set(_routes.installed_ops().values()) <= {"CUDA"}
    with refused_ops_routing(False):
        assert not refused_ops_patched()
    assert refused_ops_patched()
    assert patch_refused_ops(False) is True
    assert not refused_ops_patched()
    with pytest.raises(TypeError, match="enabled must be a bool"):
        patch_refused_ops("yes")


def test_enable_disable_from_threads():
    errors = []

    def flip():
        try:
            for _ in range(20):
                _routes.enable_routes("CPU")
                _routes.disable_routes()
        except Exception as error:  # noqa: BLE001 - collected and asserted below
            errors.append(error)

    threads = [threading.Thread(target=flip) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert not _routes.routes_enabled()
