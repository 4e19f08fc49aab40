"""DeepEP train-step time: eager, one CUDA graph, compiled timestep, fused BPTT, and their combinations, side by side.

    python benchmarks/bench_train_step.py --out DIR             # GPU: writes DIR/train_step.json
    python benchmarks/bench_train_step.py --out DIR --quick     # CPU smoke test: tiny shapes, no graph variants

One process, the same model and shapes for every variant. A step is the whole training step
(``GraphTraining.whole_step``: rollout of T timesteps, loss, backward, gradient norm, Adam step).
Variants: ``eager`` (op by op), ``graph`` (the step captured as one CUDA graph), ``compiled_eager``
(``compile_step=True``: the timestep fused by inductor, the step run eagerly) and ``compiled_graph``
(the compiled timestep inside the CUDA graph), all with ``fused_bptt=False``; the ``fused_*`` variants
are the same with ``fused_bptt=True`` (the timesteps run without autograd and the backward through time
is one recurrent op of two kernels per timestep, :mod:`deepep_lightning.deepep.agent.fused_bptt`), op by op;
the ``rollout_kernel_*`` variants add ``fused_rollout=True`` (the no-gradient timesteps as one
``deepep::cartpole_rollout`` launch, :mod:`deepep_lightning.deepep.agent.fused_rollout`; ``--rollout-rows``
sets its rows per block).
Per shape (``--horizons``, default 256 and ``configs/gpu.yaml``'s 32): medians of ``--repeats`` steps
after warm-up, the set-up time of each variant (compile, warm-up, capture), a kernel census per
timestep (torch.profiler: CUDA kernels of one step / T, of a graph replay and of the same step run
uncaptured; the replay's kernel time by name, and its sum against the step time) and the achieved
FLOP/s against the fp32 peak, from FLOPs counted analytically from the shapes (:func:`flops_per_step`).
"""

from __future__ import annotations

import argparse
import collections
import sys
import time

if "--deterministic" in sys.argv:  # configure() must run before anything touches CUDA
    from deepep_lightning import configure

    configure(0)

import torch
from _timing import median_ms, write_json
from torch._dynamo.utils import counters

from deepep_lightning.deepep import DeepEPModule
from deepep_lightning.deepep.agent import fused_rollout
from deepep_lightning.deepep.config import grouped
from deepep_lightning.deepep.graph_training import StandaloneStep

VARIANTS = (
    "eager",
    "graph",
    "compiled_eager",
    "compiled_graph",
    "fused_eager",
    "fused_graph",
    "fused_compiled_eager",
    "fused_compiled_graph",
    "rollout_kernel_eager",
    "rollout_kernel_graph",
)
GRAPH_BAR_MS = 30.0  # issue 18's bar for the graph step at B=256, T=256, H=256
KERNELS_PER_TIMESTEP_BAR = 20  # issue 18's bar for the graph step's kernels per timestep
H200_FP32_PEAK_TFLOPS = 67.0  # H200 SXM datasheet, fp32 without tensor cores (TF32 matmul is off)


def flops_per_step(batch: int, horizon: int, hidden: int, value_hidden: int, obs_dim: int, actions: int) -> int:
    """Matmul FLOPs of one training step: 3x the forward GEMMs of each timestep (forward, input and weight
    gradients) plus the forward of the bootstrap evaluation at s_T. Elementwise work is not counted."""
    features = obs_dim + hidden
    policy = 2 * batch * features * hidden + 2 * batch * hidden * actions
    value = 2 * batch * features * value_hidden + 2 * batch * actions * value_hidden  # W1, then w2 per action
    gru = 2 * batch * (obs_dim + actions + 1) * 3 * hidden + 2 * batch * hidden * 3 * hidden
    return 3 * horizon * (policy + value + gru) + policy + value


class _Variant:
    """One variant's model, optimizer and step function (one call = one training step)."""

    def __init__(self, name: str, args: argparse.Namespace, horizon: int) -> None:
        graph, compiled, kernel = name.endswith("graph"), "compiled" in name, name.startswith("rollout_kernel")
        fused = name.startswith("fused") or kernel
        self.model = DeepEPModule(
            **grouped(
                num_envs=args.batch,
                rollout_length=horizon,
                hidden_size=args.hidden,
                seed=0,
                fused_value_head=not args.reference_head,
                cuda_graph=graph,
                compile_step=compiled,
                fused_bptt=fused,
                fused_rollout=kernel,
            )
        ).to(args.device)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-4, capturable=graph)
        self.standalone = StandaloneStep(self.model, self.optimizer)  # one CUDA graph when cuda_graph=True
        self.graphed = self.standalone.graphed

    def step(self) -> None:
        self.standalone()

    def uncaptured_step(self) -> None:
        """The same step, op by op on the current stream (what the graph captured)."""
        self.model.seed_rollout()
        self.standalone.training.whole_step(self.optimizer)
        self.model.rollout_state.step += 1

    def compile_fallback(self) -> str | None:
        timestep = self.model.rollout_state.compiled_timestep
        return timestep.unavailable_reason if timestep is not None else None


def compiled_variant(name: str) -> bool:
    return "compiled" in name


def _kernels_of(fn) -> tuple[collections.Counter, collections.Counter]:
    """The CUDA kernels (not memcpy/memset) that one call of ``fn`` runs, by name, from torch.profiler:
    launches and summed device time (µs) of each name."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    launches, times_us = collections.Counter(), collections.Counter()
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        if event.name.startswith(("Memcpy", "Memset", "cudaMemcpy", "cudaMemset")):
            continue
        launches[event.name] += 1
        times_us[event.name] += event.time_range.elapsed_us()
    return launches, times_us


def _short(name: str, limit: int = 160) -> str:
    """A kernel's name without its template arguments' tail (they run to thousands of characters)."""
    return name if len(name) <= limit else name[:limit] + "..."


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def bench_shape(args: argparse.Namespace, horizon: int) -> dict:
    medians, samples, setup_s, census, fallback = {}, {}, {}, {}, {}
    for name in args.variants:
        graphs_before = counters["stats"]["unique_graphs"]
        t0 = time.perf_counter()
        variant = _Variant(name, args, horizon)
        # first calls: compile (compiled_*), warm-up and capture (graph*); each is a real training step
        for _ in range(variant.graphed.warmup_steps + 1 if variant.graphed is not None else 1):
            variant.step()
        _sync(args.device)
        setup_s[name] = time.perf_counter() - t0
        if compiled_variant(name):
            fallback[name] = variant.compile_fallback()
            setup_s[f"{name}_new_dynamo_graphs"] = counters["stats"]["unique_graphs"] - graphs_before
        repeats = args.repeats * (3 if variant.graphed is not None else 1)
        medians[name], samples[name] = median_ms(variant.step, repeats, warmup=1, device=args.device)
        if args.device == "cuda" and not args.no_census:
            (replay, replay_us), (uncaptured, _) = _kernels_of(variant.step), _kernels_of(variant.uncaptured_step)
            busy_ms = replay_us.total() / 1e3
            census[name] = {
                "per_step": replay.total(),
                "per_timestep": replay.total() / horizon,
                "per_step_uncaptured": uncaptured.total(),
                "per_timestep_uncaptured": uncaptured.total() / horizon,
                # what a timestep still launches, most frequent first (kernel name: launches per timestep)
                "top_uncaptured_per_timestep": {k: n / horizon for k, n in uncaptured.most_common(args.top_kernels)},
                # where a replayed step's device time goes: the sum of its kernels' durations against the
                # step's median (the rest is the gaps between dependent launches), and the longest kernels
                "kernel_busy_ms_per_step": busy_ms,
                "kernel_busy_fraction_of_step": busy_ms / medians[name],
                "top_time_ms_per_step": {
                    _short(k): {"ms": us / 1e3, "launches": replay[k]}
                    for k, us in replay_us.most_common(args.top_kernels)
                },
            }
        print(f"T={horizon} {name}: {medians[name]:.2f} ms (set-up {setup_s[name]:.1f} s)", flush=True)
        del variant
    probe = DeepEPModule(
        **grouped(num_envs=args.batch, rollout_length=horizon, hidden_size=args.hidden, fused_value_head=False)
    )
    agent = probe.agent
    flops = flops_per_step(
        args.batch, horizon, args.hidden, agent.value_head.output_weight.numel(), agent.obs_dim, agent.num_actions
    )
    tflops = {k: flops / (ms * 1e-3) / 1e12 for k, ms in medians.items()}
    return {
        "batch": args.batch,
        "horizon": horizon,
        "hidden": args.hidden,
        "median_ms_per_step": medians,
        "samples_ms": samples,
        "setup_s": setup_s,
        "compile_fallback_reason": fallback,
        "kernels": census or None,
        "flops_per_step": flops,
        "flops_convention": "3x forward GEMM FLOPs per timestep + bootstrap forward; elementwise not counted",
        "achieved_tflops": tflops,
        "fraction_of_fp32_peak": {k: v / args.fp32_peak_tflops for k, v in tflops.items()},
        "speedup_vs_eager": {k: medians["eager"] / ms for k, ms in medians.items() if "eager" in medians},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--horizons", type=int, nargs="+", default=[256, 32])
    parser.add_argument("--horizon", type=int, help="a single horizon (same as --horizons N)")
    parser.add_argument("--repeats", type=int, default=10, help="timed steps per variant (x3 for graph variants)")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--graph-only", action="store_true", help="only the CUDA-graph step (same as --variants graph)")
    parser.add_argument("--reference-head", action="store_true", help="the pure-PyTorch value head, not the fused op")
    parser.add_argument("--no-census", action="store_true", help="skip the torch.profiler kernel census")
    parser.add_argument("--top-kernels", type=int, default=30, help="kernel names listed per variant in the census")
    parser.add_argument("--fp32-peak-tflops", type=float, default=H200_FP32_PEAK_TFLOPS)
    parser.add_argument("--quick", action="store_true", help="CPU smoke test: B=8, H=16, T=4, 2 repeats")
    parser.add_argument(
        "--rollout-rows",
        type=int,
        default=None,
        help="run the rollout's block kernel with this many rows per block (default: the cluster kernel where it runs)",
    )
    parser.add_argument(
        "--deterministic",
        action="store_true",
        help="run under deepep_lightning.configure(0) (DeterminismCallback's defaults)",
    )
    parser.add_argument("--tag", default=None, help="suffix of the JSON file name (--quick: _quick)")
    args = parser.parse_args()
    args.device = "cuda" if torch.cuda.is_available() and not args.quick else "cpu"
    if args.horizon is not None:
        args.horizons = [args.horizon]
    if args.graph_only:
        args.variants = ["graph"]
    if args.quick:
        args.batch, args.hidden, args.horizons, args.repeats = 8, 16, [4], 2
        args.tag = "_quick" if args.tag is None else args.tag
        torch.set_num_threads(1)  # tiny ops: more threads only spin
    if args.device == "cpu":
        args.variants = [v for v in args.variants if not v.endswith("graph")]  # CUDA graphs need a GPU
    if not args.variants:
        parser.error("no variant left to run on this device (the graph variants need CUDA)")

    if args.rollout_rows is not None:
        fused_rollout.runs_on_clusters = lambda agent, env: False
        fused_rollout.default_rows_per_block = lambda batch, device: args.rollout_rows
    shapes = [bench_shape(args, horizon) for horizon in args.horizons]
    main_shape = next((s for s in shapes if (s["batch"], s["horizon"], s["hidden"]) == (256, 256, 256)), None)
    graph_ms = {k: v for k, v in (main_shape or {}).get("median_ms_per_step", {}).items() if k.endswith("graph")}
    best = min(graph_ms, key=graph_ms.__getitem__) if graph_ms else None
    census = ((main_shape or {}).get("kernels") or {}).get(best or "", {})
    write_json(
        f"{args.out}/train_step{args.tag or ''}.json",
        {
            "config": vars(args),
            "shapes": shapes,
            "bar": {
                "graph_ms_max": GRAPH_BAR_MS,
                "shape": "B=256 T=256 H=256",
                "best_graph_variant": best,
                "best_graph_ms": graph_ms.get(best) if best else None,
                "met": graph_ms[best] <= GRAPH_BAR_MS if best else None,
                "kernels_per_timestep_max": KERNELS_PER_TIMESTEP_BAR,
                "best_graph_kernels_per_timestep": census.get("per_timestep"),
                "kernels_met": census["per_timestep"] <= KERNELS_PER_TIMESTEP_BAR if census else None,
            },
            "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
            "inductor_deterministic_global": bool(torch._inductor.config.deterministic),
        },
    )


if __name__ == "__main__":
    main()
