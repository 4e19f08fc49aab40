"""Every live method patch the plugin installs on a Lightning object, in one place.

Some behaviour has no Lightning hook: an unreadable checkpoint must raise an error naming the file,
fault injection and rollback must reach inside ``training_step`` (also when a step is replayed), a
skipped step must run its closure but not the optimizer, and a replay must not log the step twice.
Each of these replaces a method on one *instance* (an instance attribute over the class method, so
the class and other instances are untouched) through a named pair of functions here: installing and
removing, so ``grep _patches`` lists every patch and a Lightning upgrade that changes one of these
methods' signatures breaks in this file's callers only. Reads of Lightning's private state are in
:mod:`deepep_lightning._lightning_compat`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = [
    "patch_optimizer_step",
    "patch_strategy_load_checkpoint",
    "patch_training_step",
    "silenced_logging",
    "unpatch_optimizer_step",
    "unpatch_strategy_load_checkpoint",
    "unpatch_training_step",
]


# ---------------------------------------------------------------- Strategy.load_checkpoint
def patch_strategy_load_checkpoint(
    strategy: "pl.strategies.Strategy", wrap: Callable[[Callable[..., Any]], Callable[..., Any]]
) -> None:
    """Replace ``strategy.load_checkpoint`` by ``wrap(strategy.load_checkpoint)`` on this strategy instance.

    The loader is the one call every resume makes with the checkpoint path, before Lightning reads it.
    """
    strategy.load_checkpoint = wrap(strategy.load_checkpoint)  # type: ignore[method-assign]


def unpatch_strategy_load_checkpoint(strategy: "pl.strategies.Strategy") -> None:
    """Undo :func:`patch_strategy_load_checkpoint` (the class method is seen again)."""
    vars(strategy).pop("load_checkpoint", None)


# ---------------------------------------------------------------- LightningModule.training_step
def patch_training_step(module: "pl.LightningModule", wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace ``module.training_step`` by ``wrap(module.training_step)`` on this module instance.

    Lightning calls ``training_step`` through the module (the strategy's wrapper forwards to it), in the
    fit loop and in a replay alike, so a wrapper installed here sees every step.
    """
    module.__dict__["training_step"] = wrap(module.training_step)


def unpatch_training_step(module: "pl.LightningModule") -> None:
    """Undo :func:`patch_training_step`."""
    module.__dict__.pop("training_step", None)


# ---------------------------------------------------------------- LightningModule.optimizer_step
def patch_optimizer_step(
    module: "pl.LightningModule", wrap: Callable[[Callable[..., Any]], Callable[..., Any]]
) -> None:
    """Replace the module's ``optimizer_step`` hook by ``wrap(original)``, where ``original`` is the class's hook.

    Lightning counts the optimizer step around this hook (its progress counters advance either way), and
    the hook receives the closure that runs the training step and backward.
    """
    original = type(module).optimizer_step.__get__(module)
    module.__dict__["optimizer_step"] = wrap(original)


def unpatch_optimizer_step(module: "pl.LightningModule") -> None:
    """Undo :func:`patch_optimizer_step`."""
    module.__dict__.pop("optimizer_step", None)


# ---------------------------------------------------------------- LightningModule.log / log_dict
def _noop(*args: Any, **kwargs: Any) -> None:
    return None


@contextlib.contextmanager
def silenced_logging(module: "pl.LightningModule") -> Iterator[None]:
    """Make ``module.log`` and ``module.log_dict`` do nothing inside the block (a replayed step was logged already).

    Instance attributes the module had before are put back afterwards.
    """
    had = {name: name in module.__dict__ for name in ("log", "log_dict")}
    saved = {name: module.__dict__.get(name) for name in had}
    module.__dict__["log"] = _noop
    module.__dict__["log_dict"] = _noop
    try:
        yield
    finally:
        for name, present in had.items():
            if present:
                module.__dict__[name] = saved[name]
            else:
                module.__dict__.pop(name, None)
