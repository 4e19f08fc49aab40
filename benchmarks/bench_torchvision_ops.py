"""Per-call time and memory of the deterministic torchvision backwards against torchvision's atomic kernels.

Shapes: a Faster/Mask R-CNN FPN at 800 x 1333 inputs, 2 images, 256 channels: levels P2..P5 (200 x 336 ..
25 x 42), each called with 2 x 512 RoIs of the sizes that MultiScaleRoIAlign assigns to it (the worst
case of one level taking every RoI): roi_align with box head 7 x 7 and mask head 14 x 14 at
``sampling_ratio=2`` and 7 x 7 adaptive (-1); roi_pool 7 x 7; ps_roi_align and ps_roi_pool as R-FCN's
7 x 7 x 10 classes. deform_conv2d: the DCNv2 3 x 3 conv of ResNet-50's stages 3-5 at 800 x 1333 (2 images). Per case:
the median milliseconds of the deepep backward and of torchvision's CUDA kernel (deterministic mode off,
side by side in one process), their ratio, the peak memory each adds over its inputs, whether 3
deepep calls are bitwise equal, and the largest difference of each gradient from torchvision's. Writes JSON::

    PYTHONPATH=$PWD python benchmarks/bench_torchvision_ops.py \
        --out benchmarks/results/torchvision_ops/torchvision_ops.json

``--quick`` runs one case per op with few repeats (a smoke run); ``--ops`` measures only the ops named.
"""

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import median_ms, peak_extra_mib, write_json  # noqa: E402

LEVELS = {
    "P2": (200, 336, 4, (16, 112)),
    "P3": (100, 168, 8, (112, 224)),
    "P4": (50, 84, 16, (224, 448)),
    "P5": (25, 42, 32, (448, 800)),
}  # name: (H, W, stride, box side range in image pixels)
HEADS = {"box7_sr2": (7, 2), "mask14_sr2": (14, 2), "box7_adaptive": (7, -1)}


def roi_align_case(level, head, images=2, rois_per_image=512, channels=256, device="cuda"):
    """torchvision::_roi_align_backward's arguments for one FPN level and head."""
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


def roi_pool_case(level, images=2, rois_per_image=512, channels=256, device="cuda"):
    grad, rois, scale, pooled, _, images, channels, height, width, _, _ = roi_align_case(level, "box7_sr2")
    features = torch.randn(images, channels, height, width, device=device)
    _, argmax = torch.ops.torchvision.roi_pool(features, rois, scale, pooled, pooled)
    return (grad, rois, argmax, scale, pooled, pooled, images, channels, height, width)


def ps_roi_align_case(level, device="cuda"):
    """R-FCN: 7 x 7 bins of 10 classes (490 input channels), sampling_ratio 2."""
    grad, rois, scale, _, _, images, _, height, width, _, _ = roi_align_case(level, "box7_sr2", channels=10)
    mapping = torch.arange(490, device=device, dtype=torch.int32).view(1, 10, 7, 7).repeat(grad.shape[0], 1, 1, 1)
    return (grad, rois, mapping, scale, 7, 7, 2, images, 490, height, width)


OPS = ["roi_align", "roi_pool", "ps_roi_align", "ps_roi_pool", "deform_conv2d"]
DCN_STAGES = {"res3": (128, 100, 168), "res4": (256, 50, 84), "res5": (512, 25, 42)}  # channels, H, W at 800 x 1333


def deform_conv2d_case(stage, images=2, device="cuda"):
    """The 3 x 3 conv of a DCNv2 bottleneck (offsets and mask predicted, one offset group)."""
    channels, height, width = DCN_STAGES[stage]
    generator = torch.Generator(device=device).manual_seed(0)
    options = dict(device=device, generator=generator)
    input = torch.randn(images, channels, height, width, **options)
    weight = torch.randn(channels, channels, 3, 3, **options) * 0.02
    offset = torch.randn(images, 18, height, width, **options) * 2
    mask = torch.rand(images, 9, height, width, **options)
    grad = torch.randn(images, channels, height, width, **options)
    bias = torch.zeros(channels, device=device)
    return (grad, input, weight, offset, mask, bias, 1, 1, 1, 1, 1, 1, 1, 1, True)


def cases(quick):
    """(op, case name, torchvision's backward, deepep's backward), each a zero-argument callable."""
    from deepep_lightning.ops.deform_conv2d import deform_conv2d_backward
    from deepep_lightning.ops.ps_roi_align import ps_roi_align_backward
    from deepep_lightning.ops.ps_roi_pool import ps_roi_pool_backward
    from deepep_lightning.ops.roi_pool import roi_pool_backward

    made = []
    for level in LEVELS:
        for head in HEADS:
            args = roi_align_case(level, head)
            made.append(
                (
                    "roi_align",
                    f"{level}_{head}",
                    torch.ops.torchvision._roi_align_backward,
                    torch.ops.deepep_lightning.roi_align_backward,
                    args,
                )
            )
        made.append(
            (
                "roi_pool",
                f"{level}_box7",
                torch.ops.torchvision._roi_pool_backward,
                roi_pool_backward,
                roi_pool_case(level),
            )
        )
        made.append(
            (
                "ps_roi_align",
                f"{level}_rfcn7_sr2",
                torch.ops.torchvision._ps_roi_align_backward,
                ps_roi_align_backward,
                ps_roi_align_case(level),
            )
        )
        pool_args = ps_roi_align_case(level)
        pool_args = pool_args[:6] + pool_args[7:]  # ps_roi_pool: no sampling_ratio
        made.append(
            (
                "ps_roi_pool",
                f"{level}_rfcn7",
                torch.ops.torchvision._ps_roi_pool_backward,
                ps_roi_pool_backward,
                pool_args,
            )
        )
    for stage in DCN_STAGES:
        made.append(
            (
                "deform_conv2d",
                stage,
                torch.ops.torchvision._deform_conv2d_backward,
                deform_conv2d_backward,
                deform_conv2d_case(stage),
            )
        )
    if quick:
        made = [made[0], made[3], made[4], made[5], made[-1]]
    return [
        (op, name, lambda f=atomic, a=args: f(*a), lambda f=deepep, a=args: f(*a))
        for op, name, atomic, deepep, args in made
    ]


def _as_tuple(result):
    return result if isinstance(result, tuple) else (result,)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="JSON file to write")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--quick", action="store_true", help="one case per op, 5 repeats")
    parser.add_argument("--ops", nargs="+", choices=OPS, default=OPS, help="the ops to measure (default: all)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a GPU")
    import torchvision  # noqa: F401 - registers torch.ops.torchvision

    from deepep_lightning.ops import cuda_kernels_available

    if not cuda_kernels_available():
        sys.exit("the deepep_lightning CUDA kernels are not built")
    repeats = 5 if args.quick else args.repeats
    results = []
    torch.use_deterministic_algorithms(False)  # torchvision's atomic kernels run only outside it
    command = " ".join([sys.executable] + sys.argv)
    for op, name, atomic, deepep in [case for case in cases(args.quick) if case[0] in args.ops]:
        try:
            first = deepep()
        except ValueError as error:  # a case the routes leave to torchvision (it is named, not timed)
            results.append({"op": op, "case": name, "left_to_torchvision": str(error)})
            print(f"{op:14s} {name:20s} left to torchvision: {error}", flush=True)
            continue
        bitwise = all(all(torch.equal(a, b) for a, b in zip(_as_tuple(first), _as_tuple(deepep()))) for _ in range(2))
        reference = _as_tuple(atomic())
        differences = [
            (mine.double() - theirs.double()).abs().max().item() if mine.numel() else 0.0
            for mine, theirs in zip(_as_tuple(first), reference)
        ]
        max_difference = differences[0]
        atomic_ms, _ = median_ms(atomic, repeats)
        deepep_ms, _ = median_ms(deepep, repeats)
        entry = {
            "op": op,
            "case": name,
            "atomic_ms": atomic_ms,
            "deepep_ms": deepep_ms,
            "ratio": deepep_ms / atomic_ms,
            "atomic_peak_extra_mib": peak_extra_mib(atomic),
            "deepep_peak_extra_mib": peak_extra_mib(deepep),
            "bitwise_repeat": bitwise,
            "max_abs_difference_of_grad_input": max_difference,
            "max_abs_difference_of_each_gradient": differences,
        }
        entry["memory_ratio"] = entry["deepep_peak_extra_mib"] / max(entry["atomic_peak_extra_mib"], 1e-9)
        results.append(entry)
        print(
            f"{op:14s} {name:20s} atomic {atomic_ms:8.3f} ms  deepep {deepep_ms:8.3f} ms  x{entry['ratio']:.2f}  "
            f"memory x{entry['memory_ratio']:.2f}  bitwise {bitwise}  max|diff| {max_difference:.2e}",
            flush=True,
        )
        write_json(args.out, {"command": command, "done": False, "results": results})  # a stopped call keeps these
    summary = {}
    for op in sorted({entry["op"] for entry in results if "ratio" in entry}):
        ratios = [entry["ratio"] for entry in results if entry["op"] == op and "ratio" in entry]
        summary[op] = {"median_ratio": statistics.median(ratios), "worst_ratio": max(ratios)}
        print(f"{op}: median x{summary[op]['median_ratio']:.2f}, worst x{summary[op]['worst_ratio']:.2f}")
    write_json(args.out, {"command": command, "done": True, "summary": summary, "results": results})


if __name__ == "__main__":
    main()
