"""Where a zoo model's determinism tax goes: the plugin's settings switched on one at a time, in one process.

The zoo (``bench_zoo.py``) times plain and plugin runs in separate fresh processes, through Lightning. This takes
one model of the zoo, trains it in a plain loop (forward, backward, AdamW) and switches, round after round, between
settings that add up to what the plugin does, each measured on the same weights' trajectory so far::

    plain         deterministic algorithms off, no routes (PyTorch's atomic kernels)
    det           torch.use_deterministic_algorithms(True), NaN-fill off, cuDNN deterministic (PyTorch's own
                  deterministic kernels: sorted index_put_, ...)
    det_routes    det + the plugin's dispatcher routes (patch_refused_ops)
    det_routes_env det_routes + CUBLAS_WORKSPACE_CONFIG=:4096:8 exported in the process (read per cuBLAS call?)

Per setting: the median step time over the rounds (CUDA events around each step, the host waits at its end),
the median host time of a step (``perf_counter`` from the step's start to the return of its last launch, before
the wait), and a ``torch.profiler`` table of one step: self CPU time per event and the kernels' total. A setting
whose step time grows with its host time, with kernels equal, is host-bound: the launches, not the kernels, cost.

    python benchmarks/bench_tax_ablation.py --model mixtral_moe --out benchmarks/results/tax_ablation

A setting whose step raises PyTorch's deterministic-mode refusal (``det`` on a model with an op only the
routes make deterministic, e.g. LR-ASPP's ``nll_loss2d``) is recorded as ``{"refused": <the error's first line>}``
in the summary, and the other settings are measured. Writes ``DIR/<model>.json``. Runs on the CPU too
(``--device cpu``, for the test of the driver), where the
routes do not apply and the figures mean nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _timing import Stopwatch, environment, write_json  # noqa: E402
from zoo_models import select_models  # noqa: E402
from zoo_worker import profile_table  # noqa: E402

SETTINGS = ("plain", "det", "det_routes", "det_routes_env")
# what PyTorch's refusal under torch.use_deterministic_algorithms(True) says
DETERMINISTIC_REFUSAL = "does not have a deterministic implementation"


def apply_setting(name: str) -> None:
    """Switch the process to setting ``name`` (see the module docstring)."""
    from deepep_lightning.ops import patch_refused_ops

    if name not in SETTINGS:
        raise ValueError(f"apply_setting: name must be one of {SETTINGS}, got {name!r}")
    deterministic = name != "plain"
    torch.use_deterministic_algorithms(deterministic)
    torch.utils.deterministic.fill_uninitialized_memory = False  # type: ignore[attr-defined]
    torch.backends.cudnn.deterministic = deterministic
    torch.backends.cudnn.benchmark = False
    patch_refused_ops(name.startswith("det_routes"))
    if name == "det_routes_env":
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    else:
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)


def run(model_name: str, device: torch.device, rounds: int, steps: int, settings: tuple[str, ...]) -> dict[str, Any]:
    (spec,) = select_models([model_name])
    torch.manual_seed(0)
    task = spec.build(torch.Generator().manual_seed(0))
    model = task.model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batches = [move_data_to_device(batch, device) for batch in task.batches]
    autocast = spec.precision == "bf16-mixed"
    counter = 0

    def step() -> float:
        """One training step; returns the host milliseconds until its last launch returned."""
        nonlocal counter
        begin = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = task.loss(model, batches[counter % len(batches)])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        counter += 1
        return (time.perf_counter() - begin) * 1e3

    refused: dict[str, str] = {}  # settings whose step raises (det: an op plain deterministic mode refuses)
    for name in settings:  # warm-up: every setting's kernels and routes built and cached
        apply_setting(name)
        try:
            for _ in range(3):
                step()
        except RuntimeError as error:
            if DETERMINISTIC_REFUSAL not in str(error):
                raise
            refused[name] = str(error).splitlines()[0][:200]
            optimizer.zero_grad(set_to_none=True)
    settings = tuple(name for name in settings if name not in refused)
    if not settings:
        raise RuntimeError(f"every setting refused the model's step: {refused}")
    results: dict[str, Any] = {name: {"step_ms": [], "host_ms": []} for name in settings}
    for _ in range(rounds):
        for name in settings:
            apply_setting(name)
            step()  # the first step after a switch is not timed
            for _ in range(steps):
                watch = Stopwatch(device)
                watch.start()
                host = step()
                results[name]["step_ms"].append(watch.stop())
                results[name]["host_ms"].append(host)
    cuda = device.type == "cuda"
    for name in settings:
        apply_setting(name)
        step()
        activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        if cuda:
            torch.cuda.synchronize(device)
        with torch.profiler.profile(activities=activities) as profiler:
            step()
            if cuda:
                torch.cuda.synchronize(device)
        table = profile_table(profiler, 1, cuda, top=15)
        record = results[name]
        record["median_step_ms"] = statistics.median(record["step_ms"])
        record["median_host_ms"] = statistics.median(record["host_ms"])
        record["kernels_total_ms"] = round(sum(row["ms"] for row in table["kernels"]), 4)
        record["host"] = [{**row, "ms": round(row["ms"], 4)} for row in table["host"]]
        record["kernels"] = [{**row, "ms": round(row["ms"], 4)} for row in table["kernels"][:8]]
    apply_setting("plain")
    base = results[settings[0]]["median_step_ms"]
    summary = {
        name: {
            "median_step_ms": round(results[name]["median_step_ms"], 4),
            "median_host_ms": round(results[name]["median_host_ms"], 4),
            "kernels_total_ms": results[name]["kernels_total_ms"],
            "ratio": round(results[name]["median_step_ms"] / base, 4),
        }
        for name in settings
    }
    summary.update({name: {"refused": message} for name, message in refused.items()})
    return {"model": model_name, "precision": spec.precision, "summary": summary, "settings": results}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a zoo model's name (benchmarks/zoo_models.py)")
    parser.add_argument("--out", required=True, help="folder of <model>.json")
    parser.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    parser.add_argument("--rounds", type=int, default=4, help="rounds over the settings")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per setting and round")
    parser.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated, from {SETTINGS}")
    args = parser.parse_args(argv)
    settings = tuple(name for name in args.settings.split(",") if name)
    unknown = [name for name in settings if name not in SETTINGS]
    if unknown or not settings:
        parser.error(f"--settings: {unknown or settings!r} not in {SETTINGS}")
    for name in ("rounds", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)!r}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    result = run(args.model, torch.device(args.device), args.rounds, args.steps, settings)
    result["environment"] = environment()
    result["command"] = " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / f"{args.model}.json", result)
    for name, row in result["summary"].items():
        print(f"{args.model} {name:15s} {row}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
