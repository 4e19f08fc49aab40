"""CPU tests of deepep_lightning.ops.routing: F.grid_sample / F.interpolate routing on and off."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from deepep_lightning.ops import extension_available, patch_refused_ops, refused_ops_patched, refused_ops_routing
from deepep_lightning.ops.routing import ROUTED_FUNCTIONS

pytestmark = pytest.mark.skipif(not extension_available(), reason="deepep extension not buildable here")

ORIGINALS = {name: getattr(F, name) for name in ROUTED_FUNCTIONS}


@pytest.fixture(autouse=True)
def _restore_global_state():
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    was_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    yield
    patch_refused_ops(False)
    torch.use_deterministic_algorithms(was_deterministic, warn_only=was_warn_only)
    for name, function in ORIGINALS.items():  # a failing test must not leak a patch
        setattr(F, name, function)


def _grad_fn_name(tensor):
    return tensor.grad_fn.name()


def _sample():
    x = torch.randn(1, 2, 6, 6, requires_grad=True)
    grid = (torch.rand(1, 5, 5, 2) * 2 - 1).requires_grad_()
    return x, grid


def test_patch_and_unpatch():
    assert not refused_ops_patched()
    assert patch_refused_ops(True) is False
    assert refused_ops_patched()
    assert F.grid_sample is not ORIGINALS["grid_sample"] and F.interpolate is not ORIGINALS["interpolate"]
    assert patch_refused_ops(True) is True  # idempotent
    assert patch_refused_ops(False) is True
    assert F.grid_sample is ORIGINALS["grid_sample"] and F.interpolate is ORIGINALS["interpolate"]
    assert not refused_ops_patched()


def test_context_manager_restores_previous_state():
    with refused_ops_routing():
        assert refused_ops_patched()
        with refused_ops_routing(False):
            assert not refused_ops_patched()
        assert refused_ops_patched()
    assert not refused_ops_patched()


def test_routes_only_in_deterministic_mode():
    x, grid = _sample()
    with refused_ops_routing():
        torch.use_deterministic_algorithms(False)
        assert "deepep" not in _grad_fn_name(F.grid_sample(x, grid, align_corners=False))
        assert "deepep" not in _grad_fn_name(F.interpolate(x, scale_factor=2, mode="bilinear"))
        torch.use_deterministic_algorithms(True)
        routed = F.grid_sample(x, grid, align_corners=False)
        assert "deepep::GridSampleBilinear2d" in _grad_fn_name(routed)
        upsampled = F.interpolate(x, scale_factor=2, mode="bilinear")
        assert "deepep::UpsampleBilinear2d" in _grad_fn_name(upsampled)
        # Same values and gradients as PyTorch's (CPU) kernels.
        reference = ORIGINALS["grid_sample"](x, grid, align_corners=False)
        assert torch.equal(routed, reference)
        assert torch.equal(torch.autograd.grad(routed.sum(), x)[0], torch.autograd.grad(reference.sum(), x)[0])
    torch.use_deterministic_algorithms(True)
    assert "deepep" not in _grad_fn_name(F.grid_sample(x, grid, align_corners=False))  # unpatched again


def test_module_callers_are_routed():
    x, _ = _sample()
    torch.use_deterministic_algorithms(True)
    with refused_ops_routing():
        assert "deepep::UpsampleBilinear2d" in _grad_fn_name(nn.Upsample(scale_factor=2, mode="bilinear")(x))
        assert "deepep::UpsampleBilinear2d" in _grad_fn_name(nn.UpsamplingBilinear2d(scale_factor=2)(x))
        assert "deepep" not in _grad_fn_name(nn.Upsample(scale_factor=2, mode="nearest")(x))


def test_uncovered_cases_keep_pytorch_path_under_routing():
    x, grid = _sample()
    torch.use_deterministic_algorithms(True)
    with refused_ops_routing():
        out = F.grid_sample(x, grid, mode="bicubic", align_corners=False)
        assert "deepep" not in _grad_fn_name(out)
        assert torch.equal(out, ORIGINALS["grid_sample"](x, grid, mode="bicubic", align_corners=False))
        out = F.interpolate(x, scale_factor=2, mode="bicubic", align_corners=False)
        assert "deepep" not in _grad_fn_name(out)
        with pytest.raises(ValueError, match="padding_mode"):
            F.grid_sample(x, grid, padding_mode="wrap", align_corners=False)


def test_foreign_replacement_is_left_alone_on_unpatch():
    def foreign(*args, **kwargs):
        return ORIGINALS["grid_sample"](*args, **kwargs)

    patch_refused_ops(True)
    F.grid_sample = foreign
    patch_refused_ops(False)
    assert F.grid_sample is foreign


def test_enabled_must_be_bool():
    with pytest.raises(TypeError, match="enabled must be a bool"):
        patch_refused_ops("yes")
