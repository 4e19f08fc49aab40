"""L1 catalogue entries of torchvision's RoI and deformable-convolution ops (empty without torchvision).

Their backwards scatter into the feature map with float ``atomicAdd`` on CUDA: deterministic mode refuses
``roi_pool``, ``ps_roi_align``, ``ps_roi_pool`` and ``deform_conv2d`` there, and ``roi_align`` turns to a
pure-PyTorch path in Python. The entries' ``routed`` ops are the ``torchvision::`` backwards that
:func:`deepep_lightning.ops.patch_refused_ops` sends to a deterministic kernel instead.
"""

from __future__ import annotations

import torch

from deepep_lightning.audit.catalogue.entry import CatalogueEntry, grad_of, randn

__all__ = ["TORCHVISION_ENTRIES"]


def _boxes(gen: torch.Generator, device: torch.device, count: int, side: int) -> torch.Tensor:
    """``[count, 5]`` boxes over two images of ``side x side``, overlapping (many RoIs share pixels)."""
    corner = torch.rand(count, 2, generator=gen) * side * 0.7
    size = 2 + torch.rand(count, 2, generator=gen) * side * 0.5
    image = torch.randint(0, 2, (count, 1), generator=gen).float()
    return torch.cat([image, corner, corner + size], dim=1).to(device)


def _roi_op(kind: str):
    def build(device, n, gen):
        import torchvision.ops as ops

        channels = 18  # a multiple of 3 x 3 bins for the position-sensitive op
        side = max(8, int((n / (2 * channels)) ** 0.5))
        features = randn(gen, device, 2, channels, side, side, requires_grad=True)  # [N, C, H, W]
        rois = _boxes(gen, device, 256, side)
        forward = {
            "roi_align": lambda: ops.roi_align(features, rois, 7, 1.0, 2),
            "roi_align_adaptive": lambda: ops.roi_align(features, rois, 7, 1.0, -1, aligned=True),
            "roi_pool": lambda: ops.roi_pool(features, rois, 7, 1.0),
            "ps_roi_align": lambda: ops.ps_roi_align(features, rois, 3, 1.0, 2),
            "ps_roi_pool": lambda: ops.ps_roi_pool(features, rois, 3, 1.0),
        }[kind]
        with torch.no_grad():
            shape = forward().shape
        return grad_of(forward, [features], randn(gen, device, *shape))

    return build


def _deform_conv2d(device, n, gen):
    import torchvision.ops as ops

    channels = 16
    side = max(8, int((n / channels) ** 0.5))
    features = randn(gen, device, 1, channels, side, side, requires_grad=True)
    weight = randn(gen, device, channels, channels, 3, 3)
    offset = (randn(gen, device, 1, 18, side, side) * 2).requires_grad_(True)
    mask = torch.rand(1, 9, side, side, generator=gen).to(device)
    return grad_of(
        lambda: ops.deform_conv2d(features, offset, weight, padding=1, mask=mask),
        [features, offset],
        randn(gen, device, 1, channels, side, side),
    )


def _entries() -> list[CatalogueEntry]:
    try:
        import torchvision.ops  # noqa: F401 - an optional dependency
    except Exception:  # noqa: BLE001 - without a working torchvision the family is empty
        return []
    return [
        CatalogueEntry(name, build, note, routed=(f"torchvision::{routed}",))
        for name, build, note, routed in [
            (
                "roi_align_backward",
                _roi_op("roi_align"),
                "torchvision roi_align 7x7, sampling 2",
                "_roi_align_backward",
            ),
            (
                "roi_align_adaptive_backward",
                _roi_op("roi_align_adaptive"),
                "torchvision roi_align 7x7, adaptive sampling, aligned",
                "_roi_align_backward",
            ),
            ("roi_pool_backward", _roi_op("roi_pool"), "torchvision roi_pool 7x7", "_roi_pool_backward"),
            (
                "ps_roi_align_backward",
                _roi_op("ps_roi_align"),
                "torchvision ps_roi_align 3x3",
                "_ps_roi_align_backward",
            ),
            ("ps_roi_pool_backward", _roi_op("ps_roi_pool"), "torchvision ps_roi_pool 3x3", "_ps_roi_pool_backward"),
            (
                "deform_conv2d_backward",
                _deform_conv2d,
                "torchvision deform_conv2d 3x3 with mask",
                "_deform_conv2d_backward",
            ),
        ]
    ]


TORCHVISION_ENTRIES: list[CatalogueEntry] = _entries()
