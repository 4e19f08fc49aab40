"""Which ops run under deterministic mode and still differ? A sweep that measures instead of trusting errors.

PyTorch's deterministic mode relies on hand-placed checks: a kernel without one (cuDNN's grid sampler
backward) runs silently and gives different bits on every call. This sweep runs every case of
:mod:`silent_op_cases` (OpInfo, ModuleInfo, large scatters, cuDNN, SDPA, ``torch.compile``) three times
from identical inputs and RNG state and compares outputs and gradients bitwise (:mod:`bitwise_repeat`),
in two modes, each in its own worker processes:

* ``pytorch``: ``torch.use_deterministic_algorithms(True)`` alone (what ``Trainer(deterministic=True)``
  gives, with ``CUBLAS_WORKSPACE_CONFIG=:4096:8``);
* ``plugin``: the same plus the plugin's dispatcher routes (``patch_refused_ops(True)``, on in
  ``DeterminismCallback``).

Writes ``OUT/silent_ops_<mode>_<shard>.json`` as it goes (a worker stopped at its budget keeps what it
measured) and ``OUT/silent_ops.json``: per mode the count of each verdict (``bitwise``, ``differs``,
``raises``, ``error``, ``skipped``), every ``differs`` case with its first differing tensor (``silent``: the
names, the planted negative control aside), and the cases the plugin fixes. Exit code 1 when a case runs and
differs in the plugin mode (the target is none), 2 when the planted control came out equal (the sweep could
not have seen a difference), 0 otherwise::

    PYTHONPATH=$PWD python benchmarks/sweep_silent_ops.py --out benchmarks/results/silent_ops --device cuda

``--device cpu --sources paths,planted`` is the CPU smoke run of the driver (the planted shuffled sum must
differ). ``--resummarise`` rebuilds ``silent_ops.json`` from the workers' files in ``--out`` without running.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts, in both modes

import torch  # noqa: E402
from bitwise_repeat import run_case  # noqa: E402
from silent_op_cases import FLOATING, module_cases, opinfo_cases, path_cases, planted_cases  # noqa: E402

SOURCES = ("opinfo", "module", "paths", "planted")
PLANTED_CONTROL = "planted/shuffled_sum"  # must come out "differs", or the sweep cannot see a difference
MODES = ("pytorch", "plugin")
_DTYPES = {str(d)[6:]: d for d in FLOATING}


def _cases(args: argparse.Namespace):
    dtypes = [_DTYPES[name] for name in args.dtypes]
    only = [name for name in args.only.split(",") if name] if args.only else []
    for source in args.sources:
        if source == "opinfo":
            cases = opinfo_cases(args.device, dtypes, args.max_samples, only)
        elif source == "module":
            cases = module_cases(args.device, dtypes, args.max_samples, only)
        else:
            cases = path_cases(args.device) if source == "paths" else planted_cases(args.device)
        # --only names an op, a module, or a family of path cases ("cudnn", "sdpa/flash", "planted")
        yield from (case for case in cases if not only or any(case.name.startswith(name) for name in only))


def _write_json(path: Path, payload: dict) -> None:
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(payload, indent=1))
    os.replace(temporary, path)


def worker(args: argparse.Namespace) -> None:
    """Run this worker's share of the cases (every ``shards``-th, from ``shard``) in one mode."""
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    if args.mode == "plugin":
        from deepep_lightning.ops import patch_refused_ops

        patch_refused_ops(True)
    path = Path(args.out) / f"silent_ops_{args.mode}_{args.shard}.json"
    verdicts: list[dict] = []
    started, reached, total = time.monotonic(), 0, 0
    for index, case in enumerate(_cases(args)):
        if index % args.shards != args.shard:
            continue
        total += 1
        if time.monotonic() - started > args.budget_s:
            continue  # counted, not run: the report says how many the budget left out
        verdicts.append(run_case(case, repeats=args.repeats).to_dict())
        reached += 1
        if reached % 25 == 0:
            _write_json(path, {"mode": args.mode, "shard": args.shard, "done": False, "verdicts": verdicts})
    _write_json(
        path,
        {
            "mode": args.mode,
            "shard": args.shard,
            "done": True,
            "cases": total,
            "not_reached": total - reached,
            "seconds": round(time.monotonic() - started, 1),
            "verdicts": verdicts,
        },
    )


def _worker_command(args: argparse.Namespace, mode: str, shard: int) -> list[str]:
    return [
        sys.executable,
        __file__,
        "--worker",
        "--mode",
        mode,
        "--shard",
        str(shard),
        "--shards",
        str(args.shards),
        "--out",
        args.out,
        "--device",
        args.device,
        "--sources",
        ",".join(args.sources),
        "--dtypes",
        ",".join(args.dtypes),
        "--max-samples",
        str(args.max_samples),
        "--repeats",
        str(args.repeats),
        "--budget-s",
        str(args.budget_s),
        "--only",
        args.only,
    ]


def summarise(out: Path, modes: list[str]) -> dict:
    """Merge the workers' files into one report (also used on a partial set of files)."""
    report: dict = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
        "modes": {},
    }
    verdict_of: dict[str, dict[str, str]] = {}
    for mode in modes:
        files = sorted(out.glob(f"silent_ops_{mode}_*.json"))
        shards = [json.loads(f.read_text()) for f in files]
        verdicts = [v for shard in shards for v in shard["verdicts"]]
        verdict_of[mode] = {v["name"]: v["verdict"] for v in verdicts}
        report["modes"][mode] = {
            "counts": dict(Counter(v["verdict"] for v in verdicts)),
            "by_path": {
                path: dict(Counter(v["verdict"] for v in verdicts if v["path"] == path))
                for path in sorted({v["path"] for v in verdicts})
            },
            "not_reached": sum(shard.get("not_reached", 0) for shard in shards),
            "all_workers_done": bool(shards) and all(shard.get("done") for shard in shards),
            "differs": [v for v in verdicts if v["verdict"] == "differs"],
            # what runs and differs, the planted negative control aside: the target is none with the plugin
            "silent": sorted(v["name"] for v in verdicts if v["verdict"] == "differs" and v["path"] != "planted"),
            "raises": sorted(v["name"] for v in verdicts if v["verdict"] == "raises"),
        }
        planted = {v["name"]: v["verdict"] for v in verdicts if v["path"] == "planted"}
        if planted:
            report["modes"][mode]["planted_control_detected"] = planted.get(PLANTED_CONTROL) == "differs"
    if set(modes) == set(MODES):
        pytorch, plugin = verdict_of["pytorch"], verdict_of["plugin"]
        report["plugin_fixes"] = sorted(
            name
            for name, verdict in pytorch.items()
            if verdict in ("differs", "raises") and plugin.get(name) == "bitwise"
        )
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory for the JSON files")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--sources", default="opinfo,module,paths,planted", help=f"comma list of {SOURCES}")
    parser.add_argument("--modes", default="pytorch,plugin", help=f"comma list of {MODES}")
    parser.add_argument("--dtypes", default=",".join(_DTYPES), help=f"comma list of {list(_DTYPES)}")
    parser.add_argument("--max-samples", type=int, default=3, help="sample inputs per (op, dtype)")
    parser.add_argument("--repeats", type=int, default=3, help="runs compared per case (>= 2)")
    parser.add_argument("--shards", type=int, default=4, help="worker processes per mode")
    parser.add_argument("--budget-s", type=float, default=420.0, help="each worker starts no case after this")
    parser.add_argument("--only", default="", help="comma list of name prefixes: ops, modules, path families")
    parser.add_argument("--resummarise", action="store_true", help="rebuild silent_ops.json from --out's files")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="plugin", help=argparse.SUPPRESS)
    parser.add_argument("--shard", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.sources = [s for s in args.sources.split(",") if s]
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    modes = [m for m in args.modes.split(",") if m]
    for flag, values, allowed in (("--sources", args.sources, SOURCES), ("--modes", modes, MODES)):
        if not values or any(v not in allowed for v in values):
            parser.error(f"{flag} must be a comma list of {allowed}, got {values!r}")
    if any(d not in _DTYPES for d in args.dtypes):
        parser.error(f"--dtypes must be a comma list of {list(_DTYPES)}, got {args.dtypes!r}")
    if args.repeats < 2 or args.shards < 1 or args.max_samples < 1:
        parser.error("--repeats must be >= 2, --shards and --max-samples >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here (use --device cpu for the smoke run)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.worker:
        worker(args)
        return 0
    if args.resummarise:
        previous = json.loads((out / "silent_ops.json").read_text()) if (out / "silent_ops.json").exists() else {}
        report = summarise(out, modes)
        # the machine the workers ran on, not the one summarising
        report.update({key: previous[key] for key in ("torch", "device", "worker_exit_codes") if key in previous})
        _write_json(out / "silent_ops.json", report)
        return exit_status(report)
    for stale in out.glob("silent_ops_*_*.json"):
        stale.unlink()
    processes = [
        subprocess.Popen(_worker_command(args, mode, shard), cwd=Path(__file__).parent)
        for mode in modes
        for shard in range(args.shards)
    ]
    codes = [process.wait() for process in processes]
    report = summarise(out, modes)
    report["worker_exit_codes"] = codes
    _write_json(out / "silent_ops.json", report)
    for mode, summary in report["modes"].items():
        print(f"{mode}: {summary['counts']} (not reached: {summary['not_reached']})")
        for case in summary["differs"]:
            print(f"  differs: {case['name']}: {case['detail']}")
    if "plugin_fixes" in report:
        print(f"fixed by the plugin: {len(report['plugin_fixes'])}")
    return exit_status(report)


def exit_status(report: dict) -> int:
    """2: a planted control came out equal (the sweep cannot see differences); 1: a case runs and differs
    with the plugin on; 0: neither."""
    modes = report["modes"].values()
    if any(mode.get("planted_control_detected") is False for mode in modes):
        return 2
    plugin = report["modes"].get("plugin")
    return 1 if plugin is not None and plugin["silent"] else 0


if __name__ == "__main__":
    sys.exit(main())
