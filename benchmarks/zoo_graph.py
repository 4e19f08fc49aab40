"""Graph models of the zoo: PyG's GCN, GAT, GraphSAGE, GIN and PNA, full-batch node classification.

The graph is synthetic and drawn once from the seeded generator: 10,000 nodes with 128 features, 200,000
random directed edges, 16 classes. Message passing sums messages with ``scatter``/``index_add``, the ops whose
deterministic variants the benchmark's attribution looks for.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from zoo_models import ZooModel, ZooTask

__all__ = ["MODELS"]

NODES, FEATURES, EDGES, CLASSES, HIDDEN, LAYERS = 10_000, 128, 200_000, 16, 256, 3


def _node_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    features, edge_index, labels = batch
    return F.cross_entropy(model(features, edge_index), labels)


def _gnn(name: str):
    def build(generator: torch.Generator) -> ZooTask:
        from torch_geometric.nn import models
        from torch_geometric.utils import degree

        edge_index = torch.randint(0, NODES, (2, EDGES), generator=generator)
        graph = (
            torch.randn(NODES, FEATURES, generator=generator),
            edge_index,
            torch.randint(0, CLASSES, (NODES,), generator=generator),
        )
        kwargs: dict[str, Any] = {}
        if name == "GAT":
            kwargs = {"heads": 4}
        if name == "PNA":
            in_degree = degree(edge_index[1], NODES, dtype=torch.long)
            kwargs = {
                "aggregators": ["mean", "min", "max", "std"],
                "scalers": ["identity", "amplification", "attenuation"],
                "deg": torch.bincount(in_degree),
            }
        model = getattr(models, name)(FEATURES, HIDDEN, LAYERS, CLASSES, **kwargs)
        return ZooTask(model, [graph], _node_loss)

    return build


MODELS = [
    ZooModel(f"pyg_{name.lower()}", ("graph",), ("torch_geometric",), _gnn(name))
    for name in ("GCN", "GAT", "GraphSAGE", "GIN", "PNA")
]
