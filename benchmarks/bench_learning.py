"""Learning benchmark on the GPU: CartPole-v1 to a 100-episode mean return >= 475, and cue recall.

    python benchmarks/bench_learning.py --out DIR [--seeds 0 1 2] [--budget-s 120]
    # writes DIR/learning.json

Uses the CUDA-graph training step with the ``model:`` section of ``configs/gpu.yaml`` (B=256, T=32, H=256;
``--device cpu`` runs the same step eagerly, ``--set`` overrides arguments). After every step
the host reads the number and summed return of the episodes that finished (one sync per step, part
of the measured time); the "100-episode mean" is the mean of the most recent >= 100 finished
episodes (whole steps). Each seed stops at the threshold or at ``--budget-s`` seconds of wall time.
Memory task: success rate (query answered correctly) over the last 20 steps, per horizon, until 95 % or the budget.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import deque
from pathlib import Path

import yaml
from _timing import write_json

from deepep_lightning.deepep import DeepEPModule
from deepep_lightning.deepep.agent.graphed_step import GraphedTrainStep

CONFIG_FILE = Path(__file__).resolve().parents[1] / "configs" / "gpu.yaml"


def gpu_config() -> dict:
    """The ``model:`` section of configs/gpu.yaml, with the fused value head forced on."""
    model = yaml.safe_load(CONFIG_FILE.read_text())["model"]
    model.pop("env", None)
    return {**model, "fused_value_head": True}


def _graphed(model):
    """One training step (rollout + loss + backward + Adam): a CUDA graph on the GPU, eager on the CPU."""
    model._ensure_rollout_state()
    optimizer = model.configure_optimizers()  # Adam(capturable=True) when cuda_graph=True
    if model.hparams.cuda_graph:
        graphed = GraphedTrainStep(lambda: model._whole_step(optimizer), model._generator)
    else:

        def graphed():
            return model._whole_step(optimizer)

    def step():
        model._seed_rollout()
        outputs = graphed()
        model._rollout_step += 1
        return outputs

    return step


def cartpole_run(seed: int, budget_s: float, threshold: float, config: dict, device: str) -> dict:
    model = DeepEPModule(seed=seed, **config).to(device)
    step = _graphed(model)
    window: deque[tuple[float, float]] = deque()
    curve = []
    start = time.perf_counter()
    steps = 0
    mean = float("nan")
    while time.perf_counter() - start < budget_s:
        outputs = step()
        steps += 1
        finished = float(outputs["episodes"])
        if finished:
            window.append((float(outputs["episode_return_sum"]), finished))
        while len(window) > 1 and sum(n for _, n in list(window)[1:]) >= 100:
            window.popleft()
        count = sum(n for _, n in window)
        mean = sum(s for s, _ in window) / count if count >= 100 else float("nan")
        if steps % 10 == 0:
            curve.append((steps, round(time.perf_counter() - start, 2), mean))
        if mean >= threshold:
            break
    wall = time.perf_counter() - start
    env_steps = steps * config["num_envs"] * config["rollout_length"]
    return {
        "seed": seed,
        "reached": mean >= threshold,
        "final_100_episode_mean": mean,
        "train_steps": steps,
        "env_steps": env_steps,
        "wall_s": wall,
        "curve_every_10_steps": curve,
    }


def memory_run(seed: int, horizon: int, budget_s: float, config: dict, device: str) -> dict:
    """Cue recall at ``horizon`` (one rollout = one episode) until 95 % success over 20 steps or the budget."""
    config = {**config, "rollout_length": horizon, "reward_scale": 1.0}
    model = DeepEPModule(seed=seed, env="memory", env_kwargs={"horizon": horizon, "num_cues": 2}, **config).to(device)
    step = _graphed(model)
    successes = []
    start = time.perf_counter()
    solved_at = None
    while time.perf_counter() - start < budget_s:
        outputs = step()
        # return is +1 (right) or -1 (wrong) per finished episode: success = (mean + 1) / 2
        mean_return = float(outputs["episode_return_sum"]) / max(float(outputs["episodes"]), 1.0)
        successes.append((mean_return + 1) / 2)
        last = successes[-20:]
        if len(last) == 20 and sum(last) / 20 >= 0.95:
            solved_at = len(successes)
            break
    last = successes[-20:]
    return {
        "seed": seed,
        "horizon": horizon,
        "train_steps": len(successes),
        "wall_s": time.perf_counter() - start,
        "success_rate_last_20_steps": sum(last) / len(last),
        "chance": 0.5,
        "solved_at_step": solved_at,
        "success_curve_every_10": successes[::10],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2])
    parser.add_argument("--budget-s", type=float, default=120.0)
    parser.add_argument("--threshold", type=float, default=475.0)
    parser.add_argument(
        "--memory-horizons",
        type=int,
        nargs="*",
        default=[256],
        help="cue-recall horizons to train (none: skip the memory task)",
    )
    parser.add_argument("--memory-budget-s", type=float, default=120.0, help="wall-time budget per horizon")
    parser.add_argument("--device", default="cuda", help="cuda (CUDA-graph step) or cpu (eager step)")
    parser.add_argument(
        "--set",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="override a DeepEPModule argument, e.g. --set rollout_length=32 hidden_size=128",
    )
    args = parser.parse_args()
    config = {**gpu_config(), "cuda_graph": args.device == "cuda"}
    for item in args.set:
        key, _, value = item.partition("=")
        if key not in config and key not in ("value_coef", "max_grad_norm", "bptt_truncation", "value_hidden_size"):
            parser.error(f"--set: unknown key {key!r}")
        config[key] = json.loads(value)
    cartpole = [cartpole_run(seed, args.budget_s, args.threshold, config, args.device) for seed in args.seeds]
    for run in cartpole:
        print({k: v for k, v in run.items() if k != "curve_every_10_steps"}, flush=True)
    memory = [memory_run(0, horizon, args.memory_budget_s, config, args.device) for horizon in args.memory_horizons]
    for run in memory:
        print({k: v for k, v in run.items() if k != "success_curve_every_10"}, flush=True)
    write_json(
        f"{args.out}/learning.json", {"config": {**config, **vars(args)}, "cartpole": cartpole, "memory": memory}
    )


if __name__ == "__main__":
    main()
