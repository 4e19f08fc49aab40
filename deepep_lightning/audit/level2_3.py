"""L2 (one step / one timestep) and L3 (a whole sequence) audits of a LightningModule, with the locator.

See :mod:`deepep_lightning.audit.targets` for the exact protocol. When repeats differ, the locator
re-runs the same repeat under :class:`~deepep_lightning.audit.op_hashes.OpHashMode` (a reference run,
then up to ``locate_attempts`` more until one differs from it) and names the first divergent op.
"""

from __future__ import annotations

import time
import traceback
import warnings
from typing import Any, cast

from deepep_lightning.audit.op_hashes import Divergence, locate
from deepep_lightning.audit.repeat import run_repeats
from deepep_lightning.audit.report import LevelResult, Status
from deepep_lightning.audit.targets import ModuleTarget, PreparedRun
from deepep_lightning.protocols import AuditLevel

__all__ = ["audit_module", "locate_divergence"]

_LEVELS = ("L2", "L3")


def locate_divergence(
    prepared: PreparedRun, attempts: int = 4, keep_bytes: int = 256 * 2**20
) -> tuple[Divergence | None, int]:
    """Run ``prepared`` under the op-hash mode until a run differs from the first; ``(divergence, runs)``.

    Returns ``(None, runs)`` when ``attempts`` further runs all matched the reference (a rare
    nondeterminism that did not show up again).
    """

    def make_run() -> tuple[Any, Any]:
        module = prepared.fresh_module()
        return module, lambda: prepared.run(module)

    return locate(make_run, attempts=attempts, keep_bytes=keep_bytes)


def audit_module(
    level: str = "L3",
    target: ModuleTarget | None = None,
    repeats: int = 10,
    locate: bool = True,
    locate_attempts: int = 4,
) -> LevelResult:
    """Audit one training step (L2) or one sequence (L3) of a LightningModule, ``repeats`` times in-process.

    Args:
        level: ``"L2"`` or ``"L3"``.
        target: what to audit (default: DeepEP with its defaults on the default device).
        repeats: repeats compared bitwise, >= 2.
        locate: on divergence, name the first divergent op (costs ``1 + attempts`` logged runs).
        locate_attempts: logged runs compared with the logged reference before giving up.

    Returns:
        A :class:`LevelResult`; ``status="error"`` (with the traceback's last line) when the module
        could not be built or stepped.

    Example::

        result = audit_module("L3", ModuleTarget(config="configs/default.yaml"), repeats=5)
        print(result.describe())
    """
    if level not in _LEVELS:
        raise ValueError(f"`level` must be one of {_LEVELS}, got {level!r}")
    if isinstance(locate_attempts, bool) or not isinstance(locate_attempts, int) or locate_attempts < 1:
        raise ValueError(f"`locate_attempts` must be an int >= 1, got {locate_attempts!r}")
    checked_level = cast(AuditLevel, level)  # one of _LEVELS, checked above
    target = target or ModuleTarget()
    name = target.name(checked_level)
    start = time.perf_counter()
    with warnings.catch_warnings():
        # training_step outside a Trainer: self.log() warns that there is no trainer, harmlessly
        warnings.filterwarnings("ignore", message=".*self.log.*")
        warnings.filterwarnings("ignore", message=".*trainer.*reference.*")
        try:
            prepared = target.prepare(checked_level)
            module_holder: dict[str, Any] = {}

            def reset() -> None:
                module_holder["module"] = prepared.fresh_module()

            stats = run_repeats(lambda: prepared.run(module_holder["module"]), repeats=repeats, reset=reset)
        except Exception as error:  # the audit reports, it does not crash: exit code 2
            return LevelResult(
                level,
                name,
                Status.ERROR,
                seconds=time.perf_counter() - start,
                error=f"{type(error).__name__}: {error}",
                details={"traceback": traceback.format_exc(limit=6)},
            )
        result = LevelResult(
            level,
            name,
            Status.REPRODUCIBLE if stats.reproducible else Status.DIVERGENT,
            repeats=stats.repeats,
            distinct_results=stats.distinct_results,
            max_abs_diff=stats.max_abs_diff,
            differing=stats.differing,
            details={"tensors_compared": stats.tensors, "repeat_seconds": stats.seconds},
        )
        if not stats.reproducible and locate:
            try:
                divergence, runs = locate_divergence(prepared, attempts=locate_attempts)
            except Exception as error:
                result.details["locator"] = f"failed: {type(error).__name__}: {error}"
            else:
                if divergence is None:
                    result.details["locator"] = f"{runs} logged runs were all identical (the difference is rare)"
                else:
                    result.divergence = divergence.to_dict()
                    result.details["locator_runs"] = runs
    result.seconds = time.perf_counter() - start
    return result
