"""Learning as a user runs it: ``train.py fit --config C --seed_everything=S`` per seed, read from TensorBoard.

    python benchmarks/bench_fit.py --out DIR --config configs/gpu.yaml --seeds 0 1 2 3 4 5 6 7 8 9 --parallel 10 \
        --alone 3 [--label NAME] [--arg=--model.loss.gamma=0.995 ...]
    # writes DIR/fit_<label>.json; each run's logs under DIR/fit_<label>/ (or --logs LOGS/fit_<label>/)

Each run is a fresh ``python train.py fit`` process with the config as shipped, ``--arg`` command-line
overrides on top (passed through to LightningCLI), its TensorBoard logs in its own folder and the progress
bar off. What is measured is what the user sees: ``train/episode_return_100`` as the module logs it (every
``log_every_n_steps``), and wall time from the process's launch (``Popen``) to the event of the first logged
mean >= threshold — start-up, imports, extension load, CUDA-graph captures and the training loop included.

Per seed: the first step and seconds at >= threshold, the final mean, the minimum after the first crossing and
the fraction of logged points after the first crossing that are >= threshold. The same figures for the greedy
policy's return (``eval/greedy_return``, under ``greedy``) where the config evaluates it (``model.env.eval_envs``).

``--alone N`` first runs the first N seeds one at a time (nothing else on the machine; the seconds to the first
crossing of *those* runs are the time a user waits), then every seed ``--parallel`` at a time (the learning
figures; their seconds are shared-GPU times). Each alone run's curve is compared with the same seed's parallel
run: bitwise equal means the two processes computed the same bits (``same_bits``). ``--pycache DIR`` gives
the runs a bytecode cache (:func:`fit_environment`): on an interpreter that cannot write its own, the seconds to
the first crossing then count the imports as an installed environment pays them, once the first run wrote it.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from _timing import environment, write_json
from bench_learning import _median, stay_learned

ROOT = Path(__file__).resolve().parents[1]
TAG = "train/episode_return_100"
GREEDY_TAG = "eval/greedy_return"  # the greedy policy's return (configs with model.env.eval_envs > 0)


def fit_command(config: str, seed: int, log_dir: Path, extra: list[str]) -> list[str]:
    """The ``train.py fit`` command line of one seed, its TensorBoard logs under ``log_dir``."""
    return [
        sys.executable, str(ROOT / "train.py"), "fit", "--config", config, f"--seed_everything={seed}",
        f"--trainer.logger.init_args.save_dir={log_dir}", "--trainer.logger.init_args.name=fit",
        "--trainer.logger.init_args.version=0", "--trainer.enable_progress_bar=false", *extra,
    ]  # fmt: skip


def read_curve(log_dir: Path, tag: str = TAG) -> list[tuple[int, float, float]]:
    """``(step, wall_time, value)`` of every logged point of ``tag`` under ``log_dir``, in step order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    points: dict[int, tuple[int, float, float]] = {}
    for events in sorted(log_dir.rglob("events.out.tfevents.*")):
        accumulator = EventAccumulator(str(events), size_guidance={"scalars": 0})
        accumulator.Reload()
        if tag in accumulator.Tags()["scalars"]:
            for event in accumulator.Scalars(tag):
                points[event.step] = (event.step, event.wall_time, event.value)
    return [points[step] for step in sorted(points)]


def fit_environment(pycache: str | None, *paths: Path) -> dict[str, str]:
    """The environment of a ``train.py fit`` process: the repository (then ``paths``) ahead of ``PYTHONPATH`` and,
    with ``pycache``, Python's bytecode cache in that folder (``PYTHONPYCACHEPREFIX``).

    An interpreter that does not write bytecode (``PYTHONDONTWRITEBYTECODE``, or read-only site-packages without
    it) compiles every module it imports in every process: seconds of start-up that an installed environment,
    whose bytecode pip writes at install, does not pay. With a cache (writing allowed) the first process compiles
    and writes it and the later ones read it.
    """
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), *map(str, paths),
                                                                     os.environ.get("PYTHONPATH")]))}  # fmt: skip
    if pycache:
        env["PYTHONPYCACHEPREFIX"] = str(Path(pycache).resolve())
        env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def fit_run(job: dict[str, Any]) -> dict[str, Any]:
    """One ``train.py fit`` process; its curve and stay-learned figures (seconds from launch)."""
    log_dir = Path(job["log_dir"])
    log_dir.mkdir(parents=True, exist_ok=True)
    command = fit_command(job["config"], job["seed"], log_dir, job["extra"])
    env = fit_environment(job["pycache"])
    launched = time.time()
    with open(log_dir / "output.txt", "w") as output:
        returncode = subprocess.call(command, cwd=ROOT, env=env, stdout=output, stderr=subprocess.STDOUT)
    wall_s = time.time() - launched

    def since_launch(tag: str) -> list[tuple[int, float, float]]:
        return [(step, round(wall - launched, 3), value) for step, wall, value in read_curve(log_dir, tag)]

    checkpoints, greedy = since_launch(TAG), since_launch(GREEDY_TAG)
    return {
        "seed": job["seed"], "returncode": returncode, "wall_s": round(wall_s, 3),
        **stay_learned(checkpoints, job["threshold"]), "checkpoints": checkpoints,
        "greedy": {**stay_learned(greedy, job["threshold"]), "checkpoints": greedy} if greedy else None,
    }  # fmt: skip


def summarize(runs: list[dict[str, Any]], alone: list[dict[str, Any]], threshold: float) -> dict[str, Any]:
    """The stay-learned figures over the seeds: of the runs' own records (``train/episode_return_100``) or of
    their ``greedy`` records."""
    reached = [run for run in runs if run["reached"]]
    return {
        "seeds": len(runs),
        "reached": len(reached),
        "final_at_threshold": sum(run["final"] >= threshold for run in runs),
        "fraction_95_after_first": sum((run["fraction_at_threshold_after_first"] or 0) >= 0.95 for run in runs),
        "lowest_after_first": min((run["min_after_first"] for run in reached), default=None),
        "median_first_step": _median([run["first_step"] for run in reached]),
        "median_first_s_alone": _median([run["first_s"] for run in alone if run["reached"]]),
    }


def same_bits(first: list[list[Any]], second: list[list[Any]]) -> bool:
    """Two curves log the same steps with the same values, bit for bit (NaN equal to NaN)."""
    if [point[0] for point in first] != [point[0] for point in second]:
        return False
    return all(
        a == b or (math.isnan(a) and math.isnan(b)) for a, b in zip((p[2] for p in first), (p[2] for p in second))
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--config", default=str(ROOT / "configs" / "gpu.yaml"))
    parser.add_argument("--label", default=None, help="names the output file (default: the config's stem)")
    parser.add_argument("--logs", default=None, help="where each run's TensorBoard logs go (default: --out)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--parallel", type=int, default=1, help="train.py processes at once")
    parser.add_argument("--alone", type=int, default=0, help="also run the first N seeds one at a time, first")
    parser.add_argument("--threshold", type=float, default=475.0)
    parser.add_argument("--pycache", default=None, help="Python's bytecode cache for the runs (fit_environment)")
    parser.add_argument(
        "--arg", action="append", default=[], metavar="--KEY=VALUE",
        help="a train.py override, e.g. --arg=--model.loss.gamma=0.995 (repeat for several)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.parallel < 1:
        parser.error(f"--parallel must be >= 1, got {args.parallel!r}")
    if not 0 <= args.alone <= len(args.seeds):
        parser.error(f"--alone must be between 0 and the number of seeds ({len(args.seeds)}), got {args.alone!r}")
    for item in args.arg:
        if not item.startswith("--") or "=" not in item:
            parser.error(f"--arg: expected --KEY=VALUE (a train.py override), got {item!r}")
    label = args.label or Path(args.config).stem
    out = Path(args.out)
    base = Path(args.logs or out) / f"fit_{label}"

    def job(seed: int, kind: str) -> dict[str, Any]:
        return {"config": args.config, "seed": seed, "extra": args.arg, "threshold": args.threshold,
                "log_dir": str(base / f"{kind}_seed{seed}"), "pycache": args.pycache}  # fmt: skip

    start = time.perf_counter()
    alone = [fit_run(job(seed, "alone")) for seed in args.seeds[: args.alone]]
    with ThreadPoolExecutor(args.parallel) as pool:
        runs = list(pool.map(fit_run, [job(seed, "parallel") for seed in args.seeds]))
    by_seed = {run["seed"]: run for run in runs}
    for run in alone:
        run["same_bits_as_parallel"] = same_bits(run["checkpoints"], by_seed[run["seed"]]["checkpoints"])
    for run in alone + runs:
        print({k: v for k, v in run.items() if k not in ("checkpoints", "greedy")}, flush=True)
    summary = {
        **summarize(runs, alone, args.threshold),
        "failed": sum(run["returncode"] != 0 for run in runs + alone),
        "alone_same_bits": [run["same_bits_as_parallel"] for run in alone],
    }
    if all(run["greedy"] for run in runs + alone):
        summary["greedy"] = summarize([run["greedy"] for run in runs], [run["greedy"] for run in alone], args.threshold)
    print(summary, flush=True)
    payload = {"environment": environment(), "args": vars(args), "total_wall_s": time.perf_counter() - start,
               "summary": summary, "alone": alone, "runs": runs}  # fmt: skip
    write_json(out / f"fit_{label}.json", payload)


if __name__ == "__main__":
    main()
