"""DeepEP train-step time at B=256, T=256, H=256: eager vs one CUDA graph vs torch.compile, side by side.

    python benchmarks/bench_train_step.py --out DIR      # writes DIR/train_step.json

One process, same model and shapes for every variant; each step is the whole training step
(rollout of T timesteps, loss, backward, Adam step). Medians of ``--repeats`` steps after warm-up.
"""

from __future__ import annotations

import argparse
import sys
import time

if "--deterministic" in sys.argv:  # configure() must run before anything touches CUDA
    from deepep_lightning import configure

    configure(0)

import torch
from _timing import median_ms, write_json

from deepep_lightning.deepep import DeepEPModule
from deepep_lightning.deepep.agent.graphed_step import GraphedTrainStep


def build(args, **overrides):
    kwargs = dict(
        num_envs=args.batch, rollout_length=args.horizon, hidden_size=args.hidden, seed=0, fused_value_head=True
    )
    kwargs.update(overrides)
    model = DeepEPModule(**kwargs).cuda()
    model._ensure_rollout_state()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, capturable=kwargs.get("cuda_graph", False))
    return model, optimizer


def eager_step(model, optimizer):
    def step():
        model._seed_rollout()
        optimizer.zero_grad(set_to_none=True)
        _, terms = model._rollout_and_loss()
        terms.loss.backward()
        optimizer.step()
        model._rollout_step += 1

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--horizon", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--skip-compile", action="store_true")
    parser.add_argument("--graph-only", action="store_true", help="only the CUDA-graph step")
    parser.add_argument(
        "--deterministic",
        action="store_true",
        help="run under deepep_lightning.configure(0) (DeterminismCallback's defaults)",
    )
    parser.add_argument("--tag", default="", help="suffix of the JSON file name")
    args = parser.parse_args()
    results = {}

    eager_variants = () if args.graph_only else (("eager_fused", {}), ("eager_reference", {"fused_value_head": False}))
    for name, overrides in eager_variants:
        model, optimizer = build(args, **overrides)
        results[name] = median_ms(eager_step(model, optimizer), args.repeats)[0]

    model, optimizer = build(args, cuda_graph=True)
    graphed = GraphedTrainStep(lambda: model._whole_step(optimizer), model._generator)

    def graph_step():
        model._seed_rollout()
        graphed()
        model._rollout_step += 1

    t0 = time.perf_counter()
    for _ in range(graphed.warmup_steps + 1):
        graph_step()
    torch.cuda.synchronize()
    results["cuda_graph_warmup_and_capture_s"] = time.perf_counter() - t0
    results["cuda_graph"] = median_ms(graph_step, args.repeats * 3)[0]

    if not args.skip_compile and not args.graph_only:
        model, optimizer = build(args, compile_step=True)
        step = eager_step(model, optimizer)
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        results["compile_first_step_s"] = time.perf_counter() - t0
        results["torch_compile_step"] = median_ms(step, args.repeats)[0]

    ratios = {
        f"eager_fused_over_{k}": results["eager_fused"] / results[k]
        for k in ("cuda_graph", "torch_compile_step")
        if k in results and "eager_fused" in results
    }
    results["deterministic_algorithms"] = torch.are_deterministic_algorithms_enabled()
    write_json(
        f"{args.out}/train_step{args.tag}.json",
        {
            "config": vars(args),
            "median_ms_per_step": results,
            "speedup_vs_eager": ratios,
            "target": {"cuda_graph_ms_max": 90, "met": results["cuda_graph"] <= 90},
        },
    )
    print(results, ratios)


if __name__ == "__main__":
    main()
