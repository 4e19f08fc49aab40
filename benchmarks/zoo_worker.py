"""One zoo run in a fresh process: ``seed_everything``, build the model, ``Trainer.fit`` a few AdamW steps, report.

Modes: ``plugin`` (``callbacks=[DeterminismCallback()]``), ``plain`` (Lightning's defaults, no determinism) and
``trainer_deterministic`` (``Trainer(deterministic=True)``, no plugin). The report (JSON at ``--out``) holds:
the time of every step (``on_train_batch_start`` to ``on_train_batch_end``, CUDA events synchronised at the
end on a GPU, wall time on the CPU) and the median of the timed ones; every loss as ``float.hex``; a SHA-256
digest of the final ``state_dict`` (name, dtype, shape and bytes of every tensor in order) and one per tensor;
optionally a ``torch.profiler`` table of the last ``--profile-steps`` steps, which are not timed: kernels by
device time on a GPU, and aten ops by device time (inclusive) on a GPU or self CPU time on the CPU. An
exception in build or fit is reported (type, message, last frames) and the process exits 0; the driver
tells it from a crash by the report. With ``--hold`` the process imports and builds the model (on the CPU, at
the lowest priority and on one thread, so that it does not slow the timed run beside it), then waits for a line
on stdin before the ``Trainer`` touches the device: the driver starts the next timing run while the current
one runs.

    python benchmarks/zoo_worker.py --model resnet18 --mode plugin --out /tmp/run.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import time
import traceback
from typing import Any

MODES = ("plugin", "plain", "trainer_deterministic")
_NAME_CHARS = 160  # kernel names are long C++ templates


def tensor_digests(state: dict[str, Any]) -> tuple[str, dict[str, str]]:
    """SHA-256 of the whole ``state`` (every tensor's name, dtype, shape and bytes, in order) and one per tensor."""
    import torch

    whole, per_tensor = hashlib.sha256(), {}
    for name, value in state.items():
        if not isinstance(value, torch.Tensor):
            continue
        flat = value.detach().cpu().contiguous().reshape(-1)
        data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
        header = f"{name}|{value.dtype}|{tuple(value.shape)}|".encode()
        per_tensor[name] = hashlib.sha256(header + data).hexdigest()[:16]
        whole.update(header + data)
    return whole.hexdigest(), per_tensor


def profile_table(profiler: Any, steps: int, cuda: bool, top: int = 40) -> dict[str, list[dict[str, Any]]]:
    """Top kernels (GPU), ops and host events of a finished ``torch.profiler.profile``, in milliseconds per step.

    ``ops``: aten ops by device time (inclusive) on a GPU, by self CPU time on the CPU. ``host``: every profiled
    event (aten op, launch call, optimizer step) by self CPU time: where a host-bound step's time goes (a Python
    route's work shows as the self time of the aten op it serves). Kernel times are summed from the kernels the
    profiler links to their launches (each kernel once, by name, from its own time range), not from
    ``key_averages``' device rows, which count 0 for events it takes as asynchronous.
    """
    kernels: dict[str, list[float]] = {}
    ops: list[dict[str, Any]] = []
    host: list[dict[str, Any]] = []
    if cuda:
        for event in profiler.events():
            for kernel in event.kernels:
                row = kernels.setdefault(kernel.name[:_NAME_CHARS], [0.0, 0.0])
                row[0] += kernel.duration / 1e3 / steps
                row[1] += 1 / steps
    for event in profiler.key_averages():
        calls = event.count / steps
        if event.self_cpu_time_total > 0:
            ms = event.self_cpu_time_total / 1e3 / steps
            host.append({"name": event.key[:_NAME_CHARS], "ms": ms, "calls": calls})
        if cuda:
            if event.key.startswith("aten::") and event.device_time_total > 0:
                ops.append({"name": event.key, "ms": event.device_time_total / 1e3 / steps, "calls": calls})
        elif event.key.startswith("aten::") and event.self_cpu_time_total > 0:
            ops.append({"name": event.key, "ms": event.self_cpu_time_total / 1e3 / steps, "calls": calls})
    kernel_rows = [{"name": name, "ms": ms, "calls": calls} for name, (ms, calls) in kernels.items()]
    order = lambda rows: sorted(rows, key=lambda row: -row["ms"])[:top]  # noqa: E731
    return {"kernels": order(kernel_rows), "ops": order(ops), "host": order(host)}


def _error(error: BaseException) -> dict[str, Any]:
    frames = traceback.extract_tb(error.__traceback__)[-6:]
    return {
        "type": type(error).__name__,
        "message": str(error)[:2000],
        "frames": [f"{frame.filename}:{frame.lineno} in {frame.name}" for frame in frames],
    }


def run(args: argparse.Namespace, report: dict[str, Any]) -> None:
    """Fills ``report`` as the run goes, so a failure still reports the steps that ran."""
    import lightning.pytorch as pl
    import torch
    from _timing import Stopwatch
    from lightning.pytorch.callbacks import Callback
    from zoo_models import select_models

    (spec,) = select_models([args.model])
    timed_end = args.warmup + args.steps
    total_steps = timed_end + args.profile_steps
    report["precision"] = spec.precision

    class ZooModule(pl.LightningModule):
        def __init__(self, task: Any) -> None:
            super().__init__()
            self.model, self.task, self.losses = task.model, task, []

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            # Named ranges for the host rows: Lightning runs the forward and backward inside the optimizer's
            # step (the closure), whose self time would otherwise hold the host's wait for the backward.
            with torch.profiler.record_function("zoo::forward"):
                loss = self.task.loss(self.model, batch)
            self.losses.append(loss.detach())
            return loss

        def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
            with torch.profiler.record_function("zoo::backward"):
                super().backward(loss, *args, **kwargs)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    class Batches(torch.utils.data.Dataset):
        def __init__(self, pool: list[Any]) -> None:
            self.pool = pool

        def __len__(self) -> int:
            return total_steps

        def __getitem__(self, index: int) -> Any:
            return self.pool[index % len(self.pool)]

    class StepClock(Callback):
        """Times every step; profiles the steps from ``timed_end`` on."""

        def __init__(self) -> None:
            self.step_ms: list[float] = []
            self.iteration_ms: list[float] = []  # from one step's end to the next's: with the loader's fetch
            self.last_end: float | None = None
            self.profiler: Any = None

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx == timed_end and args.profile_steps and not args.skip_profiler:
                activities = [torch.profiler.ProfilerActivity.CPU]
                if pl_module.device.type == "cuda":
                    torch.cuda.synchronize()
                    activities.append(torch.profiler.ProfilerActivity.CUDA)
                self.profiler = torch.profiler.profile(activities=activities)
                self.profiler.__enter__()
            if batch_idx == args.warmup:  # what the timed steps run under (the callback may release it at start)
                report["cublas_workspace_config"] = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
            self.watch = Stopwatch(pl_module.device)
            self.watch.start()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.step_ms.append(self.watch.stop())  # waits for the step's kernels
            now = time.perf_counter()
            if self.last_end is not None:
                self.iteration_ms.append((now - self.last_end) * 1e3)
            self.last_end = now
            if self.profiler is not None and batch_idx == total_steps - 1:
                if pl_module.device.type == "cuda":
                    torch.cuda.synchronize()
                self.profiler.__exit__(None, None, None)

    started = time.perf_counter()
    threads = torch.get_num_threads()
    if args.hold:  # built beside a timed run: one thread (the CPU fills are serial, so the weights are the same)
        torch.set_num_threads(1)
    pl.seed_everything(args.seed, workers=True)
    task = spec.build(torch.Generator().manual_seed(args.seed))
    module = ZooModule(task)
    clock = StepClock()
    callbacks: list[Any] = [clock]
    trainer_kwargs: dict[str, Any] = {}
    if args.mode == "plugin":
        from deepep_lightning import DeterminismCallback

        callbacks.insert(0, DeterminismCallback())
    elif args.mode == "trainer_deterministic":
        trainer_kwargs["deterministic"] = True
    report["build_s"] = round(time.perf_counter() - started, 3)
    if args.hold:  # started early by the driver: wait for its go (a line on stdin) before touching the device
        sys.stdin.readline()
        torch.set_num_threads(threads)
        try:  # back from the low priority the start-up ran at (root may raise it; others keep running niced)
            os.setpriority(os.PRIO_PROCESS, 0, 0)
        except PermissionError:
            pass
        started = time.perf_counter()
    trainer = pl.Trainer(
        accelerator=args.device,
        devices=1,
        precision=spec.precision,
        max_steps=total_steps,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **trainer_kwargs,
    )
    loader = torch.utils.data.DataLoader(Batches(task.batches), batch_size=None, shuffle=False)
    # the device the steps run on (after fit, Lightning's teardown has moved the module back to the CPU)
    device = trainer.strategy.root_device
    try:
        trainer.fit(module, loader)
    finally:
        report["steps_run"] = len(clock.step_ms)
        report["step_ms"] = [round(value, 4) for value in clock.step_ms]
        report["iteration_ms"] = [round(value, 4) for value in clock.iteration_ms]
        report["losses"] = [float(loss.float().item()).hex() for loss in module.losses]
    report["median_ms"] = statistics.median(clock.step_ms[args.warmup : timed_end])
    report["digest"], report["tensor_digests"] = tensor_digests(module.model.state_dict())
    if clock.profiler is not None:
        report["profile"] = profile_table(clock.profiler, args.profile_steps, device.type == "cuda")
    report["fit_s"] = round(time.perf_counter() - started, 3)
    report["device_name"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--mode", required=True, choices=MODES)
    parser.add_argument("--out", required=True, help="the report's JSON path")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps before the timed ones")
    parser.add_argument("--steps", type=int, default=20, help="timed steps (their median is the step time)")
    parser.add_argument("--profile-steps", type=int, default=0, help="profiled steps after the timed ones")
    parser.add_argument(
        "--skip-profiler",
        action="store_true",
        help="run the --profile-steps steps without the profiler (the same steps as a profiled run: they compare)",
    )
    parser.add_argument(
        "--hold", action="store_true", help="after the imports and the model's build, wait for a line on stdin"
    )
    args = parser.parse_args(argv)
    for name in ("warmup", "profile_steps"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)!r}")
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps!r}")
    if args.hold:  # the imports and the build run beside a timed run: yield the CPU to it
        os.nice(19)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    report: dict[str, Any] = {"model": args.model, "mode": args.mode, "pid": os.getpid()}
    try:
        run(args, report)
    except BaseException as error:  # noqa: BLE001 - every failure of the model is a result
        report["error"] = _error(error)
    with open(args.out, "w") as handle:
        json.dump(report, handle)
    return 0


if __name__ == "__main__":
    sys.exit(main())
