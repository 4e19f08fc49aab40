"""``interpolate`` with a deterministic bilinear backward: a drop-in for ``F.interpolate``.

PyTorch's CUDA ``upsample_bilinear2d_backward`` scatters with float ``atomicAdd`` and is refused
under ``torch.use_deterministic_algorithms(True)``; recent ``F.interpolate`` then silently
switches CUDA inputs to a slow pure-PyTorch decomposition (backward through ``index_put``).
:func:`interpolate` keeps PyTorch's native forward kernel (``upsample_bilinear2d``) and, for the
covered case, uses the gather backward of ``torch.ops.deepep_lightning`` (bitwise reproducible):

* covered: ``mode="bilinear"``, 4-D input, ``antialias=False``, ``size`` or ``scale_factor``
  (with or without ``recompute_scale_factor``), both ``align_corners``,
  float16/bfloat16/float32/float64, plain tensors. CUDA: ``extensions/csrc/cuda/
  upsample_bilinear_backward.cu``; CPU: PyTorch's CPU backward (already deterministic).
* everything else (other modes, 3-D/5-D input, ``antialias=True``, invalid arguments, no compiled
  extension) is handed to ``F.interpolate`` unchanged: its result and its own errors.

At the dispatcher (``deepep_lightning.ops._routes``) the same backward serves
``aten::upsample_bilinear2d_backward`` on CUDA in deterministic mode: direct callers of the aten op,
TorchScript and ``nn.Upsample`` inside scripted code are covered once routing is on. Eager
``F.interpolate`` itself, in deterministic mode on CUDA, takes PyTorch's own decomposition (backward
through a sorted ``index_put_``: 7 ms of a 30 ms DeepLabV3 step on the H100) and never reaches that op;
so while the route is installed, ``F.interpolate`` is replaced everywhere (a
:class:`~deepep_lightning.ops._python_entry.PythonEntry`) by :func:`interpolate` for CUDA tensors in
deterministic mode, and by PyTorch's function for everything else (CPU, deterministic mode off, TorchScript,
``torch.compile`` tracing).

``aten::upsample_linear1d_backward`` (``F.interpolate(mode="linear")``, 3-D input), which PyTorch's
eager ``F.interpolate`` does reach in deterministic mode, is routed to the same bilinear gather on a
``[N, C, 1, W]`` view: with one input and one output row the row map is the identity (weight 1, and the
second tap is the same row with weight 0, as in PyTorch's own linear kernel), so the result is the
linear backward. ``aten::upsample_bicubic2d_backward`` (``mode="bicubic"``) is routed to a gather of its
own (``extensions/csrc/cuda/upsample_bicubic_backward.cu``), and the antialiased backwards
``aten::_upsample_bilinear2d_aa_backward`` / ``_upsample_bicubic2d_aa_backward`` (``antialias=True``) to
``extensions/csrc/cuda/upsample_aa_backward.cu``.

The output equals ``F.interpolate``'s native-kernel output bit for bit (outside deterministic
mode; inside it, on CUDA, PyTorch itself uses the decomposition, equal up to fp rounding).
"""

import numbers
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from deepep_lightning.ops._guards import FLOAT_DTYPES, kernels_reason, register_fakes
from deepep_lightning.ops._python_entry import PythonEntry
from deepep_lightning.ops._routes import Route, register_route
from deepep_lightning.ops.extension_loader import register_op_python_side

__all__ = ["interpolate", "interpolate_unsupported_reason"]

_OP = "interpolate"
_DTYPES = FLOAT_DTYPES
_torch_interpolate = F.interpolate

_Resolved = tuple[list[int], float | None, float | None]


def _pair(value) -> list | None:
    values = list(value) if isinstance(value, (list, tuple)) else [value, value]
    return values if len(values) == 2 else None


def _resolve_size(input: Tensor, size, scale_factor, recompute_scale_factor) -> _Resolved | None:
    """``(output_size, scale_h, scale_w)`` exactly as ``F.interpolate`` + ATen's ``.vec`` overload
    compute them, or ``None`` where ``F.interpolate`` would raise (it is then left to raise)."""
    if (size is None) == (scale_factor is None):
        return None
    if size is not None:
        sizes = _pair(size)
        if recompute_scale_factor or sizes is None:
            return None
        if not all(isinstance(s, int) and not isinstance(s, bool) for s in sizes):
            return None
        return sizes, None, None
    factors = _pair(scale_factor)
    if factors is None or not all(isinstance(f, numbers.Real) and not isinstance(f, bool) for f in factors):
        return None
    factors = [float(f) for f in factors]
    # ATen: static_cast<int64_t>(input_size * scale) in double; Python: int(float product).
    output_size = [int(input.shape[2 + i] * factors[i]) for i in range(2)]
    if recompute_scale_factor:
        return output_size, None, None
    return output_size, factors[0], factors[1]


def interpolate_unsupported_reason(
    input: Tensor,
    size=None,
    scale_factor=None,
    mode: str = "nearest",
    align_corners: bool | None = None,
    recompute_scale_factor: bool | None = None,
    antialias: bool = False,
) -> str | None:
    """Why :func:`interpolate` would hand these arguments to PyTorch, or ``None`` when it covers them."""
    if not isinstance(input, Tensor):
        return "input must be a torch.Tensor"
    if torch.overrides.has_torch_function_unary(input):
        return "tensor subclasses with __torch_function__ are left to PyTorch"
    if mode != "bilinear":
        return f"mode={mode!r} is not covered, only 'bilinear'"
    if antialias:
        return "antialias=True is not covered"
    if input.dim() != 4:
        return f"only 4-D input is covered, got {input.dim()}-D"
    if input.dtype not in _DTYPES:
        return f"dtype {input.dtype} is not covered, only one of {list(_DTYPES)}"
    if align_corners is not None and not isinstance(align_corners, bool):
        return f"align_corners={align_corners!r} is not a bool"
    resolved = _resolve_size(input, size, scale_factor, recompute_scale_factor)
    if resolved is None:
        return "size/scale_factor/recompute_scale_factor are left to PyTorch to validate"
    if min(resolved[0]) <= 0 or input.shape[2] == 0 or input.shape[3] == 0:
        # PyTorch raises its own error; an exception from inside the compiled op crashed torch 2.11
        # on the GPU machine (BENCHMARKS.md, "Known problem"), so this never reaches it.
        return f"empty input {tuple(input.shape)} or output size {resolved[0]}: left to PyTorch to validate"
    return kernels_reason(input)


def interpolate(
    input: Tensor,
    size=None,
    scale_factor=None,
    mode: str = "nearest",
    align_corners: bool | None = None,
    recompute_scale_factor: bool | None = None,
    antialias: bool = False,
) -> Tensor:
    """``F.interpolate`` (same signature, same forward) whose bilinear 2-D backward is deterministic.

    Args:
        input: ``[N, C, H, W]`` for the covered bilinear case; anything else goes to ``F.interpolate``.
        size: output ``(H_out, W_out)`` or one int for both; exclusive with ``scale_factor``.
        scale_factor: float or pair; ``H_out = int(H * scale)``. The scale itself is passed on to
            the kernels (as PyTorch does) unless ``recompute_scale_factor=True``.
        mode: ``"bilinear"`` is covered; the default ``"nearest"`` and the others go to PyTorch.
        align_corners: ``None`` means ``False`` (PyTorch's default for bilinear).
        recompute_scale_factor: as in ``F.interpolate``.
        antialias: ``True`` goes to ``F.interpolate`` (not covered).

    Returns:
        The resized tensor, bitwise equal to ``F.interpolate``'s native kernel output.

    Raises:
        ValueError, TypeError, RuntimeError: PyTorch's own errors for invalid arguments, and under
            deterministic mode PyTorch's own error for an uncovered case whose backward it refuses.

    Example::

        >>> x = torch.randn(1, 2, 4, 4, requires_grad=True)
        >>> interpolate(x, scale_factor=2, mode="bilinear").sum().backward()
        >>> x.grad.shape
        torch.Size([1, 2, 4, 4])
    """
    reason = interpolate_unsupported_reason(
        input, size, scale_factor, mode, align_corners, recompute_scale_factor, antialias
    )
    if reason is not None:
        return _torch_interpolate(
            input,
            size=size,
            scale_factor=scale_factor,
            mode=mode,
            align_corners=align_corners,
            recompute_scale_factor=recompute_scale_factor,
            antialias=antialias,
        )
    resolved = _resolve_size(input, size, scale_factor, recompute_scale_factor)
    assert resolved is not None  # interpolate_unsupported_reason returns a reason when it is None
    output_size, scale_h, scale_w = resolved
    return torch.ops.deepep_lightning.upsample_bilinear2d.default(
        input, output_size, bool(align_corners) if align_corners is not None else False, scale_h, scale_w
    )


def _interpolate_entry(
    input: Tensor,
    size=None,
    scale_factor=None,
    mode: str = "nearest",
    align_corners: bool | None = None,
    recompute_scale_factor: bool | None = None,
    antialias: bool = False,
) -> Tensor:
    """``F.interpolate`` while the bilinear backward route is installed: :func:`interpolate` for a CUDA tensor
    in deterministic mode (PyTorch would take its decomposition), PyTorch's function otherwise."""
    if not torch.jit.is_scripting():
        if (
            isinstance(input, Tensor)
            and input.is_cuda
            and torch.are_deterministic_algorithms_enabled()
            and not torch.compiler.is_compiling()
        ):
            return interpolate(input, size, scale_factor, mode, align_corners, recompute_scale_factor, antialias)
    return _torch_interpolate(input, size, scale_factor, mode, align_corners, recompute_scale_factor, antialias)


def _script_like_pytorch() -> None:
    """Give :func:`_interpolate_entry` ``F.interpolate``'s TorchScript overloads (its signatures by argument type).

    TorchScript compiles the function a scripted module calls; with the overloads it compiles this one's body
    per signature (its ``torch.jit.is_scripting()`` branch is dropped, so the body is PyTorch's function).
    """
    from torch import _jit_internal

    overloads = _jit_internal._get_fn_overloads(_jit_internal._qualified_name(_torch_interpolate))
    if overloads is not None:
        _jit_internal._overloaded_fns.setdefault(_jit_internal._qualified_name(_interpolate_entry), list(overloads))


_script_like_pytorch()
_ENTRY = PythonEntry("torch.nn.functional", "interpolate", _interpolate_entry)


def _fake_forward(
    input: Tensor, output_size: Sequence[int], align_corners: bool, scale_h: float | None, scale_w: float | None
) -> Tensor:
    torch._check(input.dim() == 4, lambda: f"{_OP}: input must be 4-D, got shape {tuple(input.shape)}")
    torch._check(
        len(output_size) == 2 and output_size[0] > 0 and output_size[1] > 0,
        lambda: f"{_OP}: output_size must be 2 positive ints, got {list(output_size)}",
    )
    return input.new_empty((input.shape[0], input.shape[1], output_size[0], output_size[1]))


def _fake_2d_backward(op: str) -> Callable[..., Tensor]:
    """The fake kernel of a 2-D upsample backward ``(grad_output, input_size, *options) -> grad_input``."""

    def fake(grad_output: Tensor, input_size: Sequence[int], *options: object) -> Tensor:
        torch._check(len(input_size) == 4, lambda: f"{op}: input_size must have 4 entries")
        return grad_output.new_empty(tuple(input_size))

    return fake


# autograd is registered in C++ (extensions/csrc/refused_ops.cpp): no Python runs per backward
register_op_python_side("upsample_bilinear2d", _fake_forward, _fake_2d_backward(f"{_OP}_backward"))


def _upsample_backward_reason(
    grad_output: Tensor, output_size: Sequence[int], input_size: Sequence[int], spatial: int
) -> str | None:
    """Why the gather backward would hand an upsample backward of ``spatial`` dims to PyTorch, or ``None``."""
    if not isinstance(grad_output, Tensor) or grad_output.dim() != spatial + 2 or grad_output.dtype not in _DTYPES:
        return f"grad_output must be a {spatial + 2}-D float16/bfloat16/float32/float64 tensor"
    if len(input_size) != spatial + 2 or len(output_size) != spatial:
        return (
            f"input_size {list(input_size)} / output_size {list(output_size)} are not {spatial + 2} / {spatial} entries"
        )
    if tuple(grad_output.shape) != (input_size[0], input_size[1], *output_size):
        return f"grad_output {tuple(grad_output.shape)} does not match input_size {list(input_size)}"
    if min(input_size[2:]) <= 0 or min(output_size) <= 0:
        return "empty spatial sizes are left to PyTorch"
    return kernels_reason(grad_output)


def _backward_route_covers(
    grad_output: Tensor,
    output_size: Sequence[int],
    input_size: Sequence[int],
    align_corners: bool,
    scales_h: float | None = None,
    scales_w: float | None = None,
) -> str | None:
    return _upsample_backward_reason(grad_output, output_size, input_size, 2)


def _gather_route(op: str, *extra: bool) -> Callable[..., Tensor]:
    """The route of a 2-D upsample backward to ``torch.ops.deepep_lightning.<op>(..., scales_h, scales_w, *extra)``.

    The op is looked up per call: it exists only once the library is loaded.
    """

    def route(
        grad_output: Tensor,
        output_size: Sequence[int],
        input_size: Sequence[int],
        align_corners: bool,
        scales_h: float | None = None,
        scales_w: float | None = None,
    ) -> Tensor:
        kernel = getattr(torch.ops.deepep_lightning, op).default
        return kernel(grad_output, list(input_size), align_corners, scales_h, scales_w, *extra)

    return route


def _linear1d_route_covers(
    grad_output: Tensor,
    output_size: Sequence[int],
    input_size: Sequence[int],
    align_corners: bool,
    scales: float | None = None,
) -> str | None:
    return _upsample_backward_reason(grad_output, output_size, input_size, 1)


def _linear1d_route(
    grad_output: Tensor,
    output_size: Sequence[int],
    input_size: Sequence[int],
    align_corners: bool,
    scales: float | None = None,
) -> Tensor:
    batch, channels, width = input_size
    grad_input = torch.ops.deepep_lightning.upsample_bilinear2d_backward.default(
        grad_output.unsqueeze(2), [batch, channels, 1, width], align_corners, None, scales
    )  # [N, C, 1, W]
    return grad_input.view(batch, channels, width)


register_fakes(
    {
        f"deepep_lightning::{op}": _fake_2d_backward(op)
        for op in ("upsample_bicubic2d_backward", "upsample_aa2d_backward")
    }
)
for _route in (
    Route(
        "upsample_bilinear2d_backward",
        _gather_route("upsample_bilinear2d_backward"),
        _backward_route_covers,
        on_install=_ENTRY.use,
    ),
    Route("upsample_bicubic2d_backward", _gather_route("upsample_bicubic2d_backward"), _backward_route_covers),
    # upsample_aa2d_backward's trailing bool: the bicubic (True) or the bilinear (False) filter
    Route("_upsample_bilinear2d_aa_backward", _gather_route("upsample_aa2d_backward", False), _backward_route_covers),
    Route("_upsample_bicubic2d_aa_backward", _gather_route("upsample_aa2d_backward", True), _backward_route_covers),
    Route("upsample_linear1d_backward", _linear1d_route, _linear1d_route_covers),
):
    register_route(_route)
