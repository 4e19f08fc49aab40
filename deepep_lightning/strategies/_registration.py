"""Register ``"ddp_deterministic"`` with Lightning as soon as ``lightning.pytorch`` is importable, cheaply.

``import deepep_lightning`` must stay light (``deepep-compare`` never loads Lightning), yet
``Trainer(strategy="ddp_deterministic")`` must work after it. Every Trainer needs
``lightning.pytorch`` fully imported, so registering right after that import finishes is enough:
when it is already loaded we register now; otherwise a meta-path finder wraps the loader of
``lightning.pytorch`` and registers when its ``__init__`` has run. Registration is idempotent.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

__all__ = ["DESCRIPTION", "STRATEGY_NAME", "register", "register_when_lightning_loads"]

_TARGET = "lightning.pytorch"


#: Name and description of the registry entry (also used by ``DeterministicDDPStrategy.register_strategies``).
STRATEGY_NAME = "ddp_deterministic"
DESCRIPTION = "DDP with pinned NCCL profile, seeded shards and per-rank seeds (deepep_lightning)"


def _make_deterministic_ddp(**kwargs: Any) -> Any:
    """Registry factory: imports the strategy only when a Trainer asks for it."""
    from deepep_lightning.strategies.deterministic_ddp import DeterministicDDPStrategy

    return DeterministicDDPStrategy(**kwargs)


def register() -> None:
    """Register ``"ddp_deterministic"`` in Lightning's ``StrategyRegistry`` (idempotent).

    Registers a factory, so it never imports the strategy module: it can run in the middle of any
    import (this package's modules import Lightning, which triggers the hook). Importing
    ``deterministic_ddp`` replaces the entry by the class itself.
    """
    from lightning.pytorch.strategies import StrategyRegistry

    if STRATEGY_NAME in StrategyRegistry and isinstance(StrategyRegistry[STRATEGY_NAME]["strategy"], type):
        return  # the class itself is already registered
    StrategyRegistry.register(STRATEGY_NAME, _make_deterministic_ddp, description=DESCRIPTION, override=True)


class _RegisteringLoader(importlib.abc.Loader):
    """Delegates to the real loader of ``lightning.pytorch`` and registers after it ran."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        _remove_finder()
        register()

    def __getattr__(self, name: str) -> Any:  # get_resource_reader, is_package, ...
        return getattr(self._loader, name)


class _LightningFinder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != _TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader = _RegisteringLoader(spec.loader)
                return spec
            if spec is not None:
                return None  # a loader we cannot wrap: let the normal import run (register() later by hand)
        return None


def _remove_finder() -> None:
    sys.meta_path[:] = [finder for finder in sys.meta_path if not isinstance(finder, _LightningFinder)]


def register_when_lightning_loads() -> None:
    """Register now if ``lightning.pytorch`` is loaded, else as soon as it is (installs one finder)."""
    module = sys.modules.get(_TARGET)
    if module is not None and hasattr(module, "Trainer"):
        register()
        return
    if module is not None:
        return  # being imported right now by the finder's loader, which registers when done
    if not any(isinstance(finder, _LightningFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _LightningFinder())
