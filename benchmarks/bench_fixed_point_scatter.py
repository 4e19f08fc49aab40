"""The fixed-point scatter-add against the sorted one and PyTorch's: which should the index routes call?

Per case (an ``index_add`` along dim 0 of ``src [entries, inner]`` onto ``base [size, inner]``, float32 unless
the case says otherwise), the median time per call over ``--repeats`` calls after warm-up (CUDA events), the
peak extra device memory of one call, whether two calls are bitwise equal and the largest difference from
PyTorch's float64 ``index_add``, for:

* ``fixed_point``: ``torch.ops.deepep_lightning.fixed_point_scatter_add`` (64-bit integer atomics, exact sums);
* ``sorted``: ``torch.ops.deepep_lightning.segment_scatter_add`` (what the index routes call now);
* ``pytorch_atomic``: ``index_add`` outside deterministic mode (float atomics, not reproducible);
* ``pytorch_deterministic``: ``index_add`` in deterministic mode without the plugin's routes.

The cases span the zoo's users of the routes: a relative-position-bias table (many entries, few rows), GNN
message passing (entries spread over many rows), MoE token routing (hot rows) and an embedding-sized table.
Target: ``fixed_point`` at most 1.1x ``pytorch_atomic`` on every case. Writes JSON::

    PYTHONPATH=$PWD python3 benchmarks/bench_fixed_point_scatter.py \
        --out benchmarks/results/refused_ops/fixed_point_scatter.json
    PYTHONPATH=$PWD python3 benchmarks/bench_fixed_point_scatter.py --device cpu --quick --out /tmp/fps.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _timing import median_ms, peak_extra_mib, write_json  # noqa: E402

# name: (entries, inner, size, dtype)
CASES = {
    "bias_table_2401x4_into_169": (64 * 2401, 4, 169, torch.float32),  # MaxViT/Swin relative-position bias
    "gnn_200k_edges_64_into_10k": (200_000, 64, 10_000, torch.float32),  # GCN/GAT/SAGE message passing
    "gnn_200k_edges_64_into_10k_bf16": (200_000, 64, 10_000, torch.bfloat16),
    "moe_16k_tokens_512_into_8": (16_384, 512, 8, torch.float32),  # hot rows: top-2 routing to 8 experts
    "embedding_65k_tokens_256_into_50k": (65_536, 256, 50_257, torch.float32),  # GPT-2-sized vocabulary
}
QUICK = {"quick_1000x8_into_50": (1000, 8, 50, torch.float32)}
METHODS = ("fixed_point", "sorted", "pytorch_atomic", "pytorch_deterministic")


def _case(entries: int, inner: int, size: int, dtype: torch.dtype, device: str):
    generator = torch.Generator().manual_seed(0)
    src = torch.randn(entries, inner, generator=generator).to(dtype).to(device)
    index = torch.randint(0, size, (entries,), generator=generator).to(device)
    base = torch.randn(size, inner, generator=generator).to(dtype).to(device)
    return src, index, base


def _methods(src, index, base):
    size = base.shape[0]

    def pytorch(deterministic: bool):
        def run():
            torch.use_deterministic_algorithms(deterministic)
            try:
                return base.index_add(0, index, src)
            finally:
                torch.use_deterministic_algorithms(False)

        return run

    return {
        "fixed_point": lambda: torch.ops.deepep_lightning.fixed_point_scatter_add(src, index, size, 0, base, 1.0),
        "sorted": lambda: torch.ops.deepep_lightning.segment_scatter_add(src, index, size, 0, base, 1.0),
        "pytorch_atomic": pytorch(False),
        "pytorch_deterministic": pytorch(True),
    }


def run_case(name: str, spec: tuple, device: str, repeats: int, warmup: int) -> dict:
    src, index, base = _case(*spec, device=device)
    exact = base.double().index_add(0, index, src.double())
    row: dict = {"case": name, "entries": spec[0], "inner": spec[1], "size": spec[2], "dtype": str(spec[3])}
    for method, fn in _methods(src, index, base).items():
        first, second = fn(), fn()
        row[method] = {
            "median_ms": median_ms(fn, repeats, warmup, device)[0],
            "peak_extra_mib": peak_extra_mib(fn, device),
            "bitwise_repeat": bool(torch.equal(first, second)),
            "max_abs_difference_from_float64": float((first.double() - exact).abs().max()),
        }
    atomic = row["pytorch_atomic"]["median_ms"]
    for method in METHODS:
        row[method]["ratio_vs_atomic"] = row[method]["median_ms"] / atomic
    print(
        f"{name:40s} "
        + " ".join(f"{m}={row[m]['median_ms']:.3f}ms(x{row[m]['ratio_vs_atomic']:.2f})" for m in METHODS),
        flush=True,
    )
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path, help="the JSON file to write")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--quick", action="store_true", help="one small case, 3 repeats (a smoke run)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats!r}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a GPU (use --device cpu --quick for a smoke run)")
    from deepep_lightning.ops import extension_available, extension_error

    if not extension_available():
        parser.error(f"the deepep_lightning extension is not available: {extension_error()}")
    cases, repeats, warmup = (QUICK, 3, 1) if args.quick else (CASES, args.repeats, 5)
    rows = []
    for name, spec in cases.items():
        rows.append(run_case(name, spec, args.device, repeats, warmup))
        summary = {
            method: {
                "median_ratio_vs_atomic": statistics.median(row[method]["ratio_vs_atomic"] for row in rows),
                "worst_ratio_vs_atomic": max(row[method]["ratio_vs_atomic"] for row in rows),
            }
            for method in METHODS
        }
        write_json(
            args.out, {"command": " ".join(sys.argv), "done": len(rows) == len(cases), "summary": summary, "rows": rows}
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
