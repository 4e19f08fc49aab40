"""One composable wrapper around ``LightningModule.training_step`` for the health callbacks.

Fault injection must reach into a step (poison the batch, a parameter or the
loss) and rollback must skip steps (run the step, drop its update). Both must also fire when a step
is *replayed*, which no Lightning hook surrounding the batch does. So the
callbacks register hooks here; the wrapper is an instance attribute installed
once per module and removed when the last hook is gone.

A pre-hook is ``fn(step, batch) -> batch``; a post-hook is ``fn(step, output) -> output``.
``step`` is ``trainer.global_step`` when the step starts (the 0-based index of the
optimizer step being computed). Hooks run in the order they were added, except
``innermost`` ones, which wrap the step most tightly: their pre-hooks run after all
others and their post-hooks before all others (rollback's skip must save the state
the step really starts from, after a fault was planted in it).

Rollback's skipped steps use such a hook (:mod:`deepep_lightning.health._step_skip`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl

from deepep_lightning._lightning_compat import attached_trainer
from deepep_lightning._patches import patch_training_step, unpatch_training_step

__all__: list[str] = []

_ATTR = "_deepep_health_step_hooks"


class _Hooks:
    def __init__(self) -> None:
        self.pre: dict[str, Callable[[int, Any], Any]] = {}
        self.post: dict[str, Callable[[int, Any], Any]] = {}
        self.innermost: set[str] = set()

    def ordered_pre(self) -> list[Callable[[int, Any], Any]]:
        return [fn for name, fn in self.pre.items() if name not in self.innermost] + [
            fn for name, fn in self.pre.items() if name in self.innermost
        ]

    def ordered_post(self) -> list[Callable[[int, Any], Any]]:
        return [fn for name, fn in self.post.items() if name in self.innermost] + [
            fn for name, fn in self.post.items() if name not in self.innermost
        ]


def _wrapper(module: pl.LightningModule, original: Callable[..., Any]) -> Callable[..., Any]:
    def training_step(batch: Any, *args: Any, **kwargs: Any) -> Any:
        hooks: _Hooks = module.__dict__[_ATTR]
        trainer = attached_trainer(module)
        step = trainer.global_step if trainer is not None else 0
        for fn in hooks.ordered_pre():
            batch = fn(step, batch)
        output = original(batch, *args, **kwargs)
        for fn in hooks.ordered_post():
            output = fn(step, output)
        return output

    training_step.__wrapped__ = original  # type: ignore[attr-defined]
    return training_step


def add_step_hook(
    module: pl.LightningModule,
    name: str,
    pre: Callable[[int, Any], Any] | None = None,
    post: Callable[[int, Any], Any] | None = None,
    innermost: bool = False,
) -> None:
    hooks = module.__dict__.get(_ATTR)
    if hooks is None:
        hooks = _Hooks()
        module.__dict__[_ATTR] = hooks
        patch_training_step(module, lambda original: _wrapper(module, original))
    if pre is not None:
        hooks.pre[name] = pre
    if post is not None:
        hooks.post[name] = post
    if innermost:
        hooks.innermost.add(name)


def remove_step_hook(module: pl.LightningModule, name: str) -> None:
    hooks = module.__dict__.get(_ATTR)
    if hooks is None:
        return
    hooks.pre.pop(name, None)
    hooks.post.pop(name, None)
    hooks.innermost.discard(name)
    if not hooks.pre and not hooks.post:
        del module.__dict__[_ATTR]
        unpatch_training_step(module)
