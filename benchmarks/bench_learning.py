"""Learning benchmark on the GPU: CartPole-v1 to a 100-episode mean return >= 475, and cue recall.

    python benchmarks/bench_learning.py --out DIR [--seeds 0 1 2] [--budget-s 120]
    # writes DIR/learning.json

Uses the CUDA-graph training step of ``configs/gpu.yaml`` (B=256, T=256, H=256). After every step
the host reads the number and summed return of the episodes that finished (one sync per step, part
of the measured time); the "100-episode mean" is the mean of the most recent >= 100 finished
episodes (whole steps). Each seed stops at the threshold or at ``--budget-s`` seconds of wall time.
Memory task: success rate (query answered correctly) over the last 20 steps at horizon 256.
"""

from __future__ import annotations

import argparse
import time
from collections import deque


from _timing import write_json
from deepep_lightning import DeepEPModule
from deepep_lightning.agent.graphed_step import GraphedTrainStep

GPU_CONFIG = dict(num_envs=256, rollout_length=256, hidden_size=256, learning_rate=3e-3, policy_learning_rate=1e-4,
                  reward_scale=0.05, gamma=0.99, gae_lambda=0.95, entropy_coef=0.001, fused_value_head=True,
                  cuda_graph=True)


def _graphed(model):
    model._ensure_rollout_state()
    optimizer = model.configure_optimizers()  # Adam(capturable=True) because cuda_graph=True
    graphed = GraphedTrainStep(lambda: model._whole_step(optimizer), model._generator)

    def step():
        model._seed_rollout()
        outputs = graphed()
        model._rollout_step += 1
        return outputs

    return step


def cartpole_run(seed: int, budget_s: float, threshold: float) -> dict:
    model = DeepEPModule(seed=seed, **GPU_CONFIG).cuda()
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
    env_steps = steps * GPU_CONFIG["num_envs"] * GPU_CONFIG["rollout_length"]
    return {"seed": seed, "reached": mean >= threshold, "final_100_episode_mean": mean, "train_steps": steps,
            "env_steps": env_steps, "wall_s": wall, "curve_every_10_steps": curve}


def memory_run(seed: int, horizon: int, steps: int) -> dict:
    config = {**GPU_CONFIG, "rollout_length": horizon, "reward_scale": 1.0}
    model = DeepEPModule(seed=seed, env="memory", env_kwargs={"horizon": horizon, "num_cues": 2}, **config).cuda()
    step = _graphed(model)
    successes = []
    start = time.perf_counter()
    for _ in range(steps):
        outputs = step()
        # return is +1 (right) or -1 (wrong) per finished episode: success = (mean + 1) / 2
        mean_return = float(outputs["episode_return_sum"]) / max(float(outputs["episodes"]), 1.0)
        successes.append((mean_return + 1) / 2)
    last = successes[-20:]
    return {"seed": seed, "horizon": horizon, "train_steps": steps, "wall_s": time.perf_counter() - start,
            "success_rate_last_20_steps": sum(last) / len(last), "chance": 0.5,
            "success_curve_every_10": successes[::10]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--budget-s", type=float, default=120.0)
    parser.add_argument("--threshold", type=float, default=475.0)
    parser.add_argument("--memory-steps", type=int, default=300)
    parser.add_argument("--memory-horizon", type=int, default=256)
    args = parser.parse_args()
    cartpole = [cartpole_run(seed, args.budget_s, args.threshold) for seed in args.seeds]
    for run in cartpole:
        print({k: v for k, v in run.items() if k != "curve_every_10_steps"}, flush=True)
    memory = memory_run(0, args.memory_horizon, args.memory_steps) if args.memory_steps else None
    print(memory and {k: v for k, v in memory.items() if k != "success_curve_every_10"})
    write_json(f"{args.out}/learning.json", {"config": {**GPU_CONFIG, **vars(args)}, "cartpole": cartpole,
                                             "memory": memory})


if __name__ == "__main__":
    main()
