"""The model zoo as the bar: is each architecture bitwise under DeterminismCallback, and what does it cost?

Per model of the zoo (``zoo_models.py``; ``--models`` takes names and groups: ``all``, ``vision``,
``classification``, ``segmentation``, ``detection``, ``video``, ``flow``, ``timm``, ``nlp``, ``audio``,
``graph``, ``bf16``, ``test``), every run a real ``Trainer.fit`` in a fresh process (``zoo_worker.py``):

1. verdicts, ``--parallel`` processes at a time on the one device: two runs of each of ``--verdict-modes``
   (default ``plugin``, i.e. ``DeterminismCallback``, and ``trainer_deterministic``, i.e.
   ``Trainer(deterministic=True)``) of ``--verdict-steps`` steps, each pair compared bitwise (losses and
   ``state_dict`` digest): ``bitwise`` / ``differs`` / ``raises``;
2. the tax, one process at a time: ``plain`` and ``plugin`` alternated ``--alternations`` times (ABBA order),
   each ``--warmup`` untimed + ``--steps`` timed + ``--profile-steps`` profiled steps; the tax is plugin median
   / plain median over all timed steps, also given per alternation. The plain runs' own verdict (are they
   bitwise without any determinism?) comes from the same runs;
3. attribution: the ``torch.profiler`` tables of the timing runs, plain against plugin, name the kernels and
   aten ops whose time per step grew most.

A model whose package is missing is ``skipped``; any failure is recorded and the next model runs; no model
starts once ``--budget-s`` has passed. ``DIR/zoo.json`` is rewritten after every model (results of models
from an earlier call with the same ``--out`` are kept, unless ``--fresh``), with the wall time each model
took; ``DIR/zoo_table.md`` is its table. Each run's report and log go to ``--runs-dir``.

    python benchmarks/bench_zoo.py --models vision --out benchmarks/results/zoo --budget-s 420
    python benchmarks/bench_zoo.py --models test --device cpu --out /tmp/zoo --warmup 1 --steps 3
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))

from zoo_models import ZooModel, missing_package, select_models  # noqa: E402
from zoo_table import markdown_table, summarise  # noqa: E402
from zoo_verdicts import attribution, tax, verdict  # noqa: E402


class Launcher:
    """Starts ``zoo_worker.py`` runs of one model and collects their reports (a crash becomes an error report)."""

    def __init__(self, args: argparse.Namespace, model: ZooModel) -> None:
        self.args, self.model = args, model
        self.folder = Path(args.runs_dir) / model.name
        self.folder.mkdir(parents=True, exist_ok=True)
        self.env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(_HERE.parent), os.environ.get("PYTHONPATH")])),
        }

    def start(
        self, mode: str, label: str, steps: int, warmup: int, profile_steps: int
    ) -> tuple[subprocess.Popen, Path]:
        report = self.folder / f"{label}.json"
        report.unlink(missing_ok=True)
        command = [sys.executable, str(_HERE / "zoo_worker.py"), "--model", self.model.name, "--mode", mode]
        command += ["--out", str(report), "--device", self.args.device, "--seed", str(self.args.seed)]
        command += ["--warmup", str(warmup), "--steps", str(steps), "--profile-steps", str(profile_steps)]
        log = open(self.folder / f"{label}.log", "w")  # noqa: SIM115 - closed by the child's exit
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        log.close()
        process.started = time.monotonic()  # type: ignore[attr-defined]
        return process, report

    def collect(self, process: subprocess.Popen, report: Path) -> dict[str, Any]:
        """Waits for ``process`` (killing its group past ``--process-timeout-s``) and returns its report."""
        left = self.args.process_timeout_s - (time.monotonic() - process.started)  # type: ignore[attr-defined]
        try:
            process.wait(timeout=max(left, 0.1))
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            return {
                "error": {
                    "type": "Timeout",
                    "message": f"killed after --process-timeout-s {self.args.process_timeout_s}",
                }
            }
        if report.exists():
            return json.loads(report.read_text())
        tail = (report.with_suffix(".log")).read_text(errors="replace").strip().splitlines()[-1:]
        message = f"exit code {process.returncode} without a report; last output: {tail[0] if tail else ''}"
        return {"error": {"type": "Crash", "message": message}}

    def run_parallel(self, jobs: list[tuple[str, str]], steps: int) -> dict[str, dict[str, Any]]:
        """``(mode, label)`` jobs of ``steps`` steps, at most ``--parallel`` at a time; reports by label."""
        reports: dict[str, dict[str, Any]] = {}
        pending, running = list(jobs), []
        while pending or running:
            while pending and len(running) < self.args.parallel:
                mode, label = pending.pop(0)
                running.append((label, *self.start(mode, label, steps, 0, 0)))
            label, process, report = running.pop(0)
            reports[label] = self.collect(process, report)
        return reports

    def run_one(self, mode: str, label: str) -> dict[str, Any]:
        args = self.args
        return self.collect(*self.start(mode, label, args.steps, args.warmup, args.profile_steps))


def measure(args: argparse.Namespace, model: ZooModel) -> dict[str, Any]:
    """The record of one model: verdicts, tax, attribution and the wall time of each stage."""
    record: dict[str, Any] = {"precision": model.precision, "groups": list(model.groups)}
    package = missing_package(model)
    if package is not None:
        return {**record, "skipped": f"{package} not installed"}
    launcher = Launcher(args, model)
    started = time.monotonic()
    jobs = [(mode, f"{mode}_{copy}") for mode in args.verdict_modes for copy in "ab"]
    runs = launcher.run_parallel(jobs, args.verdict_steps)
    for mode in args.verdict_modes:
        record[mode] = verdict([runs[f"{mode}_a"], runs[f"{mode}_b"]])
    record["verdict_wall_s"] = round(time.monotonic() - started, 1)
    if record.get("plugin", {}).get("verdict") == "raises" or args.alternations == 0:
        record["tax_note"] = "not timed: the plugin raises" if args.alternations else "not timed: --alternations 0"
        return record
    started = time.monotonic()
    pairs = []
    for alternation in range(args.alternations):
        order = ("plain", "plugin") if alternation % 2 == 0 else ("plugin", "plain")  # ABBA against drift
        done = {mode: launcher.run_one(mode, f"time_{mode}_{alternation}") for mode in order}
        pairs.append((done["plain"], done["plugin"]))
    record["timing_wall_s"] = round(time.monotonic() - started, 1)
    failed = next((report for pair in pairs for report in pair if "error" in report), None)
    if "plain" not in record:  # the plain pair of --verdict-modes, when given, stands
        record["plain"] = verdict([plain for plain, _ in pairs]) if len(pairs) > 1 else None
    record["plugin_timing_runs"] = verdict([plugin for _, plugin in pairs]) if len(pairs) > 1 else None
    if failed is not None:
        record["tax_note"] = f"not timed: a timing run raised {failed['error']['type']}"
        record["timing_error"] = failed["error"]
        return record
    record["tax"] = tax(pairs, args.warmup, args.steps)
    record["attribution"] = attribution([plain for plain, _ in pairs], [plugin for _, plugin in pairs])
    return record


def _write(args: argparse.Namespace, results: dict[str, Any], not_run: list[str], started: float) -> None:
    from _timing import write_json

    settings = {key: value for key, value in vars(args).items() if key not in ("out", "runs_dir", "fresh", "command")}
    payload = {
        "command": args.command,
        "settings": settings,
        "wall_s": round(time.monotonic() - started, 1),
        "not_run": not_run,
        "summary": summarise(results),
        "models": results,
    }
    write_json(Path(args.out) / "zoo.json", payload)
    (Path(args.out) / "zoo_table.md").write_text(markdown_table(results))


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["all"], help="model names and groups (default: all)")
    parser.add_argument("--out", required=True, help="folder of zoo.json and zoo_table.md")
    parser.add_argument("--runs-dir", default=None, help="each run's report and log (default: OUT/runs)")
    parser.add_argument("--budget-s", type=float, default=None, help="start no model after this many seconds")
    parser.add_argument("--parallel", type=int, default=4, help="verdict processes at a time")
    parser.add_argument("--alternations", type=int, default=2, help="plain/plugin timing pairs (0: no timing)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per timing run")
    parser.add_argument("--profile-steps", type=int, default=3, help="profiled steps after the timed ones")
    parser.add_argument(
        "--verdict-modes",
        nargs="+",
        default=["plugin", "trainer_deterministic"],
        choices=("plugin", "trainer_deterministic", "plain"),
        help="modes run twice in parallel and compared bitwise (plain's verdict also comes from the timing runs)",
    )
    parser.add_argument("--verdict-steps", type=int, default=5, help="steps of each verdict run")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--process-timeout-s", type=float, default=300.0)
    parser.add_argument("--fresh", action="store_true", help="drop the results of earlier calls in OUT/zoo.json")
    args = parser.parse_args(argv)
    for name, low in (("parallel", 1), ("alternations", 0), ("warmup", 0), ("steps", 1), ("profile_steps", 0)):
        if getattr(args, name) < low:
            parser.error(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(args, name)!r}")
    for name in ("verdict_steps", "budget_s", "process_timeout_s"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0, got {value!r}")
    try:
        args.selected = select_models(args.models)
    except ValueError as error:
        parser.error(str(error))
    args.runs_dir = args.runs_dir or str(Path(args.out) / "runs")
    args.command = " ".join(["python3 benchmarks/bench_zoo.py", *(sys.argv[1:] if argv is None else argv)])
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    selected: list[ZooModel] = args.selected
    del args.selected
    started = time.monotonic()
    path = Path(args.out) / "zoo.json"
    results: dict[str, Any] = {}
    if path.exists() and not args.fresh:
        results = json.loads(path.read_text()).get("models", {})
    not_run: list[str] = []
    for index, model in enumerate(selected):
        if args.budget_s is not None and time.monotonic() - started > args.budget_s:
            not_run = [later.name for later in selected[index:]]
            print(f"--budget-s {args.budget_s} passed: not run: {' '.join(not_run)}", flush=True)
            break
        model_started = time.monotonic()
        try:
            record = measure(args, model)
        except Exception as error:  # noqa: BLE001 - a driver failure on one model is that model's result
            record = {"precision": model.precision, "driver_error": f"{type(error).__name__}: {error}"}
        record["wall_s"] = round(time.monotonic() - model_started, 1)
        results[model.name] = record
        print(f"{model.name}: {json.dumps({k: v for k, v in record.items() if k != 'attribution'})[:400]}", flush=True)
        _write(args, results, not_run, started)
    _write(args, results, not_run, started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
