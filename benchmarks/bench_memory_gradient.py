"""How much of the query step's gradient reaches the cue, per horizon: BPTT through DeepEP's cell at initialisation.

    python benchmarks/bench_memory_gradient.py --out DIR [--horizons 32 64 128 256] [--seeds 0 1 2] [--chrono-factors 1]
    # writes DIR/memory_gradient.json

Cue recall (``configs/memory_gpu.yaml``'s agent: H=128, two cues) rolls out one episode of ``horizon`` steps,
op by op with autograd, from freshly initialised weights. The target is the sum over environments and actions
of the critic's Q at the query step (the last one), whose regression on the ±1 reward is what must learn
the cue. Per horizon and seed the benchmark reports the norm of its gradient w.r.t. the recurrent state
the query step reads (``h_{T-1}``), w.r.t. ``h_1`` (the first state that holds the cue) and w.r.t. the
cue's observation at step 0, without chrono initialisation of the GRU's update gate and with
``chrono_horizon = factor x horizon`` for each ``--chrono-factors`` (default 1, as the configs set it). A
ratio ``|d/dh_1| / |d/dh_{T-1}|`` near 1 means BPTT carries the signal back to the cue; near 0, the gradient
vanishes on the way. This is the untrained network: it says
whether the recurrence can pass the signal at the start, not whether training finds the solution.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _timing import write_json  # noqa: E402

from deepep_lightning.deepep.agent import DeepEPAgent  # noqa: E402
from deepep_lightning.deepep.agent.rollout import eager_timestep  # noqa: E402
from deepep_lightning.deepep.envs import CueRecall  # noqa: E402

HIDDEN = 128
NUM_ENVS = 64


def gradient_norms(horizon: int, seed: int, chrono_horizon: int | None) -> dict[str, float]:
    """Norms of d(sum of the query step's Q) w.r.t. ``h_{T-1}``, ``h_1`` and the step-0 observation."""
    torch.manual_seed(seed)
    env = CueRecall(NUM_ENVS, horizon=horizon, num_cues=2)
    agent = DeepEPAgent(env.obs_dim, env.num_actions, HIDDEN, chrono_horizon=chrono_horizon)
    generator = torch.Generator().manual_seed(seed)
    obs = env.reset(generator).requires_grad_()
    first_obs, hidden = obs, agent.initial_state(NUM_ENVS, "cpu")
    states = []
    for _ in range(horizon):
        step, result, hidden = eager_timestep(agent, env, obs, hidden, generator)
        states.append(hidden)  # h_{t+1}
        obs = result.obs
    query_q = step.q.sum()  # the last step's Q reads h_{T-1} = states[-2]
    to_last, to_first, to_cue = torch.autograd.grad(query_q, (states[-2], states[0], first_obs))
    return {"h_last": to_last.norm().item(), "h_1": to_first.norm().item(), "cue_obs": to_cue.norm().item()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--horizons", type=int, nargs="+", default=[32, 64, 128, 256])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--chrono-factors", type=float, nargs="+", default=[1.0],
        help="chrono_horizon = factor x horizon, each (default: 1, the configs' choice); no chrono is always run",
    )  # fmt: skip
    args = parser.parse_args(argv)
    rows: list[dict[str, Any]] = []
    for horizon in args.horizons:
        for chrono_horizon in [None, *(max(2, round(f * horizon)) for f in args.chrono_factors)]:
            runs = [gradient_norms(horizon, seed, chrono_horizon) for seed in args.seeds]
            ratio = statistics.median(run["h_1"] / run["h_last"] for run in runs)
            cue = statistics.median(run["cue_obs"] for run in runs)
            rows.append(
                {"horizon": horizon, "chrono_horizon": chrono_horizon, "runs": runs,
                 "median_ratio_h1_to_h_last": ratio, "median_cue_obs": cue}
            )  # fmt: skip
            print(f"horizon={horizon} chrono_horizon={chrono_horizon}: |d/dh_1| / |d/dh_(T-1)| = {ratio:.3e},"
                  f" |d/d cue| = {cue:.3e}")  # fmt: skip
    write_json(
        Path(args.out) / "memory_gradient.json",
        {"hidden_size": HIDDEN, "num_envs": NUM_ENVS, "seeds": args.seeds, "rows": rows},
    )


if __name__ == "__main__":
    main()
