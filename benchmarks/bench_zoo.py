"""The model zoo as the bar: is each architecture bitwise under DeterminismCallback, and what does it cost?

Per model of the zoo (``zoo_models.py``; ``--models`` takes names and groups: ``all``, ``vision``,
``classification``, ``segmentation``, ``detection``, ``video``, ``flow``, ``timm``, ``nlp``, ``audio``,
``graph``, ``bf16``, ``test``), every run a real ``Trainer.fit`` in a fresh process (``zoo_worker.py``), in two
stages (``--stages``):

1. ``verdict``, for all selected models first, ``--parallel`` processes at a time on the one device (across
   models): two runs of each of ``--verdict-modes`` (default ``plugin``, i.e. ``DeterminismCallback``, and
   ``trainer_deterministic``, i.e. ``Trainer(deterministic=True)``) of ``--verdict-steps`` steps, each pair
   compared bitwise (losses and ``state_dict`` digest): ``bitwise`` / ``differs`` / ``raises``;
2. ``timing``, model by model, one process at a time: ``plain`` and ``plugin`` alternated ``--alternations``
   times (ABBA order), each ``--warmup`` untimed + ``--steps`` timed steps, then ``--profile-steps`` steps,
   profiled in the last alternation's runs; the tax is plugin median / plain median over all timed steps, also given
   per alternation. The next run's process starts while one runs and waits, imported and built, for its turn.
   The plain runs' own verdict (bitwise without any determinism?) comes from the same runs. Attribution: the
   ``torch.profiler`` tables of the profiled runs, plain against plugin, name the kernels and aten ops whose time
   per step grew most.

A model whose package is missing is ``skipped``; any failure is recorded and the next model runs. Past
``--budget-s`` no model starts its verdict runs and no model starts its timing runs (listed in ``not_run``).
``DIR/zoo.json`` is rewritten whenever a model's stage ends; a stage's fields are merged into the model's
record from earlier calls with the same ``--out`` (``--fresh`` starts over), so one call can judge the whole
zoo (``--stages verdict``) and later calls time it group by group. Each record has the wall time of its stages
(``verdict_wall_s`` counts the models it overlapped with). ``DIR/zoo_table.md`` is the table; each run's
report and log go to ``--runs-dir``.

    python benchmarks/bench_zoo.py --models vision --out benchmarks/results/zoo --budget-s 420
    python benchmarks/bench_zoo.py --models test --device cpu --out /tmp/zoo --warmup 1 --steps 3
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))

from zoo_models import ZooModel, missing_package, select_models  # noqa: E402
from zoo_table import markdown_table, summarise  # noqa: E402
from zoo_verdicts import attribution, tax, verdict  # noqa: E402


@dataclasses.dataclass
class Run:
    """One ``zoo_worker.py`` process and where its report goes."""

    process: subprocess.Popen
    report: Path
    started: float

    def release(self) -> None:
        """Lets a held run (``--hold``) go on to its fit; its time limit counts from now."""
        if self.process.stdin is not None:
            try:
                self.process.stdin.write(b"go\n")
                self.process.stdin.close()
            except BrokenPipeError:  # it died while held: collect() reports the crash
                pass
        self.started = time.monotonic()


@dataclasses.dataclass(frozen=True)
class TimingJob:
    """One timing run of a model: its mode, its label and whether it is profiled."""

    model: ZooModel
    mode: str
    label: str
    profile: bool


def _worker_env() -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(_HERE.parent), os.environ.get("PYTHONPATH")])),
    }


def start_run(
    args: argparse.Namespace, model: ZooModel, mode: str, label: str, *, timing: bool, profile: bool, hold: bool
) -> Run:
    """Starts one fit of ``model`` in ``mode``: a timing run (warm-up, timed and, when ``profile``, profiled
    steps) or a verdict run; ``hold``: the process imports and builds, then waits for :meth:`Run.release`."""
    folder = Path(args.runs_dir) / model.name
    folder.mkdir(parents=True, exist_ok=True)
    report = folder / f"{label}.json"
    report.unlink(missing_ok=True)
    steps = ["--warmup", str(args.warmup), "--steps", str(args.steps), "--profile-steps", str(args.profile_steps)]
    steps += [] if profile else ["--skip-profiler"]
    if not timing:
        steps = ["--warmup", "0", "--steps", str(args.verdict_steps), "--profile-steps", "0"]
    command = [sys.executable, str(_HERE / "zoo_worker.py"), "--model", model.name, "--mode", mode]
    command += ["--out", str(report), "--device", args.device, "--seed", str(args.seed), *steps]
    command += ["--hold"] if hold else []
    with open(folder / f"{label}.log", "w") as log:
        process = subprocess.Popen(
            command,
            stdin=subprocess.PIPE if hold else subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=_worker_env(),
            start_new_session=True,
        )
    return Run(process, report, time.monotonic())


class TimingQueue:
    """Timing runs one at a time, each in a fresh process; the next run's process is started while one runs.

    The next process imports its packages and builds its model on the CPU, then waits (``--hold``) until the
    running one has ended: only one process uses the device at a time, and a run's clock starts after
    start-up, so the queue hides the start-up of all runs but the first.
    """

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.held: tuple[TimingJob, Run] | None = None

    def _start(self, job: TimingJob) -> Run:
        return start_run(self.args, job.model, job.mode, job.label, timing=True, profile=job.profile, hold=True)

    def run(self, job: TimingJob, upcoming: TimingJob | None) -> dict[str, Any]:
        """Runs ``job`` (the held process, if it is that job's) with ``upcoming`` held behind it; its report."""
        if self.held is not None and self.held[0] == job:
            run = self.held[1]
            self.held = None
        else:
            self.discard()
            run = self._start(job)
        run.release()
        if upcoming is not None:
            self.held = (upcoming, self._start(upcoming))
        return collect(self.args, run)

    def discard(self) -> None:
        """Ends the held process, if any (its job will not run)."""
        if self.held is not None:
            os.killpg(self.held[1].process.pid, signal.SIGKILL)
            self.held[1].process.wait()
            self.held = None


def finished(args: argparse.Namespace, run: Run) -> bool:
    """True once ``run`` has exited or outlived ``--process-timeout-s``."""
    return run.process.poll() is not None or time.monotonic() - run.started > args.process_timeout_s


def collect(args: argparse.Namespace, run: Run) -> dict[str, Any]:
    """Waits for ``run`` (killing its process group past ``--process-timeout-s``) and returns its report."""
    try:
        run.process.wait(timeout=max(args.process_timeout_s - (time.monotonic() - run.started), 0.1))
    except subprocess.TimeoutExpired:
        os.killpg(run.process.pid, signal.SIGKILL)
        run.process.wait()
        return {"error": {"type": "Timeout", "message": f"killed after --process-timeout-s {args.process_timeout_s}"}}
    if run.report.exists():
        return json.loads(run.report.read_text())
    tail = run.report.with_suffix(".log").read_text(errors="replace").strip().splitlines()[-1:]
    message = f"exit code {run.process.returncode} without a report; last output: {tail[0] if tail else ''}"
    return {"error": {"type": "Crash", "message": message}}


def verdict_stage(
    args: argparse.Namespace,
    models: list[ZooModel],
    past_budget: Callable[[], bool],
    done: Callable[[ZooModel, dict[str, Any]], None],
) -> list[str]:
    """Two runs per ``--verdict-modes`` mode of every model, ``--parallel`` processes at a time across models.

    ``done(model, fields)`` receives each model's verdicts as soon as its runs are in. A model none of whose runs
    has started when ``past_budget()`` turns true is not started; returns those models' names.
    """
    jobs = [(model, mode, copy) for model in models for mode in args.verdict_modes for copy in "ab"]
    reports: dict[str, dict[str, Any]] = {model.name: {} for model in models}
    begun: dict[str, float] = {}
    running: list[tuple[ZooModel, str, Run]] = []
    not_run: list[str] = []
    while jobs or running:
        while jobs and len(running) < args.parallel:
            if jobs[0][0].name not in begun and past_budget():
                not_run = list(dict.fromkeys(model.name for model, _, _ in jobs))
                jobs.clear()
                break
            model, mode, copy = jobs.pop(0)
            begun.setdefault(model.name, time.monotonic())
            label = f"{mode}_{copy}"
            run = start_run(args, model, mode, label, timing=False, profile=False, hold=False)
            running.append((model, label, run))
        ready = [item for item in running if finished(args, item[2])]
        if not ready:
            time.sleep(0.1)
            continue
        for item in ready:
            running.remove(item)
            model, label, run = item
            reports[model.name][label] = collect(args, run)
            if len(reports[model.name]) == 2 * len(args.verdict_modes):
                runs = reports[model.name]
                fields = {mode: verdict([runs[f"{mode}_a"], runs[f"{mode}_b"]]) for mode in args.verdict_modes}
                fields["verdict_wall_s"] = round(time.monotonic() - begun[model.name], 1)
                done(model, fields)
    return not_run


def timing_jobs(args: argparse.Namespace, model: ZooModel) -> list[TimingJob]:
    """Plain and plugin alternated ABBA (against drift); the last alternation's two runs are profiled."""
    jobs = []
    for alternation in range(args.alternations):
        order = ("plain", "plugin") if alternation % 2 == 0 else ("plugin", "plain")
        profile = alternation == args.alternations - 1
        jobs += [TimingJob(model, mode, f"time_{mode}_{alternation}", profile) for mode in order]
    return jobs


def timed(record: dict[str, Any]) -> bool:
    """Whether a model's record lets its timing runs go (the plugin's verdict did not raise)."""
    return record.get("plugin", {}).get("verdict") != "raises"


def timing_stage(
    args: argparse.Namespace, queue: TimingQueue, model: ZooModel, following: ZooModel | None
) -> dict[str, Any]:
    """The model's timing runs through ``queue`` (``following``'s first run held behind the last); the tax,
    its attribution and the plain verdict."""
    started = time.monotonic()
    jobs = timing_jobs(args, model)
    after = timing_jobs(args, following)[:1] if following is not None else []
    reports: dict[str, dict[str, Any]] = {}
    for job, upcoming in zip(jobs, [*jobs[1:], *after, None]):
        reports[job.label] = queue.run(job, upcoming)
    pairs = [(reports[f"time_plain_{index}"], reports[f"time_plugin_{index}"]) for index in range(args.alternations)]
    fields: dict[str, Any] = {"timing_wall_s": round(time.monotonic() - started, 1)}
    fields["timing_device"] = pairs[0][0].get("device_name", "")  # the cards of one zoo.json may differ by call
    if len(pairs) > 1:
        if "plain" not in args.verdict_modes:  # the plain pair of --verdict-modes, when run, stands
            fields["plain"] = verdict([plain for plain, _ in pairs])
        fields["plugin_timing_runs"] = verdict([plugin for _, plugin in pairs])
    failed = next((report for pair in pairs for report in pair if "error" in report), None)
    if failed is not None:
        return {
            **fields,
            "tax_note": f"not timed: a timing run raised {failed['error']['type']}",
            "timing_error": failed["error"],
        }
    fields["tax"] = tax(pairs, args.warmup, args.steps)
    # the cuBLAS variable the plugin's timed steps ran under (None once the callback released it on CUDA)
    fields["plugin_cublas_workspace_config"] = [plugin.get("cublas_workspace_config") for _, plugin in pairs]
    profiled = [pair for pair in pairs if "profile" in pair[0] and "profile" in pair[1]]
    fields["attribution"] = attribution([plain for plain, _ in profiled], [plugin for _, plugin in profiled])
    return fields


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
    parser.add_argument("--parallel", type=int, default=4, help="verdict processes at a time, across models")
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
    parser.add_argument(
        "--stages",
        nargs="+",
        default=["verdict", "timing"],
        choices=("verdict", "timing"),
        help="verdict: the parallel bitwise runs of all models first; timing: the one-at-a-time tax runs",
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

    def past_budget() -> bool:
        return args.budget_s is not None and time.monotonic() - started > args.budget_s

    def update(model: ZooModel, fields: dict[str, Any]) -> None:
        """Merges ``fields`` into the model's record (a stage run again replaces its own fields) and writes."""
        record = results.setdefault(model.name, {})
        record.update({"precision": model.precision, "groups": list(model.groups), **fields})
        record["wall_s"] = round(record.get("verdict_wall_s", 0) + record.get("timing_wall_s", 0), 1)
        shown = {key: value for key, value in fields.items() if key != "attribution"}
        print(f"{model.name}: {json.dumps(shown)[:400]}", flush=True)
        _write(args, results, not_run, started)

    runnable = []
    for model in selected:
        package = missing_package(model)
        if package is None:
            runnable.append(model)
        else:
            results.pop(model.name, None)
            update(model, {"skipped": f"{package} not installed"})
    if "verdict" in args.stages:
        not_run += verdict_stage(args, runnable, past_budget, update)
    if "timing" in args.stages and args.alternations:
        for model in runnable:
            if model.name not in not_run and not timed(results.get(model.name, {})):
                update(model, {"tax_note": "not timed: the plugin raises"})
        queue = TimingQueue(args)
        to_time = [m for m in runnable if m.name not in not_run and timed(results.get(m.name, {}))]
        for index, model in enumerate(to_time):
            if past_budget():
                not_run += [m.name for m in to_time[index:]]
                break
            following = to_time[index + 1] if index + 1 < len(to_time) else None
            try:
                update(model, timing_stage(args, queue, model, following))
            except Exception as error:  # noqa: BLE001 - a driver failure on one model is that model's result
                update(model, {"driver_error": f"{type(error).__name__}: {error}"})
        queue.discard()
    if not_run:
        print(f"--budget-s {args.budget_s} passed; not run: {' '.join(not_run)}", flush=True)
    _write(args, results, not_run, started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
