"""Rollback on a collapse: the same seeds with and without a RegressionTrigger, through ``train.py fit``.

    python benchmarks/bench_collapse_recovery.py --out DIR [--seeds 1 3] [--steps 2000]
    # writes DIR/collapse_recovery.json

Each seed runs twice as a fresh ``train.py fit`` process: ``configs/collapse_demo.yaml`` (``gpu.yaml``'s model
with the policy reading the recurrent state, whose return can collapse onto one action, with a
``RegressionTrigger`` on ``train/episode_return_100`` that makes ``NaNRollbackCallback`` restore the best
snapshot and apply the file's policy: ``lower_lr`` halves every learning rate) and the same file with the
trigger removed (the control: same seed, same weights, the same run until the first rollback). Per run the
benchmark reads the TensorBoard event file it wrote and reports the 100-episode mean return every 25 steps,
the final value, the minimum after the first mean >= 475, the fraction of those checkpoints >= 475 and the
health counts of the end-of-fit summary line. The runs share
the one GPU (they start together).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml
from _timing import write_json

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "collapse_demo.yaml"
METRIC = "train/episode_return_100"
EVERY = 25


def control_config(directory: Path) -> Path:
    """``collapse_demo.yaml`` without the RegressionTrigger: the run that keeps its collapse."""
    config = yaml.safe_load(CONFIG.read_text())
    for callback in config["trainer"]["callbacks"]:
        if callback["class_path"].endswith("NaNRollbackCallback"):
            callback["init_args"].pop("regression", None)
    path = directory / "collapse_demo_no_trigger.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def returns_from_events(log_dir: Path) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    events.Reload()
    return [(event.step, event.value) for event in events.Scalars(METRIC)]


def summarise(curve: list[tuple[int, float]], threshold: float) -> dict[str, Any]:
    """The checkpoints every ``EVERY`` steps and the stay-learned figures after the first crossing."""
    checkpoints = [(step, value) for step, value in curve if (step + 1) % EVERY == 0 and value == value]
    first = next((i for i, (_, value) in enumerate(checkpoints) if value >= threshold), None)
    after = [value for _, value in checkpoints[first:]] if first is not None else []
    return {
        "first_step": checkpoints[first][0] + 1 if first is not None else None,
        "final": checkpoints[-1][1] if checkpoints else None,
        "min_after_first": min(after) if after else None,
        "fraction_at_threshold_after_first": sum(v >= threshold for v in after) / len(after) if after else None,
        "checkpoints": [(step + 1, round(value, 2)) for step, value in checkpoints],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--steps", type=int, default=None, help="default: the config's trainer.max_steps")
    parser.add_argument("--threshold", type=float, default=475.0)
    parser.add_argument("--timeout", type=float, default=560.0, help="seconds per run")
    parser.add_argument(
        "--extra",
        action="append",
        default=[],
        help="more train.py options (a CPU smoke run: "
        "--trainer.accelerator=cpu --model.execution.cuda_graph=false --model.env.num_envs=8)",
    )
    args = parser.parse_args()
    out = Path(args.out)
    work = Path(tempfile.mkdtemp(prefix="collapse_recovery_"))
    variants = {"trigger": CONFIG, "no_trigger": control_config(work)}
    runs, procs = [], []
    for seed in args.seeds:
        for variant, config in variants.items():
            save_dir = work / f"{variant}_{seed}"
            command = [sys.executable, str(ROOT / "train.py"), "fit", "--config", str(config),
                       f"--seed_everything={seed}", "--trainer.enable_progress_bar=false",
                       f"--trainer.logger.init_args.save_dir={save_dir}"]  # fmt: skip
            command += args.extra
            if args.steps is not None:
                command.append(f"--trainer.max_steps={args.steps}")
            log = open(work / f"{variant}_{seed}.log", "w")  # noqa: SIM115 (closed after the wait)
            env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
            procs.append((seed, variant, save_dir, log, subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                                                         cwd=ROOT, env=env)))  # fmt: skip
    for seed, variant, save_dir, log, proc in procs:
        try:
            code = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = "timeout"
        log.close()
        text = Path(log.name).read_text()
        summary = re.findall(r"deepep_lightning: fit ended.*", text)
        event_dirs = sorted({p.parent for p in save_dir.rglob("events.out.tfevents.*")})
        curve = returns_from_events(event_dirs[0]) if event_dirs else []
        runs.append({"seed": seed, "variant": variant, "exit": code, "summary_line": summary[-1] if summary else None,
                     **summarise(curve, args.threshold)})  # fmt: skip
        print({k: v for k, v in runs[-1].items() if k != "checkpoints"}, flush=True)
        if code != 0:
            print(text[-3000:], flush=True)
    write_json(out / "collapse_recovery.json", {"args": vars(args), "runs": runs})


if __name__ == "__main__":
    main()
