"""Overhead of NumericalHealthCallback and NaNRollbackCallback on DeepEP (eager or CUDA graph), side by side.

Three configurations run interleaved in one process, ``--repeats`` times each:
``off`` (no health callbacks), ``health`` (NumericalHealthCallback at its default
``check_every_n_steps``) and ``health+rollback`` (plus NaNRollbackCallback at its default
``snapshot_every_n_steps``). Each fit runs ``--warmup + --steps`` optimizer steps; the
timed window is the last ``--steps`` (CUDA-synchronised at both ends only). Writes
``DIR/health_overhead.json`` with the median seconds per step of each configuration
and the ratios against ``off``. Targets: health ≤ 1.01×, health+rollback ≤ 1.02×.

    PYTHONPATH=$PWD python benchmarks/bench_health_overhead.py --out benchmarks/results/health_overhead
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings

import lightning.pytorch as pl
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _timing import Stopwatch  # noqa: E402

from deepep_lightning.health import NaNRollbackCallback, NumericalHealthCallback  # noqa: E402


class _Timer(pl.Callback):
    """Seconds from the first step after ``warmup`` (the GPU idle) to the end of training (its kernels done)."""

    def __init__(self, warmup: int) -> None:
        self.warmup, self.seconds = warmup, None
        self._watch: Stopwatch | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.warmup and self._watch is None:
            if pl_module.device.type == "cuda":
                torch.cuda.synchronize(pl_module.device)
            self._watch = Stopwatch(pl_module.device)
            self._watch.start()

    def on_train_end(self, trainer, pl_module):
        self.seconds = self._watch.stop() / 1e3


def _module(args: argparse.Namespace) -> pl.LightningModule:
    from deepep_lightning.deepep import DeepEPModule
    from deepep_lightning.deepep.config import grouped

    return DeepEPModule(
        **grouped(
            num_envs=args.num_envs,
            rollout_length=args.rollout_length,
            hidden_size=args.hidden_size,
            steps_per_epoch=args.warmup + args.steps + 1,
            seed=0,
            fused_value_head=args.fused_value_head,
            cuda_graph=args.cuda_graph,
        )
    )


def _run(config: str, args: argparse.Namespace, accelerator: str) -> float:
    callbacks: list = []
    if config != "off":
        callbacks.append(NumericalHealthCallback())
    if config == "health+rollback":
        callbacks.append(NaNRollbackCallback())
    timer = _Timer(args.warmup)
    pl.seed_everything(0, verbose=False)
    module = _module(args)
    with tempfile.TemporaryDirectory() as root:
        trainer = pl.Trainer(
            accelerator=accelerator,
            devices=1,
            max_steps=args.warmup + args.steps,
            logger=False,
            callbacks=[timer, *callbacks],
            default_root_dir=root,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
        )
        trainer.fit(module)
    return timer.seconds / args.steps


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for health_overhead.json")
    parser.add_argument(
        "--steps", type=int, default=200, help="timed optimizer steps per fit (>= 2 snapshot intervals)"
    )
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-envs", type=int, default=64)
    parser.add_argument("--rollout-length", type=int, default=32)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--fused-value-head", action="store_true", help="use the compiled deepep::all_action_q op")
    parser.add_argument("--cpu", action="store_true", help="run on CPU (smoke test only)")
    parser.add_argument(
        "--cuda-graph",
        action="store_true",
        help="the whole step as one CUDA graph (configs/gpu.yaml: --num-envs 256 --rollout-length 32"
        " --hidden-size 256 --fused-value-head --cuda-graph)",
    )
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    accelerator = "cpu" if args.cpu or not torch.cuda.is_available() else "gpu"
    configs = ["off", "health", "health+rollback"]
    times: dict[str, list[float]] = {c: [] for c in configs}
    started = time.perf_counter()
    for repeat in range(args.repeats):
        order = configs[repeat % 3 :] + configs[: repeat % 3]  # rotate so no config always runs first
        for config in order:
            times[config].append(_run(config, args, accelerator))
            print(f"repeat {repeat} {config}: {times[config][-1] * 1e3:.2f} ms/step", flush=True)
    medians = {c: statistics.median(v) for c, v in times.items()}
    result = {
        "command": " ".join([os.path.basename(sys.argv[0]), *(argv if argv is not None else sys.argv[1:])]),
        "device": torch.cuda.get_device_name() if accelerator == "gpu" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "lightning": pl.__version__,
        "workload": {
            "num_envs": args.num_envs,
            "rollout_length": args.rollout_length,
            "hidden_size": args.hidden_size,
            "fused_value_head": args.fused_value_head,
            "cuda_graph": args.cuda_graph,
            "steps": args.steps,
            "warmup": args.warmup,
            "repeats": args.repeats,
        },
        "defaults": {
            "check_every_n_steps": NumericalHealthCallback().check_every_n_steps,
            "snapshot_every_n_steps": NaNRollbackCallback().snapshot_every_n_steps,
        },
        "seconds_per_step": times,
        "median_seconds_per_step": medians,
        "ratio_vs_off": {c: medians[c] / medians["off"] for c in configs},
        "targets": {"health": 1.01, "health+rollback": 1.02},
        "wall_seconds": time.perf_counter() - started,
    }
    result["pass"] = {c: result["ratio_vs_off"][c] <= t for c, t in result["targets"].items()}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "health_overhead.json")
    with open(path, "w") as handle:
        json.dump(result, handle, indent=2)
    print(json.dumps({k: result[k] for k in ("median_seconds_per_step", "ratio_vs_off", "pass")}, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
