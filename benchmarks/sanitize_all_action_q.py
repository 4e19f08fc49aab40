"""Exercise the all_action_q CUDA kernels under a sanitizer (a driver script, not a benchmark).

Runs forward+backward of both backward variants on awkward shapes (H not a multiple of 32, A > 32,
the generic H > 256 path, 1x1x1), on the default stream and on a side stream handed over with
``wait_stream``/``record_stream``, and checks every result against the float64 reference.
Exit status 0 when all checks pass. Meant to be run under the sanitizers, from the repo root::

    # cross-stream races, as seen by PyTorch (CSAN):
    TORCH_CUDA_SANITIZER=1 PYTHONPATH=$PWD python benchmarks/sanitize_all_action_q.py --out OUT
    # out-of-bounds / misaligned accesses in the kernels (no caching allocator, so every tensor
    # is its own allocation and an overrun is caught):
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 PYTHONPATH=$PWD compute-sanitizer --tool memcheck \
        --error-exitcode 1 --log-file OUT/memcheck.log python benchmarks/sanitize_all_action_q.py --quick

Build the extension once before the compute-sanitizer run (run the script plainly first): the JIT
build under compute-sanitizer works but is slow.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from bench_all_action_q import make_inputs

from deepep_lightning.deepep.kernels import all_action_q, all_action_q_reference
from deepep_lightning.ops import cuda_kernels_available, extension_error

FULL_SHAPES = [(333, 33, 100), (257, 3, 300), (4096, 8, 256), (1000, 18, 128), (1, 1, 1), (65, 2, 31)]
QUICK_SHAPES = [(333, 33, 100), (257, 3, 300), (1, 1, 1), (65, 2, 31)]


def _fwd_bwd(fn, z, e, w, b, grad_q, **kwargs):
    leaves = [t.detach().requires_grad_() for t in (z, e, w, b)]
    q = fn(*leaves, **kwargs)
    return [q.detach(), *torch.autograd.grad(q, leaves, grad_q)]


def _max_rel_err(got, want):
    return max(((x.double() - y).abs().max() / y.abs().max().clamp_min(1e-30)).item() for x, y in zip(got, want))


def run(shapes):
    """Returns one record per (shape, variant, stream) with the max relative error."""
    records = []
    side = torch.cuda.Stream()
    for seed, (n, a, h) in enumerate(shapes):
        leaves, grad_q = make_inputs(n, a, h, "cuda", seed)
        z, e, w, b = (t.detach() for t in leaves)
        want = _fwd_bwd(all_action_q_reference, z.double(), e.double(), w.double(), b.double(), grad_q.double())
        for deterministic in (True, False):
            got_default = _fwd_bwd(all_action_q, z, e, w, b, grad_q, deterministic=deterministic)
            side.wait_stream(torch.cuda.current_stream())  # inputs were made on the default stream
            with torch.cuda.stream(side):
                got_side = _fwd_bwd(all_action_q, z, e, w, b, grad_q, deterministic=deterministic)
                side_error = _max_rel_err(got_side, want)  # the side results never leave the side stream
            for tensor in (z, e, w, b, grad_q, *want):
                tensor.record_stream(side)
            torch.cuda.current_stream().wait_stream(side)
            errors = {"default": _max_rel_err(got_default, want), "side": side_error}
            for stream_name, error in errors.items():
                records.append(
                    {
                        "N": n,
                        "A": a,
                        "H": h,
                        "deterministic": deterministic,
                        "stream": stream_name,
                        "max_rel_err": error,
                        "ok": error < 1e-5,
                    }
                )
    torch.cuda.synchronize()  # a script, not library code: wait for the last kernels
    return records


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes (for compute-sanitizer)")
    parser.add_argument("--out", type=Path, default=None, help="directory for sanitize_all_action_q.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    if not cuda_kernels_available():
        print(f"CUDA kernels not available: {extension_error() or 'built without nvcc'}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    records = run(QUICK_SHAPES if args.quick else FULL_SHAPES)
    failed = [r for r in records if not r["ok"]]
    for record in records:
        print(json.dumps(record))
    print(f"{len(records) - len(failed)}/{len(records)} checks passed in {time.perf_counter() - start:.1f} s")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        summary = {
            "command": sys.argv,
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name(),
            "records": records,
            "passed": not failed,
        }
        (args.out / "sanitize_all_action_q.json").write_text(json.dumps(summary, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
