"""The L1 op catalogue: the ops DeepEP uses and the well-known nondeterministic offenders.

Each entry builds **fixed random inputs** once (never zeros: a sum of zeros is reproducible in any
order) and returns a zero-argument callable that runs the op (forward, or forward+backward through
``torch.autograd.grad``) and returns the tensors to compare. Sizes: ``"large"`` follows the GPU
probes (8M float32 values into 1000 bins, enough to expose atomics on an H200); ``"small"`` keeps
CPU tests fast.

``routed`` names the ``aten`` ops of an entry that :func:`deepep_lightning.ops.patch_refused_ops` routes
to a deterministic kernel (on CUDA, in deterministic mode): the ops PyTorch refuses there, or runs
deterministically but slowly. An entry with ``routed=()`` runs PyTorch's kernels in every column.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["CATALOGUE", "CatalogueEntry", "catalogue_names"]

_SIZES = {"small": 1 << 12, "large": 1 << 23}
_BINS = 1000


@dataclasses.dataclass(frozen=True)
class CatalogueEntry:
    """One L1 op: ``build(device, size, generator)`` → a zero-argument callable returning tensors.

    Attributes:
        name: the table's row label.
        build: makes the fixed random inputs once and returns the callable.
        note: the table's ``what`` column.
        cuda_only: ``n/a`` on CPU.
        needs_extension: needs the deepep extension (not built on a bare CPU test run).
        routed: the ``aten`` ops of the computation that ``patch_refused_ops`` routes (empty: none).
    """

    name: str
    build: Callable[[torch.device, int, torch.Generator], Callable[[], Any]]
    note: str
    cuda_only: bool = False
    needs_extension: bool = False
    routed: tuple[str, ...] = ()


def _randn(gen: torch.Generator, device: torch.device, *shape: int, requires_grad: bool = False) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(device).requires_grad_(requires_grad)


def _indices(gen: torch.Generator, device: torch.device, n: int, high: int = _BINS) -> torch.Tensor:
    return torch.randint(0, high, (n,), generator=gen).to(device)


def _scatter_like(kind: str):
    def build(device, n, gen):
        src, idx = _randn(gen, device, n), _indices(gen, device, n)
        zeros = lambda: torch.zeros(_BINS, device=device)  # noqa: E731 - the destination; the sources are random
        ops = {
            "index_add_": lambda: zeros().index_add_(0, idx, src),
            "scatter_add_": lambda: zeros().scatter_add_(0, idx, src),
            "scatter_reduce_sum": lambda: zeros().scatter_reduce(0, idx, src, "sum"),
            "index_put_accumulate": lambda: zeros().index_put_((idx,), src, accumulate=True),
            "put_accumulate": lambda: zeros().put_(idx, src, accumulate=True),
            "bincount_weights": lambda: torch.bincount(idx, weights=src, minlength=_BINS),
            "index_copy_duplicates": lambda: zeros().index_copy_(0, idx[: _BINS * 4] % _BINS, src[: _BINS * 4]),
        }
        return ops[kind]

    return build


def _grad_of(
    forward: Callable[[], torch.Tensor], inputs: list[torch.Tensor], grad_out: torch.Tensor
) -> Callable[[], Any]:
    def run():
        out = forward()
        return torch.autograd.grad(out, inputs, grad_out)

    return run


def _output_and_grad(
    forward: Callable[[], torch.Tensor], inputs: list[torch.Tensor], grad_out: torch.Tensor
) -> Callable[[], Any]:
    """Forward and backward: the output (a loss whose forward accumulates, e.g. nll_loss2d) and the grads."""

    def run():
        out = forward()
        return (out.detach(), *torch.autograd.grad(out, inputs, grad_out))

    return run


def _cross_entropy_4d(device, n, gen):
    classes, ignore_index = 19, 255  # Cityscapes-like segmentation
    side = max(4, int((n / (2 * classes)) ** 0.5))
    logits = _randn(gen, device, 2, classes, side, side, requires_grad=True)  # [N, C, H, W]
    target = torch.randint(0, classes, (2, side, side), generator=gen)
    target[:, : max(1, side // 8)] = ignore_index  # a void border
    target = target.to(device)
    weight = (torch.rand(classes, generator=gen) + 0.5).to(device)
    return _output_and_grad(
        lambda: F.cross_entropy(logits, target, weight=weight, ignore_index=ignore_index),
        [logits],
        torch.tensor(0.75, device=device),
    )


def _ctc_loss(device, n, gen):
    time_steps, classes, target_length = 50, 29, 10  # speech: characters + blank
    batch = min(256, max(2, n // (time_steps * classes)))
    activations = _randn(gen, device, time_steps, batch, classes, requires_grad=True)  # [T, N, C]
    targets = torch.randint(1, classes, (batch, target_length), generator=gen).to(device)
    input_lengths = torch.full((batch,), time_steps, dtype=torch.int64, device=device)
    target_lengths = torch.full((batch,), target_length, dtype=torch.int64, device=device)
    return _output_and_grad(
        lambda: F.ctc_loss(activations.log_softmax(2), targets, input_lengths, target_lengths),
        [activations],
        torch.tensor(0.75, device=device),
    )


def _index_reduce(reduce: str):
    def build(device, n, gen):
        idx = _indices(gen, device, n)
        if reduce == "prod":  # factors near 1: a product of ~n / 1000 of them stays finite
            src, start = 1 + 0.01 * _randn(gen, device, n), 1 + 0.01 * _randn(gen, device, _BINS)
        else:
            src, start = _randn(gen, device, n), _randn(gen, device, _BINS)
        return lambda: start.index_reduce(0, idx, src, reduce)

    return build


def _scatter_reduce_prod(device, n, gen):
    idx = _indices(gen, device, n)
    src, start = 1 + 0.01 * _randn(gen, device, n), 1 + 0.01 * _randn(gen, device, _BINS)
    return lambda: start.scatter_reduce(0, idx, src, "prod")


def _median_dim(device, n, gen):
    values = (4 * _randn(gen, device, max(4, n // 256), 256)).round()  # [rows, 256] with ties
    return lambda: tuple(values.median(dim=1))


def _grid_sample(device, n, gen):
    side = max(8, int((n / 16) ** 0.5))  # [1, 16, side, side] input, output as large
    inp = _randn(gen, device, 1, 16, side, side, requires_grad=True)
    grid = (torch.rand(1, side, side, 2, generator=gen) * 2 - 1).to(device)
    return _grad_of(
        lambda: F.grid_sample(inp, grid, align_corners=False), [inp], _randn(gen, device, 1, 16, side, side)
    )


def _interpolate(mode: str):
    def build(device, n, gen):
        side = max(4, int((n / 64) ** 0.5))  # upsampled ×2 → output ~ n elements over 16 channels
        inp = _randn(gen, device, 1, 16, side, side, requires_grad=True)
        kwargs = {"align_corners": False} if mode in ("bilinear", "bicubic") else {}
        grad_out = _randn(gen, device, 1, 16, 2 * side, 2 * side)
        return _grad_of(lambda: F.interpolate(inp, scale_factor=2, mode=mode, **kwargs), [inp], grad_out)

    return build


def _embedding(bag: bool):
    def build(device, n, gen):
        dim = 64
        weight = _randn(gen, device, _BINS, dim, requires_grad=True)
        idx = _indices(gen, device, max(n // dim, 16))
        if bag:
            offsets = torch.arange(0, idx.numel(), 8, device=device)
            grad_out = _randn(gen, device, offsets.numel(), dim)
            return _grad_of(lambda: F.embedding_bag(idx, weight, offsets, mode="sum"), [weight], grad_out)
        return _grad_of(lambda: F.embedding(idx, weight), [weight], _randn(gen, device, idx.numel(), dim))

    return build


def _pool(kind: str):
    def build(device, n, gen):
        if kind in ("avg_pool3d", "max_pool3d"):
            side = max(4, int((n / 4) ** (1 / 3)))
            inp = _randn(gen, device, 1, 4, side, side, side, requires_grad=True)
            pool = F.avg_pool3d if kind == "avg_pool3d" else F.max_pool3d
            forward = lambda: pool(inp, 3, stride=1)  # noqa: E731 - overlapping windows
        else:
            side = max(8, int((n / 16) ** 0.5))
            inp = _randn(gen, device, 1, 16, side, side, requires_grad=True)
            forward = {
                "adaptive_avg_pool2d": lambda: F.adaptive_avg_pool2d(inp, (side // 3 + 1, side // 3 + 1)),
                "reflection_pad2d": lambda: F.pad(inp, (3, 3, 3, 3), mode="reflect"),
                "conv2d": lambda: F.conv2d(inp, weight, padding=1),
            }[kind]
            if kind == "conv2d":
                weight = _randn(gen, device, 16, 16, 3, 3, requires_grad=True)
        with torch.no_grad():
            shape = forward().shape
        inputs = [inp, weight] if kind == "conv2d" else [inp]
        return _grad_of(forward, inputs, _randn(gen, device, *shape))

    return build


def _dense(kind: str):
    def build(device, n, gen):
        rows = max(16, n // 256)
        x = _randn(gen, device, rows, 256, requires_grad=True)
        w = _randn(gen, device, 256, 256, requires_grad=True)
        if kind == "matmul":
            return lambda: x.detach() @ w.detach()
        if kind == "linear_backward":
            return _grad_of(lambda: F.linear(x, w), [x, w], _randn(gen, device, rows, 256))
        if kind == "layer_norm_backward":
            ln_w = _randn(gen, device, 256, requires_grad=True)
            return _grad_of(lambda: F.layer_norm(x, (256,), ln_w), [x, ln_w], _randn(gen, device, rows, 256))
        if kind == "softmax":
            return lambda: torch.softmax(x.detach(), dim=-1)
        if kind == "sum":
            return lambda: x.detach().sum()
        raise KeyError(kind)

    return build


def _cumsum(device, n, gen):
    src = _randn(gen, device, n)
    return lambda: src.cumsum(0)


def _histc(device, n, gen):
    src = _randn(gen, device, n)
    return lambda: torch.histc(src, bins=_BINS, min=-4, max=4)


def _gru_cell(device, n, gen):
    batch, hidden = max(8, n // 4096), 256
    cell = torch.nn.GRUCell(hidden, hidden).to(device)
    x, h = _randn(gen, device, batch, hidden, requires_grad=True), _randn(gen, device, batch, hidden)
    params = [x, *cell.parameters()]
    return _grad_of(lambda: cell(x, h), params, _randn(gen, device, batch, hidden))


def _multinomial(device, n, gen):
    probs = torch.rand(max(8, n // 64), 8, generator=gen).to(device) + 0.01
    sampler = torch.Generator(device=device)

    def run():
        sampler.manual_seed(0)  # DeepEP reseeds its rollout generator every step: same draws, same seed
        return torch.multinomial(probs, 1, generator=sampler)

    return run


def _all_action_q(variant: str):
    def build(device, n, gen):
        rows, actions, hidden = max(16, n // 512), 4, 128
        z = _randn(gen, device, rows, hidden, requires_grad=True)
        e = _randn(gen, device, actions, hidden, requires_grad=True)
        w = _randn(gen, device, hidden, requires_grad=True)
        b = _randn(gen, device, 1, requires_grad=True)
        grad_out = _randn(gen, device, rows, actions)
        if variant == "reference":
            from deepep_lightning.ops import all_action_q_reference as op

            forward = lambda: op(z, e, w, b)  # noqa: E731
        else:
            from deepep_lightning.ops import all_action_q, extension_available

            if not extension_available():
                raise RuntimeError("the deepep extension did not load (see deepep_lightning.ops.extension_error())")
            forward = lambda: all_action_q(z, e, w, b, deterministic=variant == "fused")  # noqa: E731
        return _grad_of(forward, [z, e, w, b], grad_out)

    return build


CATALOGUE: dict[str, CatalogueEntry] = {
    e.name: e
    for e in [
        CatalogueEntry(
            "index_add_", _scatter_like("index_add_"), "duplicate indices, atomic on CUDA", routed=("index_add_",)
        ),
        CatalogueEntry(
            "scatter_add_",
            _scatter_like("scatter_add_"),
            "duplicate indices, atomic on CUDA",
            routed=("scatter_add_",),
        ),
        CatalogueEntry("scatter_reduce_sum", _scatter_like("scatter_reduce_sum"), "duplicate indices"),
        CatalogueEntry(
            "index_put_accumulate",
            _scatter_like("index_put_accumulate"),
            "index_put_(accumulate=True)",
            routed=("_index_put_impl_",),
        ),
        CatalogueEntry("put_accumulate", _scatter_like("put_accumulate"), "put_(accumulate=True)", routed=("put_",)),
        CatalogueEntry(
            "bincount_weights", _scatter_like("bincount_weights"), "weighted bincount", routed=("bincount",)
        ),
        CatalogueEntry(
            "index_copy_duplicates", _scatter_like("index_copy_duplicates"), "index_copy_, duplicate indices"
        ),
        CatalogueEntry(
            "index_reduce_prod", _index_reduce("prod"), "index_reduce(reduce='prod')", routed=("index_reduce",)
        ),
        CatalogueEntry(
            "index_reduce_mean", _index_reduce("mean"), "index_reduce(reduce='mean')", routed=("index_reduce",)
        ),
        CatalogueEntry(
            "index_reduce_amax", _index_reduce("amax"), "index_reduce(reduce='amax')", routed=("index_reduce",)
        ),
        CatalogueEntry(
            "scatter_reduce_prod",
            _scatter_reduce_prod,
            "scatter_reduce(reduce='prod')",
            routed=("scatter_reduce.two",),
        ),
        CatalogueEntry("histc", _histc, "histogram", routed=("histc",)),
        CatalogueEntry(
            "median_dim", _median_dim, "median(dim): values and indices, with ties", routed=("median.dim_values",)
        ),
        CatalogueEntry("cumsum", _cumsum, "prefix sum over 1-D"),
        CatalogueEntry("embedding_backward", _embedding(False), "embedding_dense_backward"),
        CatalogueEntry("embedding_bag_backward", _embedding(True), "embedding_bag(mode='sum') backward"),
        CatalogueEntry(
            "cross_entropy_4d",
            _cross_entropy_4d,
            "4-D F.cross_entropy (nll_loss2d forward) + backward, class weights, ignore_index",
            routed=("nll_loss2d_forward",),
        ),
        CatalogueEntry(
            "ctc_loss",
            _ctc_loss,
            "F.ctc_loss forward + backward",
            routed=("_ctc_loss_backward", "_ctc_loss_backward.Tensor"),
        ),
        CatalogueEntry(
            "grid_sample_backward",
            _grid_sample,
            "grid_sampler_2d_backward (bilinear)",
            routed=("grid_sampler_2d_backward",),
        ),
        CatalogueEntry(
            "interpolate_bilinear_backward",
            _interpolate("bilinear"),
            "upsample_bilinear2d_backward",
            routed=("upsample_bilinear2d_backward",),
        ),
        CatalogueEntry(
            "interpolate_bicubic_backward",
            _interpolate("bicubic"),
            "upsample_bicubic2d_backward",
            routed=("upsample_bicubic2d_backward",),
        ),
        CatalogueEntry("interpolate_nearest_backward", _interpolate("nearest"), "upsample_nearest2d_backward"),
        CatalogueEntry(
            "adaptive_avg_pool2d_backward",
            _pool("adaptive_avg_pool2d"),
            "adaptive_avg_pool2d backward",
            routed=("_adaptive_avg_pool2d_backward",),
        ),
        CatalogueEntry(
            "avg_pool3d_backward", _pool("avg_pool3d"), "avg_pool3d backward", routed=("avg_pool3d_backward",)
        ),
        CatalogueEntry(
            "max_pool3d_backward",
            _pool("max_pool3d"),
            "max_pool3d backward (overlapping windows)",
            routed=("max_pool3d_with_indices_backward",),
        ),
        CatalogueEntry("reflection_pad2d_backward", _pool("reflection_pad2d"), "reflection_pad2d backward"),
        CatalogueEntry("conv2d_backward", _pool("conv2d"), "conv2d forward+backward (cuDNN algorithm choice)"),
        CatalogueEntry("matmul", _dense("matmul"), "GEMM (cuBLAS)"),
        CatalogueEntry("linear_backward", _dense("linear_backward"), "DeepEP: Linear backward"),
        CatalogueEntry("layer_norm_backward", _dense("layer_norm_backward"), "layer_norm backward"),
        CatalogueEntry("softmax", _dense("softmax"), "DeepEP: policy softmax"),
        CatalogueEntry("sum", _dense("sum"), "full reduction"),
        CatalogueEntry("gru_cell", _gru_cell, "DeepEP: recurrent cell forward+backward"),
        CatalogueEntry("multinomial", _multinomial, "DeepEP: action sampling, seeded generator"),
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
}


def catalogue_names() -> list[str]:
    """Names of the built-in L1 ops, in table order."""
    return list(CATALOGUE)


def size_of(size: str) -> int:
    """Number of source elements for ``"small"``/``"large"``."""
    if size not in _SIZES:
        raise ValueError(f"`size` must be one of {sorted(_SIZES)}, got {size!r}")
    return _SIZES[size]
