"""Python layer of the plugin's C++/CUDA extension: the refused-op kernels, their routing, the loader.

The plugin's ops live in the ``deepep_lightning::`` namespace (``torch.ops.deepep_lightning``). The
extension is JIT-compiled on first use (see :mod:`deepep_lightning.ops.extension_loader`); without a compiler
every op falls back to its pure-PyTorch reference with one warning. A workload with kernels of its
own (DeepEP's, in :mod:`deepep_lightning.deepep.kernels`) has them built into the same library and
writes their Python side with :func:`register_op_python_side` (or :func:`on_extension_loaded`),
:func:`kernels_reason` and :func:`require_tensors`.
"""

from deepep_lightning.ops._guards import kernels_reason, require_tensors
from deepep_lightning.ops.extension_loader import (
    cuda_kernels_available,
    extension_available,
    extension_error,
    on_extension_loaded,
    register_op_python_side,
)
from deepep_lightning.ops.grid_sample import grid_sample
from deepep_lightning.ops.interpolate import interpolate
from deepep_lightning.ops.routing import patch_refused_ops, refused_ops_patched, refused_ops_routing, routed_aten_ops

__all__ = [
    "cuda_kernels_available",
    "extension_available",
    "extension_error",
    "grid_sample",
    "interpolate",
    "kernels_reason",
    "on_extension_loaded",
    "patch_refused_ops",
    "refused_ops_patched",
    "refused_ops_routing",
    "register_op_python_side",
    "require_tensors",
    "routed_aten_ops",
]
