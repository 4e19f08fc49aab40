"""Learning benchmark: every seed for the whole budget, and whether it stays learned.

    python benchmarks/bench_learning.py --out DIR [--config configs/gpu.yaml] [--seeds 0 1 2] [--parallel 3]
        [--override target_tau=null ...] [--memory-horizons 128 256] [--label NAME]
    python benchmarks/bench_learning.py --out /tmp/smoke --device cpu --quick      # a tiny CPU smoke run
    # writes DIR/learning_<label>.json, DIR/learning_<label>.png (and DIR/memory_<label>.png)

CartPole: the ``model:`` section of ``--config`` (``configs/gpu.yaml``: B=256, T=32, H=256, CUDA-graph step;
``configs/collapse_demo.yaml``: the same without the stabilisers), ``--override key=value`` (JSON values)
on top, trained for ``trainer.max_steps`` (or ``--steps``) with **no stop at the threshold**. After every
step the host reads the number and summed return of the finished episodes (one sync per step, part of
the measured time); the 100-episode mean is the mean of the most recent >= 100 finished episodes (whole
steps), recorded every 25 steps. Per seed: steps and seconds (wall time from construction, capture
included) to the first mean >= threshold, the final mean, the minimum after the first crossing, and the
fraction of checkpoints after the first crossing that are >= threshold.

Memory (cue recall, ``--memory-config``): per horizon and seed, the success rate (query answered
correctly) per step; steps and seconds to the first 20-step mean >= 95 %, and the final 20-step mean.
``--memory-seconds S`` also ends each memory run at the first checkpoint after S seconds of wall time
(the target is a time budget); ``steps_run`` says where it stopped.

``--parallel N`` runs N runs at once as separate processes (on one GPU they share it: the wall times
then include that sharing, say so when quoting them).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import multiprocessing
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import yaml
from _timing import write_json

ROOT = Path(__file__).resolve().parents[1]
CHECKPOINT_EVERY = 25
QUICK = {"num_envs": 16, "rollout_length": 16, "hidden_size": 16}


def model_config(path: str | Path, overrides: list[str], device: str, quick: bool) -> tuple[dict[str, Any], int]:
    """The ``model:`` section of a config (with overrides), its groups' fields by name, and ``trainer.max_steps``."""
    config = yaml.safe_load(Path(path).read_text())
    model: dict[str, Any] = {}
    for key, value in config["model"].items():  # {"env": {"num_envs": 32, ...}, "seed": 0} -> {"num_envs": 32, ...}
        model.update(value if isinstance(value, dict) else {key: value})
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--override: expected KEY=VALUE, got {item!r}")
        model[key] = json.loads(value)
    model["cuda_graph"] = device == "cuda" and bool(model.get("cuda_graph", True))
    if device == "cuda" and not any(item.startswith("fused_value_head=") for item in overrides):
        model["fused_value_head"] = True  # the compiled op, as the speed figures use it
    if quick:
        model.update(QUICK)
        if model.get("name") == "memory":
            model["num_envs"] = 8
    return model, int(config.get("trainer", {}).get("max_steps", 2000))


def _step_function(model: Any) -> Any:
    """One training step (rollout + loss + backward + Adam): a CUDA graph on the GPU, eager on the CPU."""
    from deepep_lightning.deepep.graph_training import StandaloneStep

    model.ensure_rollout_state()
    return StandaloneStep(model, model.configure_optimizers())  # Adam(capturable=True) when cuda_graph=True


def _build(config: dict[str, Any], seed: int, device: str) -> Any:
    import torch

    from deepep_lightning.deepep import DeepEPModule
    from deepep_lightning.deepep.config import grouped

    if device == "cpu":
        torch.set_num_threads(1)
    return DeepEPModule(**grouped(**{**config, "seed": seed})).to(device)


class StepScalars:
    """Each step's ``(episode_return_sum, episodes)``, kept on the step's device and read to the host once per
    checkpoint. Reading them after every step would make the host wait for the step's GPU work before it
    launches the next one, and the seconds would time the benchmark's own synchronisation."""

    def __init__(self) -> None:
        self._pending: list[Any] = []

    def add(self, outputs: dict[str, Any]) -> None:
        import torch

        # copies: a CUDA-graph step overwrites its output tensors at the next replay
        self._pending.append(torch.stack((outputs["episode_return_sum"].double(), outputs["episodes"].double())))

    def read(self) -> list[tuple[float, float]]:
        """The steps added since the last read, in step order (one host read)."""
        import torch

        if not self._pending:
            return []
        values = torch.stack(self._pending).cpu().tolist()
        self._pending.clear()
        return [(total, episodes) for total, episodes in values]


def cartpole_run(job: dict[str, Any]) -> dict[str, Any]:
    """One seed of CartPole for the whole budget; the stay-learned figures of that seed."""
    start = time.perf_counter()
    model = _build(job["config"], job["seed"], job["device"])
    step = _step_function(model)
    window: deque[tuple[float, float]] = deque()
    checkpoints: list[tuple[int, float, float]] = []
    scalars = StepScalars()
    for index in range(1, job["steps"] + 1):
        scalars.add(step())
        if index % CHECKPOINT_EVERY != 0:
            continue
        for total, finished in scalars.read():
            if finished:
                window.append((total, finished))
            while len(window) > 1 and sum(n for _, n in list(window)[1:]) >= 100:
                window.popleft()
        count = sum(n for _, n in window)
        mean = sum(s for s, _ in window) / count if count >= 100 else float("nan")
        checkpoints.append((index, round(time.perf_counter() - start, 3), mean))
    return {"seed": job["seed"], **stay_learned(checkpoints, job["threshold"]), "checkpoints": checkpoints}


def stay_learned(checkpoints: list[tuple[int, float, float]], threshold: float) -> dict[str, Any]:
    """First crossing (step, seconds), final value, minimum after it and fraction of checkpoints >= threshold."""
    first = next((i for i, (_, _, value) in enumerate(checkpoints) if value >= threshold), None)
    final = checkpoints[-1][2] if checkpoints else float("nan")
    if first is None:
        return {"reached": False, "first_step": None, "first_s": None, "final": final, "min_after_first": None,
                "fraction_at_threshold_after_first": None}  # fmt: skip
    after = [value for _, _, value in checkpoints[first:]]
    return {
        "reached": True,
        "first_step": checkpoints[first][0],
        "first_s": checkpoints[first][1],
        "final": final,
        "min_after_first": min(after),
        "fraction_at_threshold_after_first": sum(value >= threshold for value in after) / len(after),
    }


def memory_run(job: dict[str, Any]) -> dict[str, Any]:
    """Cue recall at one horizon (one rollout = one episode) for the whole budget."""
    start = time.perf_counter()
    horizon = job["horizon"]
    config = {**job["config"], "rollout_length": horizon, "kwargs": {**(job["config"].get("kwargs") or {}),
              "horizon": horizon}}  # fmt: skip
    if config.get("chrono_horizon") is not None:
        config["chrono_horizon"] = horizon
    model = _build(config, job["seed"], job["device"])
    step = _step_function(model)
    successes: list[float] = []
    curve: list[tuple[int, float, float]] = []
    seconds = job.get("seconds")
    index = 0
    scalars = StepScalars()
    for index in range(1, job["steps"] + 1):
        scalars.add(step())
        if index % CHECKPOINT_EVERY == 0:
            # the return is +1 (right) or -1 (wrong) per finished episode: success = (mean + 1) / 2
            successes += [(total / max(episodes, 1.0) + 1) / 2 for total, episodes in scalars.read()]
            last = successes[-20:]
            curve.append((index, round(time.perf_counter() - start, 3), sum(last) / len(last)))
            if seconds is not None and time.perf_counter() - start >= seconds:
                break  # the wall-time budget (construction and capture included) is spent, at a checkpoint
    return {"seed": job["seed"], "horizon": horizon, **stay_learned(curve, 0.95), "steps_run": index,
            "seconds_budget": seconds, "checkpoints": curve}  # fmt: skip


def _run_all(function: Any, jobs: list[dict[str, Any]], parallel: int) -> list[dict[str, Any]]:
    if parallel <= 1:
        return [function(job) for job in jobs]
    with ProcessPoolExecutor(parallel, mp_context=multiprocessing.get_context("spawn")) as pool:
        return list(pool.map(function, jobs))


def plot(runs: list[dict[str, Any]], path: Path, title: str, ylabel: str, threshold: float) -> None:
    """Mean and min/max over seeds of the checkpoint curves (one band per horizon for the memory task)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4))
    groups: dict[Any, list[dict[str, Any]]] = {}
    for run in runs:
        groups.setdefault(run.get("horizon"), []).append(run)
    for horizon, members in sorted(groups.items(), key=lambda item: item[0] or 0):
        # runs ended by --memory-seconds stop at different checkpoints: the shorter ones are NaN past their end
        steps = [c[0] for c in max(members, key=lambda run: len(run["checkpoints"]))["checkpoints"]]
        values = [[c[2] for c in run["checkpoints"]] for run in members]
        columns = list(itertools.zip_longest(*values, fillvalue=float("nan")))
        finite = [[v for v in column if not math.isnan(v)] or [float("nan")] for column in columns]
        label = f"horizon {horizon}" if horizon is not None else f"{len(members)} seeds"
        axes.plot(steps, [sum(c) / len(c) for c in finite], label=f"{label}: mean")
        axes.fill_between(steps, [min(c) for c in finite], [max(c) for c in finite], alpha=0.25, label="min/max")
    axes.axhline(threshold, color="grey", linestyle="--", linewidth=1)
    axes.set(xlabel="training step", ylabel=ylabel, title=title)
    axes.legend(loc="lower right", fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--config", default=str(ROOT / "configs" / "gpu.yaml"))
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE", help="JSON value")
    parser.add_argument("--label", default=None, help="names the output files (default: the config's stem)")
    parser.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=None, help="default: the config's trainer.max_steps")
    parser.add_argument("--threshold", type=float, default=475.0)
    parser.add_argument("--parallel", type=int, default=1, help="runs at once, one process each")
    parser.add_argument("--memory-config", default=str(ROOT / "configs" / "memory_gpu.yaml"))
    parser.add_argument("--memory-horizons", type=int, nargs="*", default=[], help="none: skip the memory task")
    parser.add_argument("--memory-seeds", type=int, nargs="*", default=[0])
    parser.add_argument("--memory-steps", type=int, default=None, help="default: the memory config's max_steps")
    parser.add_argument(
        "--memory-seconds", type=float, default=None,
        help="also stop each memory run at the first checkpoint after this much wall time (a time-budget target)",
    )  # fmt: skip
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cuda: CUDA-graph step")
    parser.add_argument("--quick", action="store_true", help="a tiny model and 50 steps (smoke test)")
    parser.add_argument("--replot", default=None, metavar="JSON", help="only draw the PNGs of a result file")
    args = parser.parse_args()
    if args.replot:
        _replot(Path(args.replot))
        return
    label = args.label or Path(args.config).stem
    out = Path(args.out)
    config, max_steps = model_config(args.config, args.override, args.device, args.quick)
    steps = 50 if args.quick else (args.steps or max_steps)
    jobs = [{"config": config, "seed": s, "device": args.device, "steps": steps, "threshold": args.threshold}
            for s in args.seeds]  # fmt: skip
    memory_jobs: list[dict[str, Any]] = []
    if args.memory_horizons:
        memory_config, memory_max = model_config(args.memory_config, args.override, args.device, args.quick)
        memory_steps = 50 if args.quick else (args.memory_steps or memory_max)
        if args.memory_seconds is not None and not args.memory_seconds > 0:
            parser.error(f"--memory-seconds must be > 0, got {args.memory_seconds!r}")
        memory_jobs = [{"config": memory_config, "seed": s, "horizon": h, "device": args.device, "steps": memory_steps,
                        "seconds": args.memory_seconds}
                       for h in args.memory_horizons for s in args.memory_seeds]  # fmt: skip
    start = time.perf_counter()
    cartpole = _run_all(cartpole_run, jobs, args.parallel)
    memory = _run_all(memory_run, memory_jobs, args.parallel)
    for run in cartpole + memory:
        print({k: v for k, v in run.items() if k != "checkpoints"}, flush=True)
    summary = {
        "seeds": len(cartpole),
        "reached": sum(run["reached"] for run in cartpole),
        "final_at_threshold": sum(run["final"] >= args.threshold for run in cartpole),
        "fraction_95_after_first": sum((run["fraction_at_threshold_after_first"] or 0) >= 0.95 for run in cartpole),
        "median_first_s": _median([run["first_s"] for run in cartpole if run["reached"]]),
    }
    print(summary, flush=True)
    payload = {"config": config, "args": vars(args), "steps": steps, "total_wall_s": time.perf_counter() - start,
               "summary": summary, "cartpole": cartpole, "memory": memory}  # fmt: skip
    write_json(out / f"learning_{label}.json", payload)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(f"matplotlib is not installed: no PNG (draw it elsewhere: --replot {out / f'learning_{label}.json'})")
        return
    if cartpole:
        plot(cartpole, out / f"learning_{label}.png", f"CartPole, {label}", "100-episode mean return", args.threshold)
    if memory:
        plot(memory, out / f"memory_{label}.png", f"cue recall, {label}", "success, last 20 steps", 0.95)


def _replot(path: Path) -> None:
    payload = json.loads(path.read_text())
    label, threshold = path.stem.removeprefix("learning_"), payload["args"]["threshold"]
    if payload["cartpole"]:
        plot(payload["cartpole"], path.with_suffix(".png"), f"CartPole, {label}", "100-episode mean return", threshold)
    if payload["memory"]:
        plot(payload["memory"], path.with_name(f"memory_{label}.png"), f"cue recall, {label}", "success, last 20 steps",
             0.95)  # fmt: skip


def _median(values: list[float]) -> float | None:
    values = sorted(values)
    if not values:
        return None
    middle = len(values) // 2
    return values[middle] if len(values) % 2 else (values[middle - 1] + values[middle]) / 2


if __name__ == "__main__":
    main()
