"""L1 catalogue entries of dense ops and DeepEP's own: GEMM, Linear and layer_norm backward, reductions, GRU cell.

Also action sampling and the DeepEP workload's ``deepep::all_action_q`` value head
(:mod:`deepep_lightning.deepep.kernels`, imported when its entry is built): its PyTorch reference, its
deterministic backward and its atomic backward (the negative control, CUDA only).
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


def _all_action_q(variant: str):
    def build(device, n, gen):
        rows, actions, hidden = max(16, n // 512), 4, 128
        z = randn(gen, device, rows, hidden, requires_grad=True)
        e = randn(gen, device, actions, hidden, requires_grad=True)
        w = randn(gen, device, hidden, requires_grad=True)
        b = randn(gen, device, 1, requires_grad=True)
        grad_out = randn(gen, device, rows, actions)
        if variant == "reference":
            from deepep_lightning.deepep.kernels import all_action_q_reference as op

            forward = lambda: op(z, e, w, b)  # noqa: E731
        else:
            from deepep_lightning.deepep.kernels import all_action_q
            from deepep_lightning.ops import extension_available

            if not extension_available():
                raise RuntimeError("the C++ extension did not load (see deepep_lightning.ops.extension_error())")
            forward = lambda: all_action_q(z, e, w, b, deterministic=variant == "fused")  # noqa: E731
        return grad_of(forward, [z, e, w, b], grad_out)

    return build


DENSE_ENTRIES: list[CatalogueEntry] = [
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
