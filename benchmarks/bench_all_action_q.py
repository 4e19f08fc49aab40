"""Benchmark the fused all-action value head against its PyTorch reference (forward + backward).

Side by side in one process, for N in {16384, 65536, 262144}, A in {2, 8, 18}, H in {128, 256}
(float32): the eager reference, the ``torch.compile``d reference, the fused kernel with the
deterministic backward and with the atomic backward. Each case: median wall time of forward +
backward (``torch.autograd.grad`` w.r.t. all four inputs) over CUDA-event-timed repetitions after
warm-up, and the peak memory allocated above the inputs. For the fused kernels, the achieved
bandwidth over the compulsory traffic (read z twice, grad_q once; write q, dz) against the copy
rate measured in the same process. Writes ``DIR/all_action_q.json``::

    PYTHONPATH=$PWD python benchmarks/bench_all_action_q.py --out benchmarks/results/all_action_q

torch.compile choice (it must fit in < 3 minutes with the compile warm-up): by default
(``--compiled target``) the reference is compiled once with ``dynamic=False`` and measured only at
the target shape N=65536, A=8, H=256, where BENCHMARKS.md sets its targets; recompiling all 18 shapes
statically takes minutes. ``--compiled dynamic`` compiles once with ``dynamic=True`` and measures
every shape with that one graph (shape-generic kernels, usually a bit slower than static ones);
``--compiled none`` skips it. ``--device cpu --quick`` is a smoke run of this script without a GPU.
"""

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from _timing import elapsed_ms, sample_ms

from deepep_lightning.deepep.kernels import all_action_q, all_action_q_reference
from deepep_lightning.ops import cuda_kernels_available, extension_available, extension_error

SIZES_N, SIZES_A, SIZES_H = (16384, 65536, 262144), (2, 8, 18), (128, 256)
TARGET = (65536, 8, 256)
QUICK_SHAPES = [(256, 2, 16), (512, 8, 32)]
METHODS = ("eager_reference", "compiled_reference", "fused_deterministic", "fused_atomic")


def make_inputs(n, a, h, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    host = [
        torch.randn(n, h, generator=gen),
        torch.randn(a, h, generator=gen),
        torch.randn(h, generator=gen) / h**0.5,
        torch.randn(1, generator=gen),
    ]
    leaves = [t.to(device).requires_grad_() for t in host]
    return leaves, torch.randn(n, a, generator=gen).to(device)


def fwd_bwd(fn, leaves, grad_q):
    q = fn(*leaves)
    return (q, *torch.autograd.grad(q, leaves, grad_q))


def measure(step, device, warmup, max_seconds, min_reps=5, max_reps=50):
    """Milliseconds of repeated calls after warm-up: as many as fit in ``max_seconds``, within the bounds."""
    for _ in range(warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    times = [elapsed_ms(step, device)]
    reps = int(min(max_reps, max(min_reps, max_seconds * 1e3 / max(times[0], 1e-3))))
    times += sample_ms(step, reps - 1, warmup=0, device=device) if reps > 1 else []
    return times


def peak_extra_bytes(step, device):
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def copy_bandwidth_bytes_per_s(device):
    numel = 2**28 if device.type == "cuda" else 2**22  # 1 GiB of float32 on the GPU
    src, dst = torch.randn(numel, device=device), torch.empty(numel, device=device)
    median = statistics.median(measure(lambda: dst.copy_(src), device, warmup=3, max_seconds=0.5))
    return 2 * numel * 4 / (median * 1e-3)  # read + write


def build_methods(args, shape):
    methods = {
        "eager_reference": all_action_q_reference,
        "fused_deterministic": lambda *x: all_action_q(*x, deterministic=True),
        "fused_atomic": lambda *x: all_action_q(*x, deterministic=False),
    }
    if args.compiled == "dynamic" or (args.compiled == "target" and shape == args.target):
        methods["compiled_reference"] = args.compiled_fn
    return methods


def bench_shape(args, shape, copy_rate):
    n, a, h = shape
    leaves, grad_q = make_inputs(n, a, h, args.device)
    rows = []
    reference = None
    for name, fn in build_methods(args, shape).items():
        step = lambda fn=fn: fwd_bwd(fn, leaves, grad_q)  # noqa: E731
        outputs = [t.detach() for t in step()]
        if name == "eager_reference":
            reference = outputs
        rel_err = max(((x - y).abs().max() / y.abs().max()).item() for x, y in zip(outputs, reference))
        del outputs
        times = measure(step, args.device, warmup=args.warmup, max_seconds=args.max_seconds)
        row = {
            "N": n,
            "A": a,
            "H": h,
            "method": name,
            "median_ms": statistics.median(times),
            "min_ms": min(times),
            "reps": len(times),
            "peak_extra_bytes": peak_extra_bytes(step, args.device),
            "max_rel_err_vs_eager": rel_err,
        }
        if name.startswith("fused"):
            compulsory = 4 * (3 * n * h + 2 * n * a)  # fwd: z, q; bwd: grad_q, z, dz (float32)
            row["bandwidth_bytes_per_s"] = compulsory / (row["median_ms"] * 1e-3)
            row["fraction_of_copy_rate"] = row["bandwidth_bytes_per_s"] / copy_rate
            row["tanh_per_s"] = 2 * n * a * h / (row["median_ms"] * 1e-3)  # fwd + recomputed in bwd
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def summarise_target(rows, target):
    by_method = {r["method"]: r for r in rows if (r["N"], r["A"], r["H"]) == target}
    if "fused_deterministic" not in by_method:
        return {}
    det = by_method["fused_deterministic"]
    summary = {"shape": {"N": target[0], "A": target[1], "H": target[2]}}
    eager, compiled, atomic = (by_method.get(m) for m in ("eager_reference", "compiled_reference", "fused_atomic"))
    summary["speedup_vs_eager"] = eager["median_ms"] / det["median_ms"]
    summary["pass_speedup_vs_eager_ge_3"] = summary["speedup_vs_eager"] >= 3
    if compiled is not None:
        summary["speedup_vs_compiled"] = compiled["median_ms"] / det["median_ms"]
        summary["pass_speedup_vs_compiled_ge_1_5"] = summary["speedup_vs_compiled"] >= 1.5
    if det["peak_extra_bytes"] is not None:
        summary["peak_memory_ratio_vs_eager"] = det["peak_extra_bytes"] / eager["peak_extra_bytes"]
        summary["pass_memory_le_quarter"] = summary["peak_memory_ratio_vs_eager"] <= 0.25
    summary["deterministic_speed_vs_atomic"] = atomic["median_ms"] / det["median_ms"]
    summary["pass_deterministic_ge_0_9_atomic"] = summary["deterministic_speed_vs_atomic"] >= 0.9
    summary["fraction_of_copy_rate"] = det["fraction_of_copy_rate"]
    return summary


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for all_action_q.json")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu for a smoke run")
    parser.add_argument("--compiled", choices=["target", "dynamic", "none"], default="target")
    parser.add_argument("--quick", action="store_true", help="two tiny shapes (smoke run)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--max-seconds", type=float, default=0.6, help="timing budget per case")
    args = parser.parse_args(argv)
    args.device = torch.device(args.device)
    if args.device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a GPU (use --device cpu --quick for a smoke run)")
    if not extension_available() or (args.device.type == "cuda" and not cuda_kernels_available()):
        parser.error(f"the fused kernels are not available: {extension_error() or 'no CUDA kernels (nvcc?)'}")
    shapes = QUICK_SHAPES if args.quick else list(itertools.product(SIZES_N, SIZES_A, SIZES_H))
    args.target = shapes[-1] if args.quick else TARGET
    args.compiled_fn = None
    if args.compiled != "none":
        args.compiled_fn = torch.compile(all_action_q_reference, dynamic=args.compiled == "dynamic")
    start = time.perf_counter()
    copy_rate = copy_bandwidth_bytes_per_s(args.device)
    rows = []
    for shape in shapes:
        rows += bench_shape(args, shape, copy_rate)
    result = {
        "command": " ".join(sys.argv),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if args.device.type == "cuda" else "cpu",
        "dtype": "float32",
        "compiled_mode": args.compiled,
        "copy_rate_bytes_per_s": copy_rate,
        "target": summarise_target(rows, args.target),
        "results": rows,
        "wall_seconds": time.perf_counter() - start,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "all_action_q.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result["target"], indent=2))
    print(f"wrote {args.out / 'all_action_q.json'} in {result['wall_seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
