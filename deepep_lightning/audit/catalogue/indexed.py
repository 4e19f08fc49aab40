"""L1 catalogue entries that accumulate by index: scatter, index_*, put, bincount, histc, median, cumsum, embedding.

With duplicate indices many threads accumulate into one destination; CUDA does that with atomic adds, in
an order that changes from call to call, and deterministic mode refuses some of these ops or runs them
deterministically but slowly (the entries' ``routed`` ops). The sources are random, never zeros, so a
different summation order shows in the bits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepep_lightning.audit.catalogue.entry import BINS, CatalogueEntry, grad_of, indices, randn

__all__ = ["INDEXED_ENTRIES"]


def _scatter_like(kind: str):
    def build(device, n, gen):
        src, idx = randn(gen, device, n), indices(gen, device, n)
        zeros = lambda: torch.zeros(BINS, device=device)  # noqa: E731 - the destination; the sources are random
        ops = {
            "index_add_": lambda: zeros().index_add_(0, idx, src),
            "scatter_add_": lambda: zeros().scatter_add_(0, idx, src),
            "scatter_reduce_sum": lambda: zeros().scatter_reduce(0, idx, src, "sum"),
            "index_put_accumulate": lambda: zeros().index_put_((idx,), src, accumulate=True),
            "put_accumulate": lambda: zeros().put_(idx, src, accumulate=True),
            "bincount_weights": lambda: torch.bincount(idx, weights=src, minlength=BINS),
            "index_copy_duplicates": lambda: zeros().index_copy_(0, idx[: BINS * 4] % BINS, src[: BINS * 4]),
        }
        return ops[kind]

    return build


def _index_reduce(reduce: str):
    def build(device, n, gen):
        idx = indices(gen, device, n)
        if reduce == "prod":  # factors near 1: a product of ~n / 1000 of them stays finite
            src, start = 1 + 0.01 * randn(gen, device, n), 1 + 0.01 * randn(gen, device, BINS)
        else:
            src, start = randn(gen, device, n), randn(gen, device, BINS)
        return lambda: start.index_reduce(0, idx, src, reduce)

    return build


def _scatter_reduce_prod(device, n, gen):
    idx = indices(gen, device, n)
    src, start = 1 + 0.01 * randn(gen, device, n), 1 + 0.01 * randn(gen, device, BINS)
    return lambda: start.scatter_reduce(0, idx, src, "prod")


def _median_dim(device, n, gen):
    values = (4 * randn(gen, device, max(4, n // 256), 256)).round()  # [rows, 256] with ties
    return lambda: tuple(values.median(dim=1))


def _histc(device, n, gen):
    src = randn(gen, device, n)
    return lambda: torch.histc(src, bins=BINS, min=-4, max=4)


def _cumsum(device, n, gen):
    src = randn(gen, device, n)
    return lambda: src.cumsum(0)


def _embedding(bag: bool):
    def build(device, n, gen):
        dim = 64
        weight = randn(gen, device, BINS, dim, requires_grad=True)
        idx = indices(gen, device, max(n // dim, 16))
        if bag:
            offsets = torch.arange(0, idx.numel(), 8, device=device)
            grad_out = randn(gen, device, offsets.numel(), dim)
            return grad_of(lambda: F.embedding_bag(idx, weight, offsets, mode="sum"), [weight], grad_out)
        return grad_of(lambda: F.embedding(idx, weight), [weight], randn(gen, device, idx.numel(), dim))

    return build


INDEXED_ENTRIES: list[CatalogueEntry] = [
    *(
        CatalogueEntry(name, _scatter_like(name), note, routed=routed)
        for name, note, routed in [  # the name is the kind of _scatter_like; routed=(): PyTorch's kernels
            ("index_add_", "duplicate indices, atomic on CUDA", ("index_add_",)),
            ("scatter_add_", "duplicate indices, atomic on CUDA", ("scatter_add_",)),
            ("scatter_reduce_sum", "duplicate indices", ()),
            ("index_put_accumulate", "index_put_(accumulate=True), sorted in every mode", ()),
            ("put_accumulate", "put_(accumulate=True)", ("put_",)),
            ("bincount_weights", "weighted bincount", ("bincount",)),
            ("index_copy_duplicates", "index_copy_, duplicate indices", ()),
        ]
    ),
    *(
        CatalogueEntry(name, build, note, routed=routed)
        for name, build, note, routed in [
            ("index_reduce_prod", _index_reduce("prod"), "index_reduce(reduce='prod')", ("index_reduce",)),
            ("index_reduce_mean", _index_reduce("mean"), "index_reduce(reduce='mean')", ("index_reduce",)),
            ("index_reduce_amax", _index_reduce("amax"), "index_reduce(reduce='amax')", ("index_reduce",)),
            ("scatter_reduce_prod", _scatter_reduce_prod, "scatter_reduce(reduce='prod')", ("scatter_reduce.two",)),
            ("histc", _histc, "histogram", ("histc",)),
            ("median_dim", _median_dim, "median(dim): values and indices, with ties", ("median.dim_values",)),
            ("cumsum", _cumsum, "prefix sum over 1-D", ()),
            ("embedding_backward", _embedding(False), "embedding_dense_backward", ()),
            ("embedding_bag_backward", _embedding(True), "embedding_bag(mode='sum') backward", ()),
        ]
    ),
]
