"""Where ps_roi_pool's backward agrees: torchvision's kernel and the routed backward, each on the CPU and on CUDA.

Inputs of an R-FCN head at FPN level P4 (2 images of 50 x 84, 63 channels = 7 x 3 x 3 bins, 2 x 256 RoIs of
4-304 px at scale 1/8), float32 and float64. For each pair of backwards (torchvision CPU/CUDA, routed CPU/CUDA,
torchvision/routed on each device) the largest difference and the share of elements differing by more than
1e-4. The routed backward is called as ``ps_roi_pool_backward``, the function the route serves: the tile
gather of ``extensions/csrc/roi_tiles.h``.
Writes JSON::

    PYTHONPATH=$PWD python benchmarks/ps_roi_pool_agreement.py \
        --out benchmarks/results/torchvision_ops/ps_roi_pool_agreement.json
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import write_json  # noqa: E402

PAIRS = [
    ("torchvision_cpu", "torchvision_cuda"),
    ("routed_cpu", "routed_cuda"),
    ("torchvision_cpu", "routed_cpu"),
    ("torchvision_cuda", "routed_cuda"),
]


def backwards(dtype):
    import torchvision

    from deepep_lightning.ops.ps_roi_pool import ps_roi_pool_backward

    generator = torch.Generator().manual_seed(0)
    features = torch.randn(2, 63, 50, 84, generator=generator, dtype=dtype)
    boxes = []
    for _ in range(2):
        corner = torch.rand(256, 2, generator=generator) * torch.tensor([672.0, 400.0])
        size = torch.rand(256, 2, generator=generator) * 300 + 4
        boxes.append(torch.cat([corner, corner + size], 1).to(dtype))
    rois = torchvision.ops._utils.convert_boxes_to_roi_format(boxes)
    grads = {}
    for device in ("cpu", "cuda"):
        out, mapping = torch.ops.torchvision.ps_roi_pool(features.to(device), rois.to(device), 1 / 8, 3, 3)
        grad = torch.linspace(-1, 1, out.numel(), dtype=dtype).view_as(out).to(device)
        args = (grad, rois.to(device), mapping, 1 / 8, 3, 3, 2, 63, 50, 84)
        grads[f"torchvision_{device}"] = torch.ops.torchvision._ps_roi_pool_backward(*args).cpu()
        grads[f"routed_{device}"] = ps_roi_pool_backward(*args).cpu()
    return grads


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="JSON file to write")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a GPU")
    results = {}
    for dtype in (torch.float32, torch.float64):
        grads = backwards(dtype)
        for first, second in PAIRS:
            difference = (grads[first].double() - grads[second].double()).abs()
            results[f"{dtype}: {first} vs {second}"] = {
                "max_abs_difference": difference.max().item(),
                "share_above_1e-4": (difference > 1e-4).double().mean().item(),
            }
            print(f"{dtype} {first:16s} vs {second:16s} {results[f'{dtype}: {first} vs {second}']}", flush=True)
    command = " ".join([sys.executable] + sys.argv)
    write_json(args.out, {"command": command, "device": torch.cuda.get_device_name(), "results": results})


if __name__ == "__main__":
    main()
