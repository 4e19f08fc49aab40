"""L1 catalogue entries of dense ops: GEMM, Linear and layer_norm backward, reductions, the GRU cell and
seeded action sampling (the dense ops DeepEP's step is made of).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepep_lightning.audit.catalogue.entry import CatalogueEntry, grad_of, randn

__all__ = ["DENSE_ENTRIES"]


def _dense(kind: str):
    def build(device, n, gen):
        rows = max(16, n // 256)
        x = randn(gen, device, rows, 256, requires_grad=True)
        w = randn(gen, device, 256, 256, requires_grad=True)
        if kind == "matmul":
            return lambda: x.detach() @ w.detach()
        if kind == "linear_backward":
            return grad_of(lambda: F.linear(x, w), [x, w], randn(gen, device, rows, 256))
        if kind == "layer_norm_backward":
            ln_w = randn(gen, device, 256, requires_grad=True)
            return grad_of(lambda: F.layer_norm(x, (256,), ln_w), [x, ln_w], randn(gen, device, rows, 256))
        if kind == "softmax":
            return lambda: torch.softmax(x.detach(), dim=-1)
        if kind == "sum":
            return lambda: x.detach().sum()
        raise KeyError(kind)

    return build


def _gru_cell(device, n, gen):
    batch, hidden = max(8, n // 4096), 256
    cell = torch.nn.GRUCell(hidden, hidden).to(device)
    x, h = randn(gen, device, batch, hidden, requires_grad=True), randn(gen, device, batch, hidden)
    params = [x, *cell.parameters()]
    return grad_of(lambda: cell(x, h), params, randn(gen, device, batch, hidden))


def _multinomial(device, n, gen):
    probs = torch.rand(max(8, n // 64), 8, generator=gen).to(device) + 0.01
    sampler = torch.Generator(device=device)

    def run():
        sampler.manual_seed(0)  # DeepEP reseeds its rollout generator every step: same draws, same seed
        return torch.multinomial(probs, 1, generator=sampler)

    return run


DENSE_ENTRIES: list[CatalogueEntry] = [
    CatalogueEntry("matmul", _dense("matmul"), "GEMM (cuBLAS)"),
    CatalogueEntry("linear_backward", _dense("linear_backward"), "DeepEP: Linear backward"),
    CatalogueEntry("layer_norm_backward", _dense("layer_norm_backward"), "layer_norm backward"),
    CatalogueEntry("softmax", _dense("softmax"), "DeepEP: policy softmax"),
    CatalogueEntry("sum", _dense("sum"), "full reduction"),
    CatalogueEntry("gru_cell", _gru_cell, "DeepEP: recurrent cell forward+backward"),
    CatalogueEntry("multinomial", _multinomial, "DeepEP: action sampling, seeded generator"),
]
