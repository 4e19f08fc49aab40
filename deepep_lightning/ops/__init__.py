"""Python layer of the ``deepep`` C++/CUDA extension: fused ops, their references, the loader.

The extension is JIT-compiled on first use (see :mod:`deepep_lightning.ops._loader`); without a
compiler every op falls back to its pure-PyTorch reference with one warning.
"""

from deepep_lightning.ops._loader import cuda_kernels_available, extension_available, extension_error
from deepep_lightning.ops.all_action_q import all_action_q
from deepep_lightning.ops.grid_sample import grid_sample
from deepep_lightning.ops.interpolate import interpolate
from deepep_lightning.ops.reference import all_action_q_reference
from deepep_lightning.ops.routing import patch_refused_ops, refused_ops_patched, refused_ops_routing, routed_aten_ops

__all__ = [
    "all_action_q",
    "all_action_q_reference",
    "cuda_kernels_available",
    "extension_available",
    "extension_error",
    "grid_sample",
    "interpolate",
    "patch_refused_ops",
    "refused_ops_patched",
    "refused_ops_routing",
    "routed_aten_ops",
]
