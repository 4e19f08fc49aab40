"""The L1 audit catalogue's entries for DeepEP's value head ``deepep::all_action_q``.

The workload adds them to the plugin's catalogue (:func:`deepep_lightning.audit.catalogue.register`) when
:mod:`deepep_lightning.deepep.kernels` is imported; the plugin itself knows nothing of the workload. Three
rows: the PyTorch reference, the extension op with its deterministic backward, and with its atomicAdd
backward (the negative control, CUDA only).
"""

from __future__ import annotations

from deepep_lightning.audit.catalogue import CatalogueEntry
from deepep_lightning.audit.catalogue.entry import grad_of, randn
from deepep_lightning.deepep.kernels.all_action_q import all_action_q
from deepep_lightning.deepep.kernels.reference import all_action_q_reference
from deepep_lightning.ops import extension_available

__all__ = ["ALL_ACTION_Q_ENTRIES"]


def _all_action_q(variant: str):
    def build(device, n, gen):
        rows, actions, hidden = max(16, n // 512), 4, 128
        z = randn(gen, device, rows, hidden, requires_grad=True)
        e = randn(gen, device, actions, hidden, requires_grad=True)
        w = randn(gen, device, hidden, requires_grad=True)
        b = randn(gen, device, 1, requires_grad=True)
        grad_out = randn(gen, device, rows, actions)
        if variant == "reference":
            forward = lambda: all_action_q_reference(z, e, w, b)  # noqa: E731
        else:
            if not extension_available():
                raise RuntimeError("the C++ extension did not load (see deepep_lightning.ops.extension_error())")
            forward = lambda: all_action_q(z, e, w, b, deterministic=variant == "fused")  # noqa: E731
        return grad_of(forward, [z, e, w, b], grad_out)

    return build


ALL_ACTION_Q_ENTRIES: list[CatalogueEntry] = [
    CatalogueEntry("all_action_q_reference", _all_action_q("reference"), "DeepEP: value head, PyTorch reference"),
    CatalogueEntry(
        "all_action_q_fused",
        _all_action_q("fused"),
        "DeepEP: extension op, deterministic backward",
        needs_extension=True,
    ),
    CatalogueEntry(
        "all_action_q_atomic",
        _all_action_q("atomic"),
        "DeepEP: extension op, atomicAdd backward",
        cuda_only=True,
        needs_extension=True,
    ),
]
