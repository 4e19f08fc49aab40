"""L1 catalogue entries of losses and image ops: 4-D cross entropy, CTC, grid_sample, interpolate, pooling, conv.

Their passes accumulate into overlapping positions (the 4-D loss over pixels, the backward passes into the
input), and on CUDA deterministic mode refuses most of them: the entries' ``routed`` ops are the ones
:func:`deepep_lightning.ops.patch_refused_ops` sends to a deterministic kernel instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepep_lightning.audit.catalogue.entry import CatalogueEntry, grad_of, output_and_grad, randn

__all__ = ["SPATIAL_ENTRIES"]


def _cross_entropy_4d(device, n, gen):
    classes, ignore_index = 19, 255  # Cityscapes-like segmentation
    side = max(4, int((n / (2 * classes)) ** 0.5))
    logits = randn(gen, device, 2, classes, side, side, requires_grad=True)  # [N, C, H, W]
    target = torch.randint(0, classes, (2, side, side), generator=gen)
    target[:, : max(1, side // 8)] = ignore_index  # a void border
    target = target.to(device)
    weight = (torch.rand(classes, generator=gen) + 0.5).to(device)
    return output_and_grad(
        lambda: F.cross_entropy(logits, target, weight=weight, ignore_index=ignore_index),
        [logits],
        torch.tensor(0.75, device=device),
    )


def _ctc_loss(device, n, gen):
    time_steps, classes, target_length = 50, 29, 10  # speech: characters + blank
    batch = min(256, max(2, n // (time_steps * classes)))
    activations = randn(gen, device, time_steps, batch, classes, requires_grad=True)  # [T, N, C]
    targets = torch.randint(1, classes, (batch, target_length), generator=gen).to(device)
    input_lengths = torch.full((batch,), time_steps, dtype=torch.int64, device=device)
    target_lengths = torch.full((batch,), target_length, dtype=torch.int64, device=device)
    return output_and_grad(
        lambda: F.ctc_loss(activations.log_softmax(2), targets, input_lengths, target_lengths),
        [activations],
        torch.tensor(0.75, device=device),
    )


def _grid_sample(device, n, gen):
    side = max(8, int((n / 16) ** 0.5))  # [1, 16, side, side] input, output as large
    inp = randn(gen, device, 1, 16, side, side, requires_grad=True)
    grid = (torch.rand(1, side, side, 2, generator=gen) * 2 - 1).to(device)
    return grad_of(lambda: F.grid_sample(inp, grid, align_corners=False), [inp], randn(gen, device, 1, 16, side, side))


def _interpolate(mode: str):
    def build(device, n, gen):
        side = max(4, int((n / 64) ** 0.5))  # upsampled ×2 → output ~ n elements over 16 channels
        inp = randn(gen, device, 1, 16, side, side, requires_grad=True)
        kwargs = {"align_corners": False} if mode in ("bilinear", "bicubic") else {}
        grad_out = randn(gen, device, 1, 16, 2 * side, 2 * side)
        return grad_of(lambda: F.interpolate(inp, scale_factor=2, mode=mode, **kwargs), [inp], grad_out)

    return build


def _pool(kind: str):
    def build(device, n, gen):
        if kind in ("avg_pool3d", "max_pool3d"):
            side = max(4, int((n / 4) ** (1 / 3)))
            inp = randn(gen, device, 1, 4, side, side, side, requires_grad=True)
            pool = F.avg_pool3d if kind == "avg_pool3d" else F.max_pool3d
            forward = lambda: pool(inp, 3, stride=1)  # noqa: E731 - overlapping windows
        else:
            side = max(8, int((n / 16) ** 0.5))
            inp = randn(gen, device, 1, 16, side, side, requires_grad=True)
            forward = {
                "adaptive_avg_pool2d": lambda: F.adaptive_avg_pool2d(inp, (side // 3 + 1, side // 3 + 1)),
                "reflection_pad2d": lambda: F.pad(inp, (3, 3, 3, 3), mode="reflect"),
                "conv2d": lambda: F.conv2d(inp, weight, padding=1),
            }[kind]
            if kind == "conv2d":
                weight = randn(gen, device, 16, 16, 3, 3, requires_grad=True)
        with torch.no_grad():
            shape = forward().shape
        inputs = [inp, weight] if kind == "conv2d" else [inp]
        return grad_of(forward, inputs, randn(gen, device, *shape))

    return build


SPATIAL_ENTRIES: list[CatalogueEntry] = [
    CatalogueEntry(name, build, note, routed=routed)
    for name, build, note, routed in [  # routed=(): PyTorch's kernels in every column
        (
            "cross_entropy_4d",
            _cross_entropy_4d,
            "4-D F.cross_entropy (nll_loss2d forward) + backward, class weights, ignore_index",
            ("nll_loss2d_forward",),
        ),
        ("ctc_loss", _ctc_loss, "F.ctc_loss forward + backward", ("_ctc_loss_backward", "_ctc_loss_backward.Tensor")),
        ("grid_sample_backward", _grid_sample, "grid_sampler_2d_backward (bilinear)", ("grid_sampler_2d_backward",)),
        (
            "interpolate_bilinear_backward",
            _interpolate("bilinear"),
            "upsample_bilinear2d_backward",
            ("upsample_bilinear2d_backward",),
        ),
        (
            "interpolate_bicubic_backward",
            _interpolate("bicubic"),
            "upsample_bicubic2d_backward",
            ("upsample_bicubic2d_backward",),
        ),
        ("interpolate_nearest_backward", _interpolate("nearest"), "upsample_nearest2d_backward", ()),
        (
            "adaptive_avg_pool2d_backward",
            _pool("adaptive_avg_pool2d"),
            "adaptive_avg_pool2d backward",
            ("_adaptive_avg_pool2d_backward",),
        ),
        ("avg_pool3d_backward", _pool("avg_pool3d"), "avg_pool3d backward", ("avg_pool3d_backward",)),
        (
            "max_pool3d_backward",
            _pool("max_pool3d"),
            "max_pool3d backward (overlapping windows)",
            ("max_pool3d_with_indices_backward",),
        ),
        ("reflection_pad2d_backward", _pool("reflection_pad2d"), "reflection_pad2d backward", ()),
        ("conv2d_backward", _pool("conv2d"), "conv2d forward+backward (cuDNN algorithm choice)", ()),
    ]
]
