"""CPU tests of deepep_lightning.ops.interpolate: drop-in forward, PyTorch's backward, delegation."""

import pytest
import torch
import torch.nn.functional as F

from deepep_lightning.ops import extension_available, interpolate
from deepep_lightning.ops.interpolate import _resolve_size, interpolate_unsupported_reason

pytestmark = pytest.mark.skipif(not extension_available(), reason="deepep_lightning extension not buildable here")

OUR_GRAD_FN = "deepep_lightning::UpsampleBilinear2d"  # the C++ autograd node (refused_ops.cpp)

CASES = [  # (size, scale_factor, recompute_scale_factor)
    ((9, 11), None, None),
    (7, None, None),
    ((3, 2), None, None),  # downsampling
    (None, 2.0, None),
    (None, 2.3, None),  # scale passed to the kernel differs from H_out / H
    (None, (1.7, 0.6), None),
    (None, 2.3, True),
    (None, 0.5, False),
]


@pytest.mark.parametrize("size, scale_factor, recompute", CASES)
@pytest.mark.parametrize("align_corners", [False, True])
def test_forward_and_backward_equal_pytorch(size, scale_factor, recompute, align_corners):
    x = torch.randn(2, 3, 5, 6, dtype=torch.float64, requires_grad=True)
    kwargs = dict(
        size=size,
        scale_factor=scale_factor,
        mode="bilinear",
        align_corners=align_corners,
        recompute_scale_factor=recompute,
    )
    ours = interpolate(x, **kwargs)
    theirs = F.interpolate(x, **kwargs)
    assert OUR_GRAD_FN in ours.grad_fn.name()
    assert ours.shape == theirs.shape and torch.equal(ours, theirs)
    grad_output = torch.randn_like(ours)
    assert torch.equal(torch.autograd.grad(ours, x, grad_output)[0], torch.autograd.grad(theirs, x, grad_output)[0])


def test_float32_and_align_corners_none():
    x = torch.randn(1, 2, 4, 4, requires_grad=True)
    ours = interpolate(x, scale_factor=3, mode="bilinear")
    assert torch.equal(ours, F.interpolate(x, scale_factor=3, mode="bilinear"))
    ours.sum().backward()
    expected = torch.autograd.grad(F.interpolate(x, scale_factor=3, mode="bilinear").sum(), x)[0]
    assert torch.equal(x.grad, expected)


def test_resolve_size_follows_pytorch_rules():
    x = torch.zeros(1, 1, 5, 7)
    assert _resolve_size(x, 4, None, None) == ([4, 4], None, None)
    assert _resolve_size(x, None, 1.5, None) == ([7, 10], 1.5, 1.5)
    assert _resolve_size(x, None, 1.5, True) == ([7, 10], None, None)
    assert _resolve_size(x, (2, 3), 2.0, None) is None  # both given: PyTorch raises
    assert _resolve_size(x, (2, 3, 4), None, None) is None


def test_gradcheck():
    x = torch.randn(1, 2, 3, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a: interpolate(a, size=(5, 7), mode="bilinear", align_corners=True), (x,))


def test_opcheck():
    x = torch.randn(1, 2, 3, 4, requires_grad=True)
    torch.library.opcheck(
        torch.ops.deepep_lightning.upsample_bilinear2d.default,
        (x, [5, 6], False, None, None),
        test_utils=("test_schema", "test_autograd_registration", "test_faketensor"),
    )


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(scale_factor=2, mode="nearest"),
        dict(scale_factor=2, mode="bicubic", align_corners=False),
        dict(scale_factor=2, mode="bilinear", antialias=True),
        dict(size=(3, 3), mode="area"),
    ],
)
def test_uncovered_cases_delegate_to_pytorch(kwargs):
    x = torch.randn(1, 2, 4, 4, requires_grad=True)
    out = interpolate(x, **kwargs)
    assert OUR_GRAD_FN not in out.grad_fn.name()
    assert torch.equal(out, F.interpolate(x, **kwargs))
    assert interpolate_unsupported_reason(x, **kwargs) is not None


def test_bad_arguments_raise_pytorch_errors():
    x = torch.randn(1, 2, 4, 4)
    with pytest.raises(ValueError, match="only one of size or scale_factor"):
        interpolate(x, size=3, scale_factor=2.0, mode="bilinear")
    with pytest.raises(ValueError, match="recompute_scale_factor"):
        interpolate(x, size=3, mode="bilinear", recompute_scale_factor=True)
    with pytest.raises(ValueError, match="either size or scale_factor"):
        interpolate(x, mode="bilinear")
    with pytest.raises((ValueError, NotImplementedError)):  # 3-D input with bilinear
        interpolate(torch.randn(1, 2, 4), scale_factor=2.0, mode="bilinear")
    # Empty sizes are left to PyTorch before the compiled op (an exception from inside it crashed
    # torch 2.11 on the GPU machine, BENCHMARKS.md "Known problem").
    for bad in (dict(scale_factor=0.1), dict(size=(0, 4))):
        assert "left to PyTorch" in interpolate_unsupported_reason(x, mode="bilinear", **bad)
        with pytest.raises(RuntimeError, match="sizes should be greater than 0"):
            interpolate(x, mode="bilinear", **bad)
    with pytest.raises(RuntimeError, match="sizes should be greater than 0"):
        interpolate(x[:, :, :0], size=(2, 4), mode="bilinear")


def test_f_interpolate_is_replaced_while_routed_and_restored():
    """While the bilinear backward route is installed, ``F.interpolate`` (and every module global holding it)
    is the entry that reaches the native kernel; removing the route restores PyTorch's function."""
    import sys
    import types

    from deepep_lightning.ops import _routes

    module = sys.modules["deepep_lightning.ops.interpolate"]
    entry, original = module._interpolate_entry, module._ENTRY.original  # PyTorch's, whatever state tests left
    _routes.disable_routes()
    assert F.interpolate is original
    user_module = types.ModuleType("user_segmentation_head")
    user_module.resize = original  # imported by name
    sys.modules[user_module.__name__] = user_module
    try:
        _routes.enable_routes("CPU")
        assert F.interpolate is entry
        assert user_module.resize is entry
        x = torch.randn(1, 2, 5, 6)
        # CPU tensors (and CUDA ones outside deterministic mode) get PyTorch's function, bit for bit
        for kwargs in (dict(scale_factor=2.0, mode="bilinear"), dict(size=(3, 4), mode="nearest")):
            assert torch.equal(F.interpolate(x, **kwargs), original(x, **kwargs))
        with pytest.raises(ValueError, match="only one of size or scale_factor"):
            F.interpolate(x, size=3, scale_factor=2.0, mode="bilinear")
        # TorchScript compiles the entry with F.interpolate's overloads: scripted upsampling keeps working
        scripted = torch.jit.script(torch.nn.Upsample(scale_factor=2.0, mode="bilinear"))
        assert torch.equal(scripted(x), original(x, scale_factor=2.0, mode="bilinear"))
        compiled = torch.compile(lambda t: F.interpolate(t, size=(9, 9), mode="bilinear"), backend="eager")
        assert torch.equal(compiled(x), original(x, size=(9, 9), mode="bilinear"))
    finally:
        _routes.disable_routes()
        del sys.modules[user_module.__name__]
    assert F.interpolate is original
    assert user_module.resize is original
