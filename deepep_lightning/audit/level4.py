"""L4: K training steps twice in fresh processes (optionally killed and resumed), compared bitwise.

Run A trains ``steps`` steps uninterrupted. Run B does the same in another fresh process or, with
``resume_at=S``, is SIGKILLed after step ``S`` (checkpoint every step) and resumed from
``last.ckpt`` in a third process. Compared: the final model ``state_dict`` and optimizer states
(bitwise), and every TensorBoard scalar at every step via
:func:`deepep_lightning.compare.compare_runs`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from deepep_lightning.audit.hashing import bitwise_equal, iter_named_tensors, max_abs_diff
from deepep_lightning.audit.report import LevelResult, Status
from deepep_lightning.audit.targets import DEEPEP_TARGET

__all__ = ["audit_training", "compare_states"]

_RUNNER = "deepep_lightning.audit._l4_runner"
_NEXT_STEP = (
    "next: `deepep-audit l3` (same --target/--config) names the first divergent op if one step already"
    " differs in-process; if L3 is reproducible, the difference comes from the loop: data order, RNG"
    " or state not restored on resume (try --determinism), or the environment of the process"
)


def compare_states(first: Any, second: Any) -> dict[str, float | None]:
    """``{name: max |diff|}`` for every tensor that is not bitwise equal (missing on one side: None)."""
    a = dict(iter_named_tensors(first))
    b = dict(iter_named_tensors(second))
    differing: dict[str, float | None] = {}
    for name in sorted(set(a) | set(b)):
        if name not in a or name not in b:
            differing[name] = None
        elif not bitwise_equal(a[name], b[name]):
            differing[name] = max_abs_diff(a[name], b[name])
    return differing


def _run(command: list[str], timeout: float, env: dict[str, str]) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return None


def _run_parallel(
    batch: dict[str, list[str]], timeout: float, env: dict[str, str]
) -> dict[str, subprocess.CompletedProcess | None]:
    with ThreadPoolExecutor(max_workers=len(batch)) as pool:
        futures = {name: pool.submit(_run, command, timeout, env) for name, command in batch.items()}
        return {name: future.result() for name, future in futures.items()}


def _tail(done: subprocess.CompletedProcess, lines: int = 6) -> str:
    return " | ".join((done.stderr or done.stdout or "").strip().splitlines()[-lines:])


def audit_training(
    target: str | None = None,
    config: str | None = None,
    steps: int = 6,
    resume_at: int | None = None,
    determinism: bool = False,
    seed: int = 0,
    extra_args: Sequence[str] = (),
    workdir: str | None = None,
    timeout: float = 600.0,
    parallel: bool = True,
    data: str | None = None,
) -> LevelResult:
    """Train twice in fresh subprocesses and compare (L4).

    Args:
        target: ``"package.module:Class"`` (default DeepEP); must be importable in a subprocess
            started in the current directory (``PYTHONPATH`` is passed on).
        config: a LightningCLI YAML (``train.py`` style) or a plain YAML of constructor kwargs.
        steps: optimizer steps per run.
        resume_at: kill run B after this step and resume it (``0 < resume_at < steps``).
        determinism: add :class:`~deepep_lightning.determinism.DeterminismCallback` to both runs.
        seed: ``seed_everything`` (and DeepEP's seed).
        extra_args: more LightningCLI arguments, e.g. ``["--model.execution.fused_value_head=false"]``.
        workdir: where runs ``a`` and ``b`` are written (default: a temporary directory, removed).
        timeout: seconds per subprocess.
        parallel: start run a and run b together (they are independent; results do not depend on it).
        data: ``"package.module:DataModule"`` to fit with (init args from the config's ``data:`` section);
            None: the config's ``data:`` class when it names one, else the module's own loaders.

    Returns:
        A :class:`LevelResult` with ``details["scalars"]`` (the compare table) and
        ``details["state_differences"]``; ``status="error"`` when a run failed.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"`steps` must be an int >= 1, got {steps!r}")
    if resume_at is not None and (
        isinstance(resume_at, bool) or not isinstance(resume_at, int) or not 0 < resume_at < steps
    ):
        raise ValueError(f"`resume_at` must be an int in [1, {steps - 1}] (kill after that step), got {resume_at!r}")
    spec = target or DEEPEP_TARGET
    label = f"{spec.rsplit(':', 1)[-1]} ({steps} steps, 2 fresh processes"
    label += f", run b killed after step {resume_at} and resumed)" if resume_at else ")"
    start = time.perf_counter()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), env.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory() as tmp:
        root = workdir or tmp
        if config:  # every process reads the same snapshot, even if the file is edited meanwhile
            os.makedirs(root, exist_ok=True)
            snapshot = os.path.join(root, "config" + os.path.splitext(config)[1])
            shutil.copyfile(config, snapshot)
            config = snapshot
        base = [sys.executable, "-m", _RUNNER, "--target", spec, "--steps", str(steps), "--seed", str(seed)]
        base += ["--config", config] if config else []
        base += ["--data", data] if data else []
        base += ["--determinism"] if determinism else []
        tail = ["--", *extra_args] if extra_args else []
        plans = {"a": [base + ["--out", os.path.join(root, "a")] + tail]}
        run_b = base + ["--out", os.path.join(root, "b")]
        plans["b"] = (
            [run_b + tail]
            if resume_at is None
            else [run_b + ["--kill-at", str(resume_at)] + tail, run_b + ["--resume"] + tail]
        )
        commands = [" ".join(c) for plan in plans.values() for c in plan]
        # the first process of each run starts together (independent); run b's resume follows its kill
        for stage in range(max(len(plan) for plan in plans.values())):
            batch = {name: plan[stage] for name, plan in plans.items() if stage < len(plan)}
            if not parallel:
                outcomes = {name: _run(command, timeout, env) for name, command in batch.items()}
            else:
                outcomes = _run_parallel(batch, timeout, env)
            for name, done in outcomes.items():
                killed = resume_at is not None and name == "b" and stage == 0
                error = None
                if done is None:
                    error = f"run {name} timed out after {timeout} s"
                elif killed and done.returncode != -9:
                    error = (
                        f"run b was to be killed after step {resume_at} but exited with {done.returncode}:"
                        f" {_tail(done)}"
                    )
                elif not killed and done.returncode != 0:
                    error = f"run {name} failed (exit {done.returncode}): {_tail(done)}"
                if error:
                    return LevelResult(
                        "L4",
                        label,
                        Status.ERROR,
                        seconds=time.perf_counter() - start,
                        error=error,
                        details={"commands": commands},
                    )
        result = _compare(root, label, commands)
    result.seconds = time.perf_counter() - start
    return result


def _compare(root: str, label: str, commands: list[str]) -> LevelResult:
    from deepep_lightning.compare import compare_runs

    states = [torch.load(os.path.join(root, r, "final.pt"), map_location="cpu", weights_only=False) for r in "ab"]
    state_diff = compare_states(states[0], states[1])
    try:
        scalars = compare_runs([os.path.join(root, "a", "tb"), os.path.join(root, "b", "tb")])
    except Exception as error:  # no scalars logged is not a divergence; say so
        scalars_identical, table, scalars_dict = True, f"scalars not compared: {error}", None
    else:
        scalars_identical, table, scalars_dict = scalars.identical, scalars.format_table(), scalars.to_dict()
    reproducible = not state_diff and scalars_identical
    known = [d for d in state_diff.values() if d is not None]
    differing = list(state_diff)[:20]
    if not scalars_identical and scalars_dict is not None:
        differing += [f"scalar:{t}" for t in _differing_tags(scalars_dict)]
    return LevelResult(
        "L4",
        label,
        Status.REPRODUCIBLE if reproducible else Status.DIVERGENT,
        repeats=2,
        distinct_results=1 if reproducible else 2,
        max_abs_diff=max(known, default=0.0 if reproducible else None),
        differing=differing,
        details={
            "table": table,
            **({} if reproducible else {"note": _NEXT_STEP}),
            "scalars": scalars_dict,
            "state_differences": state_diff,
            "commands": commands,
            "global_steps": [s.get("global_step") for s in states],
        },
    )


def _differing_tags(scalars: dict) -> list[str]:
    tags: list[str] = []
    for pair in scalars.get("comparisons", []):
        for tag, info in (pair.get("tags") or {}).items():
            if isinstance(info, dict) and not info.get("identical", True):
                tags.append(tag)
    return tags
