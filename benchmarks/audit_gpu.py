"""deepep-audit on the GPU: the L1 catalogue table, DeepEP L2/L3 per value head, and the locator's cost.

    PYTHONPATH=$PWD python benchmarks/audit_gpu.py --out benchmarks/results/audit

Writes ``OUT/audit_catalogue_h200.json`` and ``.md`` (each catalogue op 100× on fixed random inputs,
8M float32 values into 1000 bins for the scatter family, in four columns: default, deterministic mode,
deterministic mode with the plugin's routing, ``CUDA_LAUNCH_BLOCKING=1``), and ``OUT/audit_deepep.json``:
DeepEP L2 (one timestep) and L3 (a rollout of T steps, forward+backward) with the reference value head, the
extension's deterministic op and its atomic variant (with the first divergent op when found),
and the op-hash locator's slowdown on DeepEP L3 (median of repeats after warm-up, side by side
in one process). The extension's first JIT build adds to the run unless ``TORCH_EXTENSIONS_DIR`` holds it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _timing import sample_ms  # noqa: E402

from deepep_lightning.audit.level1 import audit_catalogue, format_catalogue_table  # noqa: E402
from deepep_lightning.audit.level2_3 import audit_module  # noqa: E402
from deepep_lightning.audit.op_hashes import OpHashMode  # noqa: E402
from deepep_lightning.audit.report import environment_summary  # noqa: E402
from deepep_lightning.audit.targets import ModuleTarget  # noqa: E402

DEEPEP = {"env": {"num_envs": 256, "rollout_length": 64}, "network": {"hidden_size": 256}}


def _timed(fn, repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` calls (the caller warms up)."""
    return [ms / 1e3 for ms in sample_ms(fn, repeats, warmup=0, device="cuda")]


def locator_overhead(repeats: int) -> dict:
    """DeepEP L3 (one rollout fwd+bwd) plain vs under OpHashMode (hash only, and keeping outputs)."""
    prepared = ModuleTarget(config=DEEPEP, device="cuda", variant="reference").prepare("L3")

    def plain():
        prepared.run(prepared.fresh_module())

    def hashed(keep_bytes: int):
        def run():
            module = prepared.fresh_module()
            with OpHashMode(module, keep_bytes=keep_bytes) as log:
                prepared.run(module)
            run.ops = len(log.records)

        return run

    plain()  # warm-up (allocator, cuBLAS handles)
    hash_only, keeping = hashed(0), hashed(256 * 2**20)
    hash_only()
    rows = {
        "plain": _timed(plain, repeats),
        "hash_only": _timed(hash_only, repeats),
        "hash_and_keep_256MiB": _timed(keeping, repeats),
    }
    medians = {k: statistics.median(v) for k, v in rows.items()}
    return {
        "config": DEEPEP,
        "repeats": repeats,
        "ops_logged_per_run": getattr(hash_only, "ops", None),
        "seconds": rows,
        "median_seconds": medians,
        "slowdown_hash_only": medians["hash_only"] / medians["plain"],
        "slowdown_hash_and_keep": medians["hash_and_keep_256MiB"] / medians["plain"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--repeats", type=int, default=100, help="L1 calls per op and column")
    parser.add_argument("--level-repeats", type=int, default=5, help="DeepEP L2/L3 repeats")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    started = time.perf_counter()
    command = " ".join([os.path.basename(sys.executable)] + sys.argv)

    import deepep_lightning.deepep.kernels  # noqa: F401  (adds DeepEP's value head to the catalogue)

    table = audit_catalogue(device="cuda", repeats=args.repeats)
    table.update({"environment": environment_summary(), "command": command, "seconds": time.perf_counter() - started})
    with open(os.path.join(args.out, "audit_catalogue_h200.json"), "w") as handle:
        json.dump(table, handle, indent=2, default=str)
    markdown = format_catalogue_table(table)
    with open(os.path.join(args.out, "audit_catalogue_h200.md"), "w") as handle:
        handle.write(markdown + "\n\n`" + command + "`\n")
    print(markdown, flush=True)

    deepep: dict = {"environment": environment_summary(), "command": command, "config": DEEPEP, "audits": []}
    for value_head in ("reference", "fused", "fused_atomic"):
        for level in ("L2", "L3"):
            target = ModuleTarget(config=DEEPEP, device="cuda", variant=value_head)
            result = audit_module(level, target, repeats=args.level_repeats)
            deepep["audits"].append({"value_head": value_head, **result.to_dict()})
            print(result.describe(), flush=True)
    try:
        deepep["locator_overhead"] = locator_overhead(repeats=3)
    except Exception as error:  # keep what was measured
        deepep["locator_overhead"] = {"error": f"{type(error).__name__}: {error}"}
    print(json.dumps(deepep["locator_overhead"].get("median_seconds", deepep["locator_overhead"]), indent=2))
    deepep["seconds"] = time.perf_counter() - started
    with open(os.path.join(args.out, "audit_deepep.json"), "w") as handle:
        json.dump(deepep, handle, indent=2, default=str)
    print(f"wrote {args.out} in {deepep['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
