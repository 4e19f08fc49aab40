"""The checks that the refused-op modules share: ``covers`` reasons (dtypes, devices, the compiled kernels)
and fake kernels.

A ``covers`` function (:class:`~deepep_lightning.ops._routes.Route`) returns why a case is left to
PyTorch, or ``None``; the op-specific checks (shapes, modes, windows) stay in each op module, and the
checks every route makes in the same words live here, so that one reason reads the same everywhere.
Metadata only: nothing here reads tensor values or syncs the host. The fake kernels
(``torch.library.register_fake``) need the C++ schema, so :func:`register_fakes` registers them once
the library is loaded.
"""

from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from deepep_lightning.ops.extension_loader import cuda_kernels_available, extension_available, on_extension_loaded

__all__ = [
    "FLOAT_DTYPES",
    "fake_like_self",
    "grad_and_self_reason",
    "grad_and_self_device_reason",
    "kernels_reason",
    "register_fakes",
    "require_tensors",
]

#: The floating dtypes the deterministic kernels take.
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

_KERNEL_DEVICE_TYPES = ("cpu", "cuda")


def _compiled_reason(tensor: Tensor) -> str | None:
    if not extension_available():
        return "the deepep_lightning C++ extension is not available"
    if tensor.is_cuda and not cuda_kernels_available():
        return "the deepep_lightning CUDA kernels were not built (no nvcc?)"
    return None


def require_tensors(op: str, named: Mapping[str, object]) -> None:
    """Raise ``TypeError`` naming the first argument of ``named`` (name: value) that is not a tensor."""
    for name, value in named.items():
        if not isinstance(value, Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(value).__name__} {value!r}")


def kernels_reason(tensor: Tensor) -> str | None:
    """Why the compiled kernels cannot run on ``tensor``'s device (not CPU/CUDA, not built), or ``None``."""
    if tensor.device.type not in _KERNEL_DEVICE_TYPES:
        return f"device type {tensor.device.type!r} is not covered"
    return _compiled_reason(tensor)


def grad_and_self_reason(grad_output: Tensor, self: Tensor, spatial: int) -> str | None:
    """Why a pooling/padding backward of ``spatial`` dims is left to PyTorch by type, rank or dtype, or ``None``.

    Covered: two tensors, ``self`` ``[N, C, *spatial]`` or ``[C, *spatial]``, ``grad_output`` of the same
    rank, both of one of :data:`FLOAT_DTYPES`.
    """
    if not isinstance(grad_output, Tensor) or not isinstance(self, Tensor):
        return "grad_output and self must be torch.Tensor"
    if self.dim() not in (spatial + 1, spatial + 2) or grad_output.dim() != self.dim():
        return f"self must be {spatial + 1}-D or {spatial + 2}-D with grad_output of the same rank"
    if self.dtype not in FLOAT_DTYPES or grad_output.dtype != self.dtype:
        return f"dtype {self.dtype} (grad_output {grad_output.dtype}) is not one of {list(FLOAT_DTYPES)}"
    return None


def grad_and_self_device_reason(grad_output: Tensor, self: Tensor) -> str | None:
    """Why the kernels cannot take ``grad_output`` and ``self`` (two devices, not CPU/CUDA, not built), or ``None``."""
    if grad_output.device != self.device or self.device.type not in _KERNEL_DEVICE_TYPES:
        return f"devices {grad_output.device} / {self.device} are not covered"
    return _compiled_reason(self)


def fake_like_self(message: str) -> Callable[..., Tensor]:
    """The fake kernel of a backward ``(grad_output, self, *options) -> grad_input`` shaped like ``self``.

    ``torch._check`` raises ``message`` when ``grad_output``'s rank is not ``self``'s.
    """

    def fake(grad_output: Tensor, self: Tensor, *options: object) -> Tensor:
        torch._check(grad_output.dim() == self.dim(), lambda: message)
        return torch.empty_like(self)

    return fake


def register_fakes(fakes: dict[str, Callable[..., object]]) -> None:
    """Once the library is loaded: ``torch.library.register_fake(name)(fake)`` for each ``"deepep_lightning::<op>"``."""

    def register() -> None:
        for name, fake in fakes.items():
            torch.library.register_fake(name)(fake)

    on_extension_loaded(register)
