"""What ``ddp_deterministic`` costs against plain ``"ddp"``: step time of one DeepEP workload, variant by variant.

It runs bench_ddp's workload (DeepEP eager, pure-PyTorch value head, 256 envs per GPU, T=64, H=256, Adam,
``gradient_clip_val=1``, no ``configure()``) once per variant, each in fresh processes, so that every
difference between the two strategies is switched on or off alone:

=========================  ==================================================================
``ddp`` / ``det``          plain ``"ddp"`` / ``"ddp_deterministic"`` on ``--gpus`` GPUs
``ddp_1gpu`` / ``det_1gpu`` the same on 1 GPU, same per-GPU work (weak scaling)
``ddp_nccl_profile``       plain ``"ddp"`` with the strategy's NCCL profile exported
                           (``NCCL_ALGO=Ring NCCL_PROTO=Simple NCCL_COLLNET_ENABLE=0``)
``det_no_nccl_profile``    ``ddp_deterministic`` with ``apply_nccl_profile`` patched out (NCCL chooses)
``det_no_reseed``          ``DeterministicDDPStrategy(reseed_every_step=False)``
``det_no_bucket_view``     ``DeterministicDDPStrategy(gradient_as_bucket_view=False)`` (plain ddp's value)
``det_repeat`` / ``ddp_repeat``  ``det`` and ``ddp`` again, last: drift of the machine over the run
``ddp_configure``          plain ``"ddp"`` after ``configure(0)`` (deterministic algorithms, cuBLAS workspace)
``det_nccl_ll``            ``DeterministicDDPStrategy(nccl_protocol="LL")`` (a candidate fix)
=========================  ==================================================================

Optional (``--variants``): ``det_static_graph``, ``det_nccl_ll128``, ``det_configure``, and
``det_manual_seed_reseed`` (the per-step reseed through ``torch.manual_seed`` instead of the fast path of
``seed_everything_from``: its host cost shows in the ``own us`` column).

NVLS/multicast are off in every run, as in ``bench_ddp.py`` (the lent 2-GPU machines need it). The
ranks of a variant are started side by side by this script (``LOCAL_RANK``/``WORLD_SIZE``/
``MASTER_PORT`` set, as Lightning's own launcher sets them for its children), so they import in
parallel. Per step (after ``--warmup``), every rank records: the step time (``on_train_batch_start``
to ``on_train_batch_end``, CUDA-synchronised at both ends, as ``bench_ddp.py``); the period from one
batch start to the next (adds Lightning's work between steps); host and CUDA-event time of the
phases forward (rollout and loss), backward (with DDP's all-reduce) and optimizer (clipping, Adam,
logging); and, for ``ddp_deterministic``, the host time of the strategy's own ``training_step`` code
(excluding the module's step it wraps). A step's time is the slowest rank's. A variant that fails or
hangs is recorded and the next one runs; no variant starts once ``--budget-s`` would be exceeded.
``DIR/ddp_ablation.json`` is rewritten after every variant; ``DIR/<variant>/rank<r>.{json,log}`` too.

    PYTHONPATH=$PWD python benchmarks/ddp_ablation.py --out benchmarks/results/ddp_ablation --gpus 2
    python benchmarks/ddp_ablation.py --cpu --out /tmp/abl --steps 5     # gloo dry run, small model
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _REPO)

from bench_ddp import build_workload, workload_flags  # noqa: E402  (the same workload, launched the same way)

#: The strategy's NCCL profile minus what every run has anyway (NVLS/multicast off).
_PROFILE_ENV = {"NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple", "NCCL_COLLNET_ENABLE": "0"}
#: Variables a variant may set; removed from the inherited environment unless the variant sets them.
_CONTROLLED_ENV = ("NCCL_ALGO", "NCCL_PROTO", "NCCL_COLLNET_ENABLE", "CUBLAS_WORKSPACE_CONFIG")
#: Recorded from every rank's environment after the run (what was really in effect).
_RECORDED_ENV_PREFIXES = (
    "NCCL_",
    "TORCH_SYMM",
    "NVSHMEM",
    "CUBLAS_",
    "OMP_NUM_THREADS",
    "PL_GLOBAL_SEED",
    "PYTHONHASHSEED",
)


@dataclasses.dataclass(frozen=True)
class Variant:
    """One launch: strategy, device count (0 = ``--gpus``), and the single thing it changes."""

    strategy: str
    devices: int
    what: str
    strategy_kwargs: dict = dataclasses.field(default_factory=dict)
    env: dict = dataclasses.field(default_factory=dict)
    no_nccl_profile: bool = False
    configure: bool = False
    manual_seed_reseed: bool = False


VARIANTS: dict[str, Variant] = {
    "ddp": Variant("ddp", 0, "plain Lightning ddp (bench_ddp's 'plain')"),
    "det": Variant("ddp_deterministic", 0, "ddp_deterministic, defaults (bench_ddp's 'det_a')"),
    "ddp_1gpu": Variant("ddp", 1, "plain ddp on 1 GPU (weak-scaling baseline)"),
    "det_1gpu": Variant("ddp_deterministic", 1, "ddp_deterministic on 1 GPU (bench_ddp's 'det_1')"),
    "ddp_nccl_profile": Variant(
        "ddp", 0, "plain ddp + NCCL_ALGO=Ring NCCL_PROTO=Simple NCCL_COLLNET_ENABLE=0", env=_PROFILE_ENV
    ),
    "det_no_nccl_profile": Variant(
        "ddp_deterministic", 0, "det with apply_nccl_profile patched out (NCCL tuner)", no_nccl_profile=True
    ),
    "det_no_reseed": Variant(
        "ddp_deterministic", 0, "det, reseed_every_step=False", strategy_kwargs={"reseed_every_step": False}
    ),
    "det_no_bucket_view": Variant(
        "ddp_deterministic", 0, "det, gradient_as_bucket_view=False", strategy_kwargs={"gradient_as_bucket_view": False}
    ),
    "det_repeat": Variant("ddp_deterministic", 0, "det again (drift check)"),
    "ddp_repeat": Variant("ddp", 0, "plain ddp again (drift check)"),
    "ddp_configure": Variant(
        "ddp", 0, "plain ddp after configure(0) (deterministic algorithms, CUBLAS_WORKSPACE_CONFIG)", configure=True
    ),
    "det_nccl_ll": Variant("ddp_deterministic", 0, "det, nccl_protocol='LL'", strategy_kwargs={"nccl_protocol": "LL"}),
    # optional
    "det_nccl_ll128": Variant(
        "ddp_deterministic", 0, "det, nccl_protocol='LL128'", strategy_kwargs={"nccl_protocol": "LL128"}
    ),
    "det_static_graph": Variant(
        "ddp_deterministic", 0, "det, static_graph=True", strategy_kwargs={"static_graph": True}
    ),
    "det_configure": Variant("ddp_deterministic", 0, "det after configure(0)", configure=True),
    "det_manual_seed_reseed": Variant(
        "ddp_deterministic",
        0,
        "det, per-step reseed via seed_everything_from (torch.manual_seed)",
        manual_seed_reseed=True,
    ),
}
DEFAULT_VARIANTS = (
    "ddp",
    "det",
    "ddp_1gpu",
    "det_1gpu",
    "ddp_nccl_profile",
    "det_no_nccl_profile",
    "det_no_reseed",
    "det_no_bucket_view",
    "det_repeat",
    "ddp_repeat",
    "ddp_configure",
    "det_nccl_ll",
)
#: (numerator, denominator, meaning) of the ratios in the summary.
RATIOS = (
    ("det", "ddp", "det / plain"),
    ("det_repeat", "ddp_repeat", "det / plain, repeated at the end"),
    ("det_1gpu", "det", "weak-scaling efficiency, det"),
    ("ddp_1gpu", "ddp", "weak-scaling efficiency, plain"),
    ("det_1gpu", "ddp_1gpu", "det / plain on 1 GPU"),
    ("ddp_nccl_profile", "ddp", "cost of the NCCL profile on plain ddp"),
    ("det_no_nccl_profile", "det", "det without the NCCL profile / det"),
    ("det_no_reseed", "det", "det without per-step reseed / det"),
    ("det_no_bucket_view", "det", "det with gradient_as_bucket_view=False / det"),
    ("det_nccl_ll", "det", "det with NCCL_PROTO=LL / det"),
    ("ddp_configure", "ddp", "cost of configure() on plain ddp"),
    ("det_manual_seed_reseed", "det", "per-step reseed via torch.manual_seed / fast path"),
    ("det_repeat", "det", "drift: det at the end / det at the start"),
    ("ddp_repeat", "ddp", "drift: plain at the end / plain at the start"),
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--gpus", type=int, default=2, help="processes of the multi-device variants")
    parser.add_argument(
        "--cpu", action="store_true", help="dry run on CPU with gloo (small model unless sizes are given)"
    )
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help=f"comma list of {sorted(VARIANTS)}")
    parser.add_argument("--num-envs", type=int, default=None, help="per GPU (default 256; 16 with --cpu)")
    parser.add_argument("--rollout-length", type=int, default=None, help="default 64; 8 with --cpu")
    parser.add_argument("--hidden-size", type=int, default=None, help="default 256; 32 with --cpu")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps (default 10; 2 with --cpu)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps after warm-up")
    parser.add_argument("--budget-s", type=float, default=400.0, help="start no variant that would end after this")
    parser.add_argument("--variant-timeout-s", type=float, default=90.0, help="kill a variant's ranks after this")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # set by the driver
    return parser


def _resolve_sizes(args: argparse.Namespace) -> None:
    small = args.cpu
    for name, gpu, cpu in (
        ("num_envs", 256, 16),
        ("rollout_length", 64, 8),
        ("hidden_size", 256, 32),
        ("warmup", 10, 2),
    ):
        if getattr(args, name) is None:
            setattr(args, name, cpu if small else gpu)


# ------------------------------------------------------------------------------------------ worker
def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _instrument_strategy_training_step(own_times: list[float]) -> None:
    """Record the host time of ``DeterministicDDPStrategy.training_step`` minus the module step it wraps."""
    from lightning.pytorch.strategies.strategy import Strategy

    from deepep_lightning.strategies.deterministic_ddp import DeterministicDDPStrategy

    inner_original, outer_original = Strategy.training_step, DeterministicDDPStrategy.training_step
    inner_time = [0.0]

    def inner(self: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return inner_original(self, *args, **kwargs)
        finally:
            inner_time[0] += time.perf_counter() - start

    def outer(self: Any, *args: Any, **kwargs: Any) -> Any:
        inner_time[0] = 0.0
        start = time.perf_counter()
        try:
            return outer_original(self, *args, **kwargs)
        finally:
            own_times.append(time.perf_counter() - start - inner_time[0])

    Strategy.training_step = inner
    DeterministicDDPStrategy.training_step = outer


def _worker(args: argparse.Namespace) -> None:
    name = args.worker
    variant = VARIANTS[name]
    devices = args.gpus if variant.devices == 0 else variant.devices
    if variant.configure:
        from deepep_lightning.determinism import configure

        configure(0)  # before anything starts CUDA; NCCL variables stay as the variant set them
    import lightning.pytorch as pl
    import torch

    import deepep_lightning.strategies  # noqa: F401  (registers "ddp_deterministic")

    own_times: list[float] = []
    strategy: Any = variant.strategy
    if variant.strategy == "ddp_deterministic":
        import deepep_lightning.strategies.deterministic_ddp as deterministic_ddp
        from deepep_lightning.determinism.nccl_profile import NCCL_RECORDED_ENV

        if variant.no_nccl_profile:
            deterministic_ddp.apply_nccl_profile = lambda algorithm, protocol: (
                {key: os.environ.get(key, "<unset>") for key in NCCL_RECORDED_ENV},
                [],
            )
        if variant.manual_seed_reseed:
            from deepep_lightning.determinism import rng

            rng._only_cpu_and_cuda = lambda: False  # seed_everything_from then calls torch.manual_seed
        _instrument_strategy_training_step(own_times)
        if variant.strategy_kwargs:
            strategy = deterministic_ddp.DeterministicDDPStrategy(**variant.strategy_kwargs)

    class PhaseTimer(pl.Callback):
        """Host and CUDA-event time of a step and its phases; synchronises at batch start and end only."""

        def __init__(self) -> None:
            self.steps: list[dict[str, float]] = []
            self._host: dict[str, float] = {}
            self._events: dict[str, Any] = {}
            self._last_start: float | None = None

        def _mark(self, pl_module: pl.LightningModule, point: str) -> None:
            self._host[point] = time.perf_counter()
            if pl_module.device.type == "cuda":
                event = torch.cuda.Event(enable_timing=True)
                event.record()
                self._events[point] = event

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if pl_module.device.type == "cuda":
                torch.cuda.synchronize(pl_module.device)
            now = time.perf_counter()
            if self._last_start is not None and self.steps:
                self.steps[-1]["period_s"] = now - self._last_start
            self._last_start = now
            self._host, self._events = {}, {}
            self._mark(pl_module, "start")

        def on_before_backward(self, trainer, pl_module, loss):
            self._mark(pl_module, "before_backward")

        def on_after_backward(self, trainer, pl_module):
            self._mark(pl_module, "after_backward")

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self._mark(pl_module, "end")
            if pl_module.device.type == "cuda":
                torch.cuda.synchronize(pl_module.device)
            end = time.perf_counter()
            record = {"step_s": end - self._host["start"]}
            phases = (
                ("forward", "start", "before_backward"),
                ("backward", "before_backward", "after_backward"),
                ("optimizer", "after_backward", "end"),
            )
            for phase, first, last in phases:
                if first in self._host and last in self._host:
                    record[f"{phase}_host_s"] = self._host[last] - self._host[first]
                if first in self._events and last in self._events:
                    record[f"{phase}_gpu_s"] = self._events[first].elapsed_time(self._events[last]) / 1e3
            self.steps.append(record)

    pl.seed_everything(0, verbose=False)
    if args.cpu:
        torch.set_num_threads(1)  # two ranks on a small CPU box
    timer = PhaseTimer()
    accelerator = "cpu" if args.cpu else "gpu"
    out = os.path.join(args.out, name)
    model, trainer = build_workload(args, devices, accelerator, strategy, [timer], out)
    trainer.fit(model)
    active = trainer.strategy
    record = {
        "variant": name,
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "strategy": type(active).__name__,
        "strategy_kwargs": variant.strategy_kwargs,
        "ddp_kwargs": {k: repr(v) for k, v in getattr(active, "_ddp_kwargs", {}).items()},
        "process_group_backend": str(getattr(active, "_process_group_backend", None)),
        "no_nccl_profile_patch": variant.no_nccl_profile,
        "configure": variant.configure,
        "manual_seed_reseed_patch": variant.manual_seed_reseed,
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "torch_threads": torch.get_num_threads(),
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(_RECORDED_ENV_PREFIXES)},
        "fingerprint": active.fingerprint() if hasattr(active, "fingerprint") else {},
        "warmup": args.warmup,
        "steps": timer.steps,
        "strategy_own_host_s": own_times,
        "global_step": trainer.global_step,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() and not args.cpu else "cpu",
        "torch": str(torch.__version__),
        "lightning": pl.__version__,
    }
    with open(os.path.join(out, f"rank{trainer.global_rank}.json"), "w") as handle:
        json.dump(record, handle, indent=1)


# ------------------------------------------------------------------------------------------ driver
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _child_env(variant: Variant, devices: int) -> dict[str, str]:
    dropped = (
        "LOCAL_RANK",
        "RANK",
        "GROUP_RANK",
        "LOCAL_WORLD_SIZE",
        "WORLD_SIZE",
        "NODE_RANK",
        "MASTER_PORT",
        "MASTER_ADDR",
        "TORCHELASTIC_RUN_ID",
    ) + _CONTROLLED_ENV
    env = {k: v for k, v in os.environ.items() if k not in dropped and not k.startswith("SLURM_")}
    env.update(variant.env)
    env.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(_free_port()),
            "NODE_RANK": "0",
            "WORLD_SIZE": str(devices),
            "PYTHONPATH": os.pathsep.join(p for p in (_REPO, env.get("PYTHONPATH")) if p),
        }
    )
    return env


def _machine_state() -> dict[str, Any]:
    """Load and GPU state just before a launch: a busy host or a leftover GPU process shows up here."""
    state: dict[str, Any] = {"loadavg": list(os.getloadavg()), "cpus": len(os.sched_getaffinity(0))}
    queries = {
        "gpus": ["--query-gpu=index,clocks.sm,clocks.mem,temperature.gpu,power.draw,utilization.gpu,memory.used"],
        "gpu_processes": ["--query-compute-apps=gpu_uuid,pid,process_name,used_memory"],
    }
    for key, query in queries.items():
        try:
            done = subprocess.run(
                ["nvidia-smi", *query, "--format=csv,noheader"], capture_output=True, text=True, timeout=10
            )
            state[key] = done.stdout.strip().splitlines()
        except (OSError, subprocess.SubprocessError):
            pass
    return state


_RUNNING: list[subprocess.Popen] = []  # ranks of the variant in progress, for the SIGTERM handler


def _on_termination(signum: int, frame: Any) -> None:
    """``timeout`` (gpu_suite.sh) stops the driver: take the ranks down too (they run in their own sessions)."""
    _kill(_RUNNING)
    raise SystemExit(128 + signum)


def _kill(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _launch(args: argparse.Namespace, name: str, timeout_s: float) -> dict[str, Any]:
    """Start every rank of ``name`` side by side; wait, kill on timeout, read the rank files."""
    variant = VARIANTS[name]
    devices = args.gpus if variant.devices == 0 else variant.devices
    out = os.path.join(args.out, name)
    os.makedirs(out, exist_ok=True)
    for rank in range(devices):  # a stale file from an earlier run must not pass for this one
        for suffix in ("json", "log"):
            path = os.path.join(out, f"rank{rank}.{suffix}")
            if os.path.exists(path):
                os.remove(path)
    env = _child_env(variant, devices)
    command = [
        sys.executable,
        os.path.abspath(__file__),
        "--worker",
        name,
        "--out",
        args.out,
        "--gpus",
        str(args.gpus),
        *workload_flags(args),
    ]
    command += ["--cpu"] if args.cpu else []
    machine = _machine_state()
    started = time.perf_counter()
    procs, logs = [], []
    status = "ok"
    try:
        for rank in range(devices):
            log = open(os.path.join(out, f"rank{rank}.log"), "w")
            logs.append(log)
            procs.append(
                subprocess.Popen(
                    command,
                    env={**env, "LOCAL_RANK": str(rank)},
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
            _RUNNING[:] = procs
        deadline = started + timeout_s
        while any(proc.poll() is None for proc in procs):
            failed = [rank for rank, proc in enumerate(procs) if proc.poll() not in (None, 0)]
            if failed:  # the others would wait for it in a collective: give them a moment, then stop
                time.sleep(5)
                status = f"rank {failed[0]} exited {procs[failed[0]].returncode}"
                break
            if time.perf_counter() > deadline:
                status = f"timeout after {timeout_s:.0f} s (a rank hung?)"
                break
            time.sleep(0.2)
        codes = [proc.poll() for proc in procs]
        if status == "ok" and any(code != 0 for code in codes):
            status = f"exit codes {codes}"
    except Exception as error:  # noqa: BLE001 - a broken launch is recorded, the next variant runs
        status = f"launch failed: {error!r}"
    finally:
        _kill(procs)
        _RUNNING.clear()
        for log in logs:
            log.close()
    ranks = []
    for rank in range(devices):
        path = os.path.join(out, f"rank{rank}.json")
        try:
            ranks.append(json.load(open(path)) if os.path.exists(path) else None)
        except ValueError:
            ranks.append(None)
    if status == "ok" and None in ranks:
        status = "a rank wrote no result"
    duration = time.perf_counter() - started
    error_tail = ""
    if status != "ok":
        tails = []
        for rank in range(devices):
            path = os.path.join(out, f"rank{rank}.log")
            if os.path.exists(path):
                tails.append(f"--- rank {rank}\n" + open(path, errors="replace").read()[-1500:])
        error_tail = "\n".join(tails)
    return {
        "status": status,
        "duration_s": duration,
        "devices": devices,
        "ranks": ranks,
        "error_tail": error_tail,
        "machine_before": machine,
        "env_set": dict(variant.env),
        "env_removed": [k for k in _CONTROLLED_ENV if k in os.environ and k not in variant.env],
    }


def _summarise(name: str, run: dict[str, Any]) -> dict[str, Any]:
    variant = VARIANTS[name]
    summary: dict[str, Any] = {
        "what": variant.what,
        "status": run["status"],
        "duration_s": round(run["duration_s"], 1),
        "world_size": run["devices"],
        "strategy": variant.strategy,
        "strategy_kwargs": variant.strategy_kwargs,
        "no_nccl_profile_patch": variant.no_nccl_profile,
        "configure": variant.configure,
        "manual_seed_reseed_patch": variant.manual_seed_reseed,
        "env_set": run["env_set"],
        "env_removed_from_inherited": run["env_removed"],
        "machine_before": run["machine_before"],
    }
    if run["status"] != "ok":
        summary["error"] = run["error_tail"]
    ranks = [r for r in run["ranks"] if r]
    if not ranks:
        return summary
    first = ranks[0]
    summary["env_in_effect"] = first["env"]
    summary["ddp_kwargs"] = first["ddp_kwargs"]
    summary["deterministic_algorithms"] = first["deterministic_algorithms"]
    summary["torch_threads"] = first["torch_threads"]
    summary["gpu"], summary["torch"], summary["lightning"] = first["gpu"], first["torch"], first["lightning"]
    warmup = first["warmup"]
    timed = [r["steps"][warmup:] for r in ranks]
    count = min(len(t) for t in timed)
    summary["steps"] = count
    if count == 0:
        return summary

    def pace(key: str) -> list[float]:  # the slowest rank sets the pace of every step
        values = [max(t[i].get(key, 0.0) for t in timed) for i in range(count) if all(key in t[i] for t in timed)]
        return values

    step = pace("step_s")
    summary["median_step_s"] = statistics.median(step)
    summary["p10_step_s"], summary["p90_step_s"] = _percentile(step, 0.1), _percentile(step, 0.9)
    period = pace("period_s")
    summary["median_period_s"] = statistics.median(period) if period else None
    summary["per_rank_median_step_s"] = [statistics.median(s["step_s"] for s in t[:count]) for t in timed]
    phases: dict[str, Any] = {}
    for phase in ("forward", "backward", "optimizer"):
        for clock in ("host", "gpu"):
            key = f"{phase}_{clock}_s"
            per_rank = [[s[key] for s in t[:count] if key in s] for t in timed]
            if all(per_rank):
                phases[key] = [statistics.median(values) for values in per_rank]
    summary["phase_medians_per_rank_s"] = phases
    own = [r["strategy_own_host_s"][warmup:] for r in ranks if r["strategy_own_host_s"]]
    if own:
        summary["strategy_own_training_step_host_us"] = {
            "median_per_rank": [round(statistics.median(values) * 1e6, 1) for values in own if values],
            "max": round(max(max(values) for values in own if values) * 1e6, 1) if any(own) else None,
        }
    summary["fingerprint_rank0"] = first["fingerprint"]
    return summary


def _ratios(variants: dict[str, Any]) -> dict[str, Any]:
    ratios = {}
    for top, bottom, meaning in RATIOS:
        a, b = variants.get(top, {}).get("median_step_s"), variants.get(bottom, {}).get("median_step_s")
        if a and b:
            ratios[f"{top}/{bottom}"] = {"ratio": round(a / b, 3), "meaning": meaning}
    return ratios


def _table(variants: dict[str, Any]) -> str:
    header = (
        f"{'variant':<22}{'ws':>3}{'median':>9}{'p10':>8}{'p90':>8}{'period':>9}{'fwd':>8}{'bwd':>8}{'opt':>8}"
        f"{'own us':>8}  status"
    )
    lines = [header, "-" * len(header)]
    for name, s in variants.items():

        def fmt(value: Any, width: int) -> str:
            return f"{value:>{width}.4f}" if isinstance(value, float) else f"{'-':>{width}}"

        phases = s.get("phase_medians_per_rank_s", {})
        fwd, bwd, opt = (
            max(phases[f"{p}_host_s"]) if f"{p}_host_s" in phases else None
            for p in ("forward", "backward", "optimizer")
        )
        own = s.get("strategy_own_training_step_host_us", {}).get("median_per_rank")
        own_text = f"{max(own):>8.0f}" if own else f"{'-':>8}"
        lines.append(
            f"{name:<22}{s['world_size']:>3}{fmt(s.get('median_step_s'), 9)}{fmt(s.get('p10_step_s'), 8)}"
            f"{fmt(s.get('p90_step_s'), 8)}{fmt(s.get('median_period_s'), 9)}{fmt(fwd, 8)}{fmt(bwd, 8)}{fmt(opt, 8)}"
            f"{own_text}  {s['status']}"
        )
    return "\n".join(lines)


def main() -> None:
    args = _parser().parse_args()
    _resolve_sizes(args)
    if args.worker:
        _worker(args)
        return
    wanted = [name for name in args.variants.split(",") if name]
    unknown = [name for name in wanted if name not in VARIANTS]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; choose from {sorted(VARIANTS)}")
    os.makedirs(args.out, exist_ok=True)
    signal.signal(signal.SIGTERM, _on_termination)
    config = {k: v for k, v in vars(args).items() if k != "worker"}
    result: dict[str, Any] = {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "config": config,
        "variants": {},
        "ratios": {},
    }
    started = time.perf_counter()
    durations: dict[int, float] = {}
    for name in wanted:
        devices = args.gpus if VARIANTS[name].devices == 0 else VARIANTS[name].devices
        elapsed = time.perf_counter() - started
        expected = durations.get(devices, max(durations.values(), default=45.0))
        if elapsed + expected > args.budget_s:
            result["variants"][name] = {
                "what": VARIANTS[name].what,
                "status": f"skipped: budget ({elapsed:.0f} s elapsed,"
                f" ~{expected:.0f} s needed, --budget-s {args.budget_s:.0f})",
                "world_size": devices,
            }
            print(f"[ddp_ablation] {name}: skipped (budget)", flush=True)
            continue
        timeout = args.variant_timeout_s
        run = _launch(args, name, timeout)
        durations[devices] = max(durations.get(devices, 0.0), run["duration_s"])
        result["variants"][name] = _summarise(name, run)
        result["ratios"] = _ratios(result["variants"])
        result["elapsed_s"] = round(time.perf_counter() - started, 1)
        median = result["variants"][name].get("median_step_s")
        print(
            f"[ddp_ablation] {name}: {run['status']} in {run['duration_s']:.1f} s"
            + (f", median step {median:.4f} s" if median else ""),
            flush=True,
        )
        if run["status"] != "ok":
            print(run["error_tail"][-2000:], flush=True)
        with open(os.path.join(args.out, "ddp_ablation.json"), "w") as handle:
            json.dump(result, handle, indent=1)
    print(_table(result["variants"]))
    print(json.dumps(result["ratios"], indent=1))
    written = os.path.join(args.out, "ddp_ablation.json")
    print(f"[ddp_ablation] total {time.perf_counter() - started:.1f} s; wrote {written}")


if __name__ == "__main__":
    main()
