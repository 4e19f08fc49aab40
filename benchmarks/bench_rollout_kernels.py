"""The rollout kernels alone: ``deepep::cartpole_rollout`` (blocks) against ``deepep::cartpole_rollout_clusters``.

One launch of T timesteps of B CartPole environments at H=256, per batch size: the median milliseconds of the
launch and the microseconds per timestep of each kernel, and whether the cluster kernel's outputs equal the block
kernel's bit for bit. Batch sizes below and above the GPU's capacity for clusters show how a timestep's time
scales with the number of clusters in flight. The cluster kernel runs with its own choice of environments per
cluster (``clusters_*``: the fewest with which every cluster is resident at once) and with 16, 24 and 32 fixed
(``clusters16_*``, ...): at 16, 256 environments are 16 clusters of 8 blocks (128 blocks), 512 are 32. The policy
reads the observation alone (``configs/gpu.yaml``) or ``[obs; h]``.

    python3 benchmarks/bench_rollout_kernels.py --out benchmarks/results/train_step
    python3 benchmarks/bench_rollout_kernels.py --out /tmp/r --quick   # CPU: the block kernel, tiny shapes

Result: ``rollout_kernels.json`` (``rollout_kernels_quick.json`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
from _timing import median_ms, write_json

from deepep_lightning.deepep.agent import DeepEPAgent
from deepep_lightning.deepep.agent.fused_rollout import (
    MAX_SHARED_BYTES,
    MIN_CLUSTER_ROWS,
    _weights,
    cluster_shared_memory_bytes,
    runs_on_clusters,
)
from deepep_lightning.deepep.envs import BatchedCartPole
from deepep_lightning.ops import extension_available

#: The cluster kernel's environments per cluster that each batch runs with: 0 (the kernel's choice), 16, 24, 32.
CLUSTER_ROWS = (0, 16, 24, 32)


def op_inputs(
    batch: int, steps: int, hidden: int, reads_hidden: bool, device: str
) -> tuple[list[Any], DeepEPAgent, bool]:
    """The op's arguments (episodes of 200 steps, so that resets happen), the agent, and whether the cluster kernel
    runs them."""
    torch.manual_seed(0)
    agent = DeepEPAgent(4, 2, hidden, logit_bound=3.0, policy_reads_hidden=reads_hidden).to(device)
    env = BatchedCartPole(batch, device, max_episode_steps=200)
    generator = torch.Generator(device).manual_seed(1)
    env.reset(generator)
    state = torch.randn(batch, hidden, device=device) * 0.5
    uniforms = torch.rand(steps, batch, device=device, generator=generator)
    noise = torch.rand(steps, batch, 4, device=device, generator=generator)
    weights = [w.detach() for w in _weights(agent)]
    args = [env.state, env.episode_return, env.episode_length, state, uniforms, noise, weights, 3.0, 200]
    return args, agent, runs_on_clusters(agent, env)


def measure(batch: int, steps: int, hidden: int, reads_hidden: bool, device: str, repeats: int) -> dict[str, Any]:
    args, agent, clusters = op_inputs(batch, steps, hidden, reads_hidden, device)
    record: dict[str, Any] = {"batch": batch, "steps": steps, "policy_reads_hidden": reads_hidden}
    for rows in (4, 8):
        median, _ = median_ms(lambda rows=rows: torch.ops.deepep.cartpole_rollout.default(*args, rows), repeats)
        record[f"blocks{rows}_ms"] = round(median, 4)
        record[f"blocks{rows}_us_per_timestep"] = round(1000 * median / steps, 2)
    blocks = torch.ops.deepep.cartpole_rollout.default(*args, 4)
    launch = torch.ops.deepep.cartpole_rollout_clusters.default
    for rows in CLUSTER_ROWS:  # 0: the kernel's own choice from cluster residency
        name = "clusters" if rows == 0 else f"clusters{rows}"
        record[f"{name}_ms"] = record[f"{name}_us_per_timestep"] = record[f"{name}_equal_blocks"] = None
        if not clusters or cluster_shared_memory_bytes(agent, max(rows, MIN_CLUSTER_ROWS)) > MAX_SHARED_BYTES:
            continue
        median, _ = median_ms(lambda rows=rows: launch(*args, rows), repeats)
        record[f"{name}_ms"] = round(median, 4)
        record[f"{name}_us_per_timestep"] = round(1000 * median / steps, 2)
        on_clusters = torch.ops.deepep.cartpole_rollout_clusters.default(*args, rows)
        record[f"{name}_equal_blocks"] = all(torch.equal(a, b) for a, b in zip(blocks, on_clusters))
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder of the result JSON")
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 64, 128, 224, 240, 256, 512])
    parser.add_argument("--steps", type=int, default=128, help="timesteps of one launch")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=7, help="timed launches per kernel and shape")
    parser.add_argument("--quick", action="store_true", help="CPU smoke test: B=8, H=16, T=4, 2 repeats")
    args = parser.parse_args()
    if not extension_available():
        parser.error("the deepep extension is not available (the rollout kernels are compiled ops)")
    device = "cuda" if torch.cuda.is_available() and not args.quick else "cpu"
    if args.quick:
        args.batches, args.steps, args.hidden, args.repeats = [8], 4, 16, 2
    records = []
    for reads_hidden in (False, True):
        for batch in args.batches:
            record = measure(batch, args.steps, args.hidden, reads_hidden, device, args.repeats)
            records.append(record)
            print(record, flush=True)
    name = "rollout_kernels_quick.json" if args.quick else "rollout_kernels.json"
    write_json(Path(args.out) / name, {"command": " ".join(sys.argv), "device": device, "records": records})


if __name__ == "__main__":
    main()
