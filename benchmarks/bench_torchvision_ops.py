"""Per-call time and memory of the deterministic torchvision backwards against torchvision's atomic kernels.

Shapes: a Faster/Mask R-CNN FPN at 800 x 1333 inputs, 2 images, 256 channels: levels P2..P5 (200 x 336 ..
25 x 42), each called with 2 x 512 RoIs of the sizes that MultiScaleRoIAlign assigns to it (the worst
case of one level taking every RoI), box head 7 x 7 and mask head 14 x 14 with ``sampling_ratio=2``, and
7 x 7 with adaptive sampling (-1). Per case: the median milliseconds of the deepep kernel and of
torchvision's CUDA kernel (deterministic mode off, side by side in one process), their ratio, the peak
memory each adds over its inputs, and whether 3 deepep calls are bitwise equal. Writes JSON::

    PYTHONPATH=$PWD python benchmarks/bench_torchvision_ops.py --out benchmarks/results/torchvision_ops.json

``--quick`` runs two cases with few repeats (a smoke run).
"""

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import median_ms, write_json  # noqa: E402

LEVELS = {
    "P2": (200, 336, 4, (16, 112)),
    "P3": (100, 168, 8, (112, 224)),
    "P4": (50, 84, 16, (224, 448)),
    "P5": (25, 42, 32, (448, 800)),
}  # name: (H, W, stride, box side range in image pixels)
HEADS = {"box7_sr2": (7, 2), "mask14_sr2": (14, 2), "box7_adaptive": (7, -1)}


def roi_align_case(level, head, images=2, rois_per_image=512, channels=256, device="cuda"):
    height, width, stride, (low, high) = LEVELS[level]
    pooled, sampling_ratio = HEADS[head]
    generator = torch.Generator(device=device).manual_seed(0)
    count = images * rois_per_image
    side = low + torch.rand(count, 2, device=device, generator=generator) * (high - low)
    corner = (
        torch.rand(count, 2, device=device, generator=generator) * torch.tensor([1333.0, 800.0], device=device)
        - side / 2
    )
    index = torch.arange(count, device=device).div(rois_per_image, rounding_mode="floor").float()
    rois = torch.cat([index[:, None], corner, corner + side], dim=1)
    grad = torch.randn(count, channels, pooled, pooled, device=device, generator=generator)
    return (grad, rois, 1.0 / stride, pooled, pooled, images, channels, height, width, sampling_ratio, False)


def peak_extra_mib(fn):
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak / 2**20


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="JSON file to write")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--quick", action="store_true", help="two cases, 5 repeats")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a GPU")
    import torchvision  # noqa: F401 - registers torch.ops.torchvision

    from deepep_lightning.ops import cuda_kernels_available

    if not cuda_kernels_available():
        sys.exit("the deepep CUDA kernels are not built")
    repeats = 5 if args.quick else args.repeats
    cases = [(level, head) for level in LEVELS for head in HEADS]
    if args.quick:
        cases = cases[:2]
    results = []
    for level, head in cases:
        case = roi_align_case(level, head)

        def atomic(case=case):
            return torch.ops.torchvision._roi_align_backward(*case)

        def deepep(case=case):
            return torch.ops.deepep.roi_align_backward(*case)

        torch.use_deterministic_algorithms(False)
        first = deepep()
        bitwise = all(torch.equal(first, deepep()) for _ in range(2))
        max_difference = (first - atomic()).abs().max().item()
        atomic_ms, _ = median_ms(atomic, repeats)
        deepep_ms, _ = median_ms(deepep, repeats)
        entry = {
            "op": "roi_align_backward",
            "case": f"{level}_{head}",
            "shape": {"grad": list(case[0].shape), "input": [case[5], case[6], case[7], case[8]]},
            "sampling_ratio": case[9],
            "atomic_ms": atomic_ms,
            "deepep_ms": deepep_ms,
            "ratio": deepep_ms / atomic_ms,
            "atomic_peak_extra_mib": peak_extra_mib(atomic),
            "deepep_peak_extra_mib": peak_extra_mib(deepep),
            "bitwise_repeat": bitwise,
            "max_abs_difference_to_atomic": max_difference,
        }
        entry["memory_ratio"] = entry["deepep_peak_extra_mib"] / max(entry["atomic_peak_extra_mib"], 1e-9)
        results.append(entry)
        print(
            f"{entry['case']:20s} atomic {atomic_ms:8.3f} ms  deepep {deepep_ms:8.3f} ms  x{entry['ratio']:.2f}  "
            f"memory x{entry['memory_ratio']:.2f}  bitwise {bitwise}  max|diff| {max_difference:.2e}",
            flush=True,
        )
    ratios = [entry["ratio"] for entry in results]
    write_json(
        args.out,
        {
            "command": " ".join([sys.executable] + sys.argv),
            "median_ratio": statistics.median(ratios),
            "worst_ratio": max(ratios),
            "results": results,
        },
    )


if __name__ == "__main__":
    main()
