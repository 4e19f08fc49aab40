"""The L1 op catalogue: the ops DeepEP uses and the well-known nondeterministic offenders.

Each entry builds **fixed random inputs** once (never zeros: a sum of zeros is reproducible in any
order) and returns a zero-argument callable that runs the op (forward, or forward+backward through
``torch.autograd.grad``) and returns the tensors to compare. Sizes: ``"large"`` follows the GPU
probes (8M float32 values into 1000 bins, enough to expose atomics on an H200); ``"small"`` keeps
CPU tests fast.

``routed`` names the dispatcher ops (``aten`` names, or ``"torchvision::name"``) of an entry that
:func:`deepep_lightning.ops.patch_refused_ops` routes
to a deterministic kernel (on CUDA, in deterministic mode): the ops PyTorch refuses there, or runs
deterministically but slowly. An entry with ``routed=()`` runs PyTorch's kernels in every column.

The entries live by family: :mod:`~deepep_lightning.audit.catalogue.indexed` (accumulation by index, the
atomic-add family), :mod:`~deepep_lightning.audit.catalogue.spatial` (losses and image ops, the family
deterministic mode refuses), :mod:`~deepep_lightning.audit.catalogue.torchvision` (torchvision's RoI and
deformable-convolution ops, when torchvision imports) and :mod:`~deepep_lightning.audit.catalogue.dense`
(dense ops);
this module puts them in table order. A workload adds its own ops with :func:`register` (DeepEP's value head:
:mod:`deepep_lightning.deepep.kernels.audit_entries`, registered when that package is imported).
"""

from __future__ import annotations

from deepep_lightning.audit.catalogue.dense import DENSE_ENTRIES
from deepep_lightning.audit.catalogue.entry import CatalogueEntry
from deepep_lightning.audit.catalogue.indexed import INDEXED_ENTRIES
from deepep_lightning.audit.catalogue.spatial import SPATIAL_ENTRIES
from deepep_lightning.audit.catalogue.torchvision import TORCHVISION_ENTRIES

__all__ = ["CATALOGUE", "CatalogueEntry", "catalogue_names", "register", "size_of"]

_SIZES = {"small": 1 << 12, "large": 1 << 23}

CATALOGUE: dict[str, CatalogueEntry] = {
    e.name: e for e in [*INDEXED_ENTRIES, *SPATIAL_ENTRIES, *TORCHVISION_ENTRIES, *DENSE_ENTRIES]
}


def register(*entries: CatalogueEntry) -> None:
    """Add ``entries`` to the catalogue, after the built-in rows (registering the same entry again is a no-op).

    Raises:
        ValueError: an entry is not a :class:`CatalogueEntry`, or its name belongs to another entry.
    """
    for entry in entries:
        if not isinstance(entry, CatalogueEntry):
            raise ValueError(f"`entries` must be CatalogueEntry objects, got {type(entry).__name__}: {entry!r}")
        existing = CATALOGUE.get(entry.name)
        if existing is not None and existing is not entry:
            raise ValueError(
                f"the catalogue already has an entry named {entry.name!r} ({existing.note}); "
                "HINT: give the new entry another name"
            )
    CATALOGUE.update((entry.name, entry) for entry in entries)


def catalogue_names() -> list[str]:
    """Names of the built-in L1 ops, in table order."""
    return list(CATALOGUE)


def size_of(size: str) -> int:
    """Number of source elements for ``"small"``/``"large"``."""
    if size not in _SIZES:
        raise ValueError(f"`size` must be one of {sorted(_SIZES)}, got {size!r}")
    return _SIZES[size]
