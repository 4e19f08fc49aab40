"""DeterministicDDPStrategy on N GPUs (NCCL) with DeepEP: bitwise runs, lockstep rollback, scaling, cost.

Runs, each a fresh ``fit`` launched by this script (Lightning's launcher re-runs it for ranks >= 1):

* ``det_a``, ``det_b``: ``strategy="ddp_deterministic"`` on ``--gpus`` GPUs, twice: final weights
  must be bitwise equal (run to run, and rank to rank).
* ``fault``: the same plus NumericalHealthCallback + NaNRollbackCallback, and a NaN planted in a
  gradient on the last rank only at step ``--fault-step``: every rank must roll back to the same
  snapshot, replay in lockstep, and end bitwise equal to ``det_a``.
* ``det_1``: ``ddp_deterministic`` on 1 GPU with the same per-GPU work (weak scaling):
  efficiency = median step time on 1 GPU / median step time on ``--gpus`` GPUs (target >= 0.9).
* ``plain``: ``strategy="ddp"`` on ``--gpus`` GPUs: the step-time cost of the deterministic profile
  (pinned NCCL algorithm/protocol, fixed buckets, per-rank seeds) = det / plain.
* ``inv_1``, ``inv_2``: world-size-invariant mode (``virtual_world_size=2``) on the small MLP of
  ``tests/strategies/_ddp_run.py`` (DeepEP's rollouts are keyed by the physical rank, so DeepEP
  itself is not covered): 1 GPU accumulating 2 micro-batches vs 2 GPUs, weights must be equal.

DeepEP runs in eager mode with the pure-PyTorch value head (no extension build) and no
``configure()`` (pass ``--configure`` to add deterministic algorithms; BENCHMARKS.md gives its cost).
NVLS/multicast are off in *every* run (the lent 2-GPU machines need it), so ``plain`` differs from
``det`` only by the profile. Step times are medians over the steps after ``--warmup``, each step
CUDA-synchronised. Writes ``DIR/ddp.json`` (summary) and ``DIR/<run>/rank<r>.json``.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
    PYTHONPATH=$PWD python benchmarks/bench_ddp.py --out benchmarks/results/ddp --gpus 2
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

RUN_TIMEOUT_S = 100


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--num-envs", type=int, default=256, help="per GPU")
    parser.add_argument("--rollout-length", type=int, default=64)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--steps", type=int, default=30, help="timed steps after warm-up")
    parser.add_argument("--fault-step", type=int, default=22)
    parser.add_argument("--configure", action="store_true", help="call deepep_lightning.configure(0) first")
    parser.add_argument("--runs", default="det_a,det_b,fault,det_1,plain,inv_1,inv_2")
    parser.add_argument("--accelerator", default="gpu", help="'cpu' only to smoke-test this script (gloo)")
    # worker mode (set by the driver; ranks >= 1 inherit it from Lightning's launcher)
    parser.add_argument("--worker", default=None)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--strategy", default="ddp_deterministic")
    parser.add_argument("--fault", action="store_true")
    return parser


# ------------------------------------------------------------------------------------------ worker
def build_workload(args: argparse.Namespace, devices: int, accelerator: str, strategy, callbacks: list, root: str):
    """DeepEP eager with the pure-PyTorch value head and its Trainer: the workload bench_ddp and ddp_ablation time.

    ``args`` carries the sizes (``num_envs`` per GPU, ``rollout_length``, ``hidden_size``) and the step counts
    (``warmup`` untimed, ``steps`` timed); the trainer runs exactly ``warmup + steps`` optimizer steps.
    """
    import lightning.pytorch as pl

    from deepep_lightning.deepep import DeepEPModule
    from deepep_lightning.deepep.config import grouped

    total = args.warmup + args.steps
    model = DeepEPModule(
        **grouped(
            num_envs=args.num_envs,
            rollout_length=args.rollout_length,
            hidden_size=args.hidden_size,
            steps_per_epoch=total * devices + devices,
            seed=0,
            fused_value_head=False,
        )
    )
    trainer = pl.Trainer(
        accelerator=accelerator,
        devices=devices,
        strategy=strategy,
        max_steps=total,
        callbacks=callbacks,
        logger=False,
        default_root_dir=root,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        gradient_clip_val=1.0,
    )
    return model, trainer


def _worker(args: argparse.Namespace) -> None:
    import deepep_lightning.strategies  # noqa: F401  (registers "ddp_deterministic")

    if args.configure:
        from deepep_lightning.determinism import configure

        configure(0, distributed=True)
    import lightning.pytorch as pl
    import torch
    from _timing import Stopwatch

    class StepTimer(pl.Callback):
        """Seconds of every training step, from batch start (the GPU idle) to batch end (its kernels done)."""

        def __init__(self) -> None:
            self.times: list[float] = []
            self._watch: Stopwatch | None = None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if pl_module.device.type == "cuda":
                torch.cuda.synchronize(pl_module.device)
            self._watch = Stopwatch(pl_module.device)
            self._watch.start()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.times.append(self._watch.stop() / 1e3)

    pl.seed_everything(0, verbose=False)
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    timer = StepTimer()
    callbacks: list = [timer]
    rollback = None
    if args.fault:
        from deepep_lightning.health import FaultInjectionCallback, NaNRollbackCallback, NumericalHealthCallback

        rollback = NaNRollbackCallback(snapshot_every_n_steps=5, keep_snapshots=2, locate=False)
        callbacks += [NumericalHealthCallback(check_every_n_steps=5, spike_detection=False), rollback]
        if rank == args.devices - 1:
            callbacks.append(FaultInjectionCallback("gradient", steps=[args.fault_step], mode="once"))
    out = os.path.join(args.out, args.worker)
    model, trainer = build_workload(args, args.devices, args.accelerator, args.strategy, callbacks, out)
    trainer.fit(model)
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())  # 0-dim too
    strategy = trainer.strategy
    record = {
        "run": args.worker,
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "strategy": args.strategy,
        "median_step_s": statistics.median(timer.times[args.warmup :]) if len(timer.times) > args.warmup else None,
        "step_times_s": timer.times,
        "weights_sha256": digest.hexdigest(),
        "global_step": trainer.global_step,
        "incidents": [
            {k: v for k, v in i.to_dict().items() if k in ("step", "reason", "outcome")} for i in rollback.incidents
        ]
        if rollback is not None
        else [],
        "fingerprint": strategy.fingerprint() if hasattr(strategy, "fingerprint") else {},
        "env": {k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "TORCH_SYMM", "NVSHMEM"))},
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
        "torch": str(torch.__version__),
    }
    with open(os.path.join(out, f"rank{trainer.global_rank}.json"), "w") as handle:
        json.dump(record, handle, indent=1)


# ------------------------------------------------------------------------------------------ driver
WORKLOAD = ("num_envs", "rollout_length", "hidden_size", "warmup", "steps")


def workload_flags(args: argparse.Namespace) -> list[str]:
    """The workload's size arguments as command-line flags, for the worker processes of a run."""
    return [item for name in WORKLOAD for item in (f"--{name.replace('_', '-')}", str(getattr(args, name)))]


def _run_process_group(command: list[str], env: dict, out: str) -> tuple[str, str]:
    """Run ``command`` in its own process group (its ranks die with it), log to ``out/log.txt``."""
    proc = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
        status = "ok" if proc.returncode == 0 else f"exit {proc.returncode}"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        status = f"timeout after {RUN_TIMEOUT_S} s (a rank hung?)"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    with open(os.path.join(out, "log.txt"), "w") as handle:
        handle.write(output)
    return status, output


def _launch(args: argparse.Namespace, name: str, devices: int, strategy: str, fault: bool = False) -> dict:
    out = os.path.join(args.out, name)
    os.makedirs(out, exist_ok=True)
    command = [
        sys.executable,
        os.path.abspath(__file__),
        "--worker",
        name,
        "--devices",
        str(devices),
        "--strategy",
        strategy,
        "--out",
        args.out,
        *workload_flags(args),
        "--fault-step",
        str(args.fault_step),
    ]
    command += ["--accelerator", args.accelerator]
    command += ["--fault"] if fault else []
    command += ["--configure"] if args.configure else []
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT")}
    started = time.perf_counter()
    status, output = _run_process_group(command, env, out)
    ranks = []
    for rank in range(devices):
        path = os.path.join(out, f"rank{rank}.json")
        ranks.append(json.load(open(path)) if os.path.exists(path) else None)
    print(f"[bench_ddp] {name}: {status} in {time.perf_counter() - started:.1f} s", flush=True)
    if status != "ok":
        print(output[-3000:], flush=True)
    return {"status": status, "ranks": ranks}


def _launch_invariance(args: argparse.Namespace, name: str, devices: int) -> dict:
    """A run of the test helper's small MLP in world-size-invariant mode; returns its weights' hash."""
    import torch

    out = os.path.join(args.out, name)
    os.makedirs(out, exist_ok=True)
    script = os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "strategies", "_ddp_run.py"
    )
    command = [
        sys.executable,
        script,
        "--out",
        out,
        "--devices",
        str(devices),
        "--accelerator",
        args.accelerator,
        "--no-health",
        "--accumulate",
        str(2 // devices),
        "--strategy-kwargs",
        '{"virtual_world_size": 2}',
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), env.get("PYTHONPATH", "")]
    )
    status, output = _run_process_group(command, env, out)
    print(f"[bench_ddp] {name}: {status}", flush=True)
    path = os.path.join(out, "weights_rank0.pt")
    if status != "ok" or not os.path.exists(path):
        print(output[-3000:], flush=True)
        return {"status": status, "ranks": [None]}
    digest = hashlib.sha256()
    for key, tensor in sorted(torch.load(path, weights_only=True).items()):
        digest.update(key.encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return {"status": status, "ranks": [{"weights_sha256": digest.hexdigest(), "median_step_s": None, "incidents": []}]}


def _median(run: dict) -> float | None:
    values = [r["median_step_s"] for r in run["ranks"] if r and r["median_step_s"] is not None]
    return max(values) if values else None  # the slowest rank sets the pace


def _hashes(run: dict) -> list:
    return [r["weights_sha256"] if r else None for r in run.get("ranks", [])]


def main() -> None:
    args = _parser().parse_args()
    if args.worker:
        _worker(args)
        return
    os.makedirs(args.out, exist_ok=True)
    wanted = args.runs.split(",")
    plan = {
        "det_a": (args.gpus, "ddp_deterministic", False),
        "det_b": (args.gpus, "ddp_deterministic", False),
        "fault": (args.gpus, "ddp_deterministic", True),
        "det_1": (1, "ddp_deterministic", False),
        "plain": (args.gpus, "ddp", False),
    }
    runs = {name: _launch(args, name, *plan[name]) for name in wanted if name in plan}
    for name, devices in (("inv_1", 1), ("inv_2", 2)):
        if name in wanted:
            runs[name] = _launch_invariance(args, name, devices)
    summary: dict = {"command": " ".join(sys.argv), "gpus": args.gpus, "config": vars(args), "runs": {}}
    for name, run in runs.items():
        summary["runs"][name] = {
            "status": run["status"],
            "median_step_s": _median(run),
            "weights_sha256": _hashes(run),
            "incidents": [r["incidents"] if r else None for r in run["ranks"]],
        }
    det_a, det_b = runs.get("det_a"), runs.get("det_b")
    if det_a and det_b:
        hashes = _hashes(det_a) + _hashes(det_b)
        summary["bitwise_run_to_run"] = None not in hashes and len(set(hashes)) == 1
    if det_a and "fault" in runs:
        fault = runs["fault"]
        incidents = [r["incidents"] if r else None for r in fault["ranks"]]
        summary["rollback_lockstep"] = {
            "all_ranks_rolled_back": all(i and i[0]["outcome"] == "transient" for i in incidents),
            "ranks_equal": len(set(_hashes(fault))) == 1 and None not in _hashes(fault),
            "equal_to_clean_run": _hashes(fault)[0] == _hashes(det_a)[0],
        }
    if det_a and "det_1" in runs and _median(det_a) and _median(runs["det_1"]):
        summary["weak_scaling_efficiency"] = _median(runs["det_1"]) / _median(det_a)
    if det_a and "plain" in runs and _median(det_a) and _median(runs["plain"]):
        summary["deterministic_over_plain"] = _median(det_a) / _median(runs["plain"])
    if "inv_1" in runs and "inv_2" in runs:
        hashes = _hashes(runs["inv_1"]) + _hashes(runs["inv_2"])
        summary["world_size_invariant_1_vs_2"] = None not in hashes and len(set(hashes)) == 1
    with open(os.path.join(args.out, "ddp.json"), "w") as handle:
        json.dump(summary, handle, indent=1)
    print(json.dumps({k: v for k, v in summary.items() if k not in ("config", "runs")}, indent=1))


if __name__ == "__main__":
    main()
