"""Host copies of training state, and their restore in place (tensor identities kept for CUDA graphs).

A snapshot copies every tensor of the model, optimizer and rollout state to host memory
(:func:`to_host`; CUDA tensors into pinned memory, asynchronously) and back (:func:`to_device`).
Restoring is **in place**: parameters, buffers and optimizer state are copied into the live
tensors, never replaced (:func:`restore_module`, :func:`restore_optimizer`), because a captured
CUDA graph (e.g. a module whose step is one graph) keeps raw pointers to them and would otherwise
go on reading freed memory. Optimizer state that did not exist at the copy is returned to "no step
taken yet" (:func:`reset_optimizer_state`).

A sharded tensor (``DTensor``: FSDP2's ``fully_shard``, tensor parallel) is copied as this rank's
local shard, with its placements and global shape, and restored into the live ``DTensor``'s local
shard: the layout, the device mesh and the tensor's identity stay as they are. A sharded entry
whose live counterpart has another layout is refused (:class:`RuntimeError`): loading a local shard
as a whole tensor would silently break the model.
"""

from __future__ import annotations

import copy
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from deepep_lightning._sharded import local

__all__ = ["copy_into", "reset_optimizer_state", "restore_module", "restore_optimizer", "to_device", "to_host"]

_LEAF = "__snapshot_tensor__"


def to_host(tree: Any, events: list[torch.device]) -> Any:
    """Copy every tensor of ``tree`` to host memory; CUDA tensors go to pinned memory asynchronously."""
    if isinstance(tree, Tensor):
        layout = _layout(tree)
        source = local(tree.detach())
        if source.device.type == "cuda":
            host = torch.empty(source.shape, dtype=source.dtype, pin_memory=True)
            host.copy_(source, non_blocking=True)
            events.append(source.device)
        else:
            host = source.clone()
        leaf = {_LEAF: host, "device": str(source.device)}
        if layout is not None:
            leaf["layout"] = layout
        return leaf
    if isinstance(tree, dict):
        return {k: to_host(v, events) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        items = [to_host(v, events) for v in tree]
        return items if isinstance(tree, list) else tuple(items)
    return copy.deepcopy(tree)


def _layout(tensor: Tensor) -> str | None:
    """``"(Shard(dim=0),) [16, 8]"``: a ``DTensor``'s placements and global shape (``None`` for a plain tensor)."""
    if not isinstance(tensor, DTensor):
        return None
    return f"{tensor.placements} {list(tensor.shape)}"


def _refuse_layout(name: str, live: Any, saved: dict[str, Any]) -> RuntimeError:
    return RuntimeError(
        f"Cannot restore {name!r} in place: the snapshot holds a shard of layout {saved.get('layout')!r}, the live "
        f"tensor has {_layout(live) if isinstance(live, Tensor) else type(live).__name__!r}. HINT: restore "
        "snapshots into the sharding (mesh, placements, world size) that took them."
    )


def to_device(tree: Any) -> Any:
    """Fresh tensors on their original devices (the host copy stays untouched for the next restore)."""
    if isinstance(tree, dict):
        if _LEAF in tree:
            return tree[_LEAF].to(tree["device"], copy=True)
        return {k: to_device(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        items = [to_device(v) for v in tree]
        return items if isinstance(tree, list) else tuple(items)
    return copy.deepcopy(tree)


def copy_into(current: Any, saved: Any) -> bool:
    """``current.copy_(saved)`` when both are tensors of one shape and dtype; False when it cannot.

    A ``DTensor`` ``current`` takes ``saved`` (its local shard, or a ``DTensor`` of the same layout)
    into its local shard.
    """
    if not (isinstance(current, Tensor) and isinstance(saved, Tensor)):
        return False
    if isinstance(saved, DTensor) and _layout(saved) != _layout(current):
        return False
    current, saved = local(current), local(saved)
    if current.shape != saved.shape or current.dtype != saved.dtype:
        return False
    with torch.no_grad():
        current.copy_(saved)
    return True


def reset_optimizer_state(optimizer: torch.optim.Optimizer, param: Tensor) -> None:
    """Return ``param``'s optimizer state to "no step taken yet"."""
    live = optimizer.state.get(param)
    # Adam and AdamW create step 0 and zero moments lazily at their first step: zeroing the live
    # tensors in place is that same state, without freeing what a captured graph points to.
    adam = isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW))
    if live and adam and all(isinstance(v, Tensor) for v in live.values()):
        with torch.no_grad():
            for value in live.values():
                value.zero_()
    else:
        optimizer.state.pop(param, None)


def restore_module(pl_module: "pl.LightningModule", saved: dict[str, Any]) -> None:
    """Copy the saved parameters and buffers into the live ones (host → device, in place)."""
    live = pl_module.state_dict(keep_vars=True)
    if live.keys() != saved.keys():
        pl_module.load_state_dict(to_device(saved))  # raises load_state_dict's own missing/unexpected-key error
        return
    rest = {}
    for name, value in saved.items():
        leaf = value.get(_LEAF) if isinstance(value, dict) else None
        sharded = isinstance(value, dict) and "layout" in value
        if sharded and value["layout"] != _layout(live[name]):
            raise _refuse_layout(name, live[name], value)
        if not copy_into(live[name], leaf):
            rest[name] = to_device(value)
    if rest:  # extra state, or a tensor whose shape changed: only load_state_dict knows what to do
        pl_module.load_state_dict(rest, strict=False)


def restore_optimizer(optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    """Load ``saved`` into ``optimizer``, copying into the live state tensors.

    In-place copies keep tensor identities (what a captured CUDA graph relies on). A state entry
    absent from the snapshot (no step taken yet) is zeroed in place for Adam/AdamW (identical to
    their lazily created state) and removed for other optimizers, as in a fresh optimizer. Only a
    changed number of param groups falls back to ``optimizer.load_state_dict`` (new tensors; a
    captured graph reading the old ones must then be captured again).
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if len(saved["param_groups"]) != len(optimizer.param_groups):
        optimizer.load_state_dict(to_device(saved))
        return
    for group, saved_group in zip(optimizer.param_groups, saved["param_groups"]):
        for key, value in saved_group.items():
            if key == "params":
                continue
            restored = to_device(value)
            if not copy_into(group.get(key), restored):  # a tensor lr is read by the graph too
                group[key] = restored
    for index, param in enumerate(params):
        saved_state = saved["state"].get(index)
        if saved_state is None:
            reset_optimizer_state(optimizer, param)
            continue
        live = optimizer.state.setdefault(param, {})
        for key in list(live):
            if key not in saved_state:
                del live[key]
        for key, value in saved_state.items():
            current = live.get(key)
            if isinstance(value, dict) and "layout" in value:
                _restore_sharded_state(live, key, value, param, index)
                continue
            restored = to_device(value)
            if not (
                isinstance(current, Tensor)
                and isinstance(restored, Tensor)
                and current.device == restored.device
                and copy_into(current, restored)
            ):
                live[key] = restored


def _restore_sharded_state(live: dict[str, Any], key: str, saved: dict[str, Any], param: Tensor, index: int) -> None:
    """Put a sharded optimizer-state entry back: into the live ``DTensor``, else one laid out like ``param``."""
    current = live.get(key)
    if isinstance(current, DTensor):
        if saved["layout"] != _layout(current) or not copy_into(current, saved[_LEAF]):
            raise _refuse_layout(f"optimizer state {key!r} of parameter {index}", current, saved)
        return
    # absent (e.g. the state a fresh optimizer creates lazily): FSDP2 keeps it in the parameter's layout
    if not isinstance(param, DTensor) or saved["layout"] != _layout(param):
        raise _refuse_layout(f"optimizer state {key!r} of parameter {index}", param, saved)
    shard = saved[_LEAF].to(saved["device"], copy=True)
    live[key] = DTensor.from_local(
        shard, param.device_mesh, param.placements, shape=param.shape, stride=param.stride(), run_check=False
    )
