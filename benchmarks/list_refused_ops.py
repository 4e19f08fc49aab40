"""List the common ops that still raise under ``torch.use_deterministic_algorithms(True)`` on CUDA.

Each candidate runs forward + backward on small CUDA tensors in deterministic mode (with
``CUBLAS_WORKSPACE_CONFIG`` set, as :func:`deepep_lightning.determinism.configure` does). Recorded
per op: whether it raised with the plugin off (``raises``), the first line of the error, and whether
it still raises once the plugin's dispatcher routing is on (``raises_with_deepep_routing``, every op). Writes
``DIR/refused_ops_list.json``::

    PYTHONPATH=$PWD python benchmarks/list_refused_ops.py --out benchmarks/results/refused_ops

``--device cpu`` is a smoke run of the script itself (on CPU only ``max_unpool2d``'s forward raises).
"""

import argparse
import json
import os
import platform
import sys
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts

import torch
import torch.nn.functional as F

_RANDOM = torch.Generator().manual_seed(0)


def _leaf(*shape, device):
    return torch.randn(*shape, generator=_RANDOM).to(device).requires_grad_()


def _grid(*shape, device):
    return (torch.rand(*shape, generator=_RANDOM) * 2 - 1).to(device).requires_grad_()


def _index(high, *shape, device):
    return torch.randint(0, high, shape, generator=_RANDOM).to(device)


def candidates(device):
    """name -> zero-argument callable returning a scalar to differentiate (fresh tensors each time)."""
    d = dict(device=device)

    def image():  # [2, 3, 8, 8]
        return _leaf(2, 3, 8, 8, **d)

    def grid():  # [2, 5, 5, 2]
        return _grid(2, 5, 5, 2, **d)

    def volume():  # [1, 2, 6, 6, 6]
        return _leaf(1, 2, 6, 6, 6, **d)

    def sample(**kwargs):
        return lambda: F.grid_sample(image(), grid(), **kwargs).sum()

    def resize(make, **kwargs):
        return lambda: F.interpolate(make(), **kwargs).sum()

    return {
        "grid_sample_2d_bilinear_zeros": sample(align_corners=False),
        "grid_sample_2d_bilinear_border": sample(padding_mode="border", align_corners=True),
        "grid_sample_2d_bilinear_reflection": sample(padding_mode="reflection", align_corners=False),
        "grid_sample_2d_bilinear_zeros_align_corners_cudnn": sample(align_corners=True),
        "grid_sample_2d_bilinear_grid_grad_only": lambda: F.grid_sample(
            image().detach(), grid(), align_corners=False
        ).sum(),
        "grid_sample_2d_nearest": sample(mode="nearest", align_corners=False),
        "grid_sample_2d_bicubic": sample(mode="bicubic", align_corners=False),
        "grid_sample_3d_bilinear": lambda: F.grid_sample(
            volume(), _grid(1, 3, 3, 3, 3, **d), align_corners=False
        ).sum(),
        "interpolate_bilinear": resize(image, scale_factor=2, mode="bilinear"),
        "interpolate_bilinear_antialias": resize(image, scale_factor=0.5, mode="bilinear", antialias=True),
        "interpolate_bicubic": resize(image, scale_factor=2, mode="bicubic"),
        "interpolate_linear_1d": resize(lambda: _leaf(2, 3, 8, **d), scale_factor=2, mode="linear"),
        "interpolate_trilinear": resize(volume, scale_factor=2, mode="trilinear"),
        "interpolate_nearest": resize(image, scale_factor=2, mode="nearest"),
        "interpolate_nearest_exact": resize(image, scale_factor=2, mode="nearest-exact"),
        "interpolate_area": resize(image, size=(3, 5), mode="area"),
        "avg_pool3d": lambda: F.avg_pool3d(volume(), 3, stride=2).sum(),
        "adaptive_avg_pool2d": lambda: F.adaptive_avg_pool2d(image(), 3).sum(),
        "adaptive_avg_pool3d": lambda: F.adaptive_avg_pool3d(volume(), 4).sum(),
        "adaptive_max_pool2d": lambda: F.adaptive_max_pool2d(image(), 3).sum(),
        "max_pool3d": lambda: F.max_pool3d(volume(), 3, stride=2).sum(),
        "fractional_max_pool2d": lambda: F.fractional_max_pool2d(image(), 2, output_size=3).sum(),
        "max_unpool2d": lambda: F.max_unpool2d(*F.max_pool2d(image(), 2, return_indices=True), 2).sum(),
        "reflection_pad2d": lambda: F.pad(image(), (2, 2, 2, 2), mode="reflect").sum(),
        "replication_pad2d": lambda: F.pad(image(), (2, 2, 2, 2), mode="replicate").sum(),
        "reflection_pad3d": lambda: F.pad(volume(), (1,) * 6, mode="reflect").sum(),
        "embedding": lambda: F.embedding(_index(10, 32, **d), _leaf(10, 4, **d)).sum(),
        "embedding_bag_max": lambda: F.embedding_bag(_index(10, 4, 3, **d), _leaf(10, 4, **d), mode="max").sum(),
        "embedding_bag_sum": lambda: F.embedding_bag(_index(10, 4, 3, **d), _leaf(10, 4, **d), mode="sum").sum(),
        "nll_loss2d": lambda: F.nll_loss(F.log_softmax(_leaf(2, 4, 5, 5, **d), 1), _index(4, 2, 5, 5, **d)),
        "nll_loss2d_weight_ignore_index": lambda: F.cross_entropy(
            _leaf(2, 4, 5, 5, **d),
            _index(4, 2, 5, 5, **d).masked_fill(_index(2, 2, 5, 5, **d) == 0, 255),
            weight=torch.rand(4, generator=_RANDOM).to(device) + 0.5,
            ignore_index=255,
        ),
        "nll_loss2d_sum": lambda: F.cross_entropy(_leaf(2, 4, 5, 5, **d), _index(4, 2, 5, 5, **d), reduction="sum"),
        "cross_entropy_3d_input": lambda: F.cross_entropy(_leaf(2, 4, 7, **d), _index(4, 2, 7, **d)),
        "avg_pool3d_overlap_ceil": lambda: F.avg_pool3d(volume(), 3, stride=1, padding=1, ceil_mode=True).sum(),
        "replication_pad3d": lambda: F.pad(volume(), (1,) * 6, mode="replicate").sum(),
        "reflection_pad1d_aten": lambda: torch._C._nn.reflection_pad1d(_leaf(2, 3, 8, **d), (2, 3)).sum(),
        "reflection_pad2d_aten": lambda: torch._C._nn.reflection_pad2d(image(), (2, 2, 1, 3)).sum(),
        "replication_pad1d_aten": lambda: torch._C._nn.replication_pad1d(_leaf(2, 3, 8, **d), (2, 3)).sum(),
        "replication_pad2d_aten": lambda: torch._C._nn.replication_pad2d(image(), (2, 2, 1, 3)).sum(),
        "replication_pad3d_aten": lambda: torch._C._nn.replication_pad3d(volume(), (1,) * 6).sum(),
        "upsample_bilinear2d_aten": lambda: torch._C._nn.upsample_bilinear2d(image(), (13, 11), False).sum(),
        "interpolate_bicubic_antialias": resize(image, scale_factor=0.5, mode="bicubic", antialias=True),
        "grid_sample_3d_nearest": lambda: F.grid_sample(
            volume(), _grid(1, 3, 3, 3, 3, **d), mode="nearest", align_corners=False
        ).sum(),
        "grid_sample_2d_bicubic_reflection_grid_grad": lambda: F.grid_sample(
            image(), grid(), mode="bicubic", padding_mode="reflection", align_corners=True
        ).sum(),
        "ctc_loss": lambda: F.ctc_loss(
            F.log_softmax(_leaf(12, 2, 5, **d), 2),
            _index(4, 2, 4, **d) + 1,
            torch.full((2,), 12, **d),
            torch.full((2,), 4, **d),
        ),
        "index_add": lambda: torch.zeros(5, 3, **d).index_add(0, _index(5, 8, **d), _leaf(8, 3, **d)).sum(),
        "scatter_add": lambda: torch.zeros(5, **d).scatter_add(0, _index(5, 8, **d), _leaf(8, **d)).sum(),
        "scatter_reduce_amax": lambda: (
            torch.zeros(5, **d).scatter_reduce(0, _index(5, 8, **d), _leaf(8, **d), "amax").sum()
        ),
        "index_put_accumulate": lambda: (
            torch.zeros(5, **d).index_put((_index(5, 8, **d),), _leaf(8, **d), accumulate=True).sum()
        ),
        "gather_backward": lambda: _leaf(5, 4, **d).gather(0, _index(5, 6, 4, **d)).sum(),
        "index_select_backward": lambda: _leaf(5, 4, **d).index_select(0, _index(5, 9, **d)).sum(),
        "kthvalue": lambda: _leaf(5, 7, **d).kthvalue(3, 1).values.sum(),
        "index_reduce_prod": lambda: (
            torch.ones(5, 3, **d).index_reduce(0, _index(5, 8, **d), _leaf(8, 3, **d), "prod").sum()
        ),
        "index_reduce_mean": lambda: (
            torch.zeros(5, 3, **d).index_reduce(0, _index(5, 8, **d), _leaf(8, 3, **d), "mean").sum()
        ),
        "index_reduce_amax": lambda: (
            torch.zeros(5, 3, **d).index_reduce(0, _index(5, 8, **d), _leaf(8, 3, **d), "amax").sum()
        ),
        "index_reduce_amin": lambda: (
            torch.zeros(5, 3, **d)
            .index_reduce(0, _index(5, 8, **d), _leaf(8, 3, **d), "amin", include_self=False)
            .sum()
        ),
        "scatter_reduce_sum": lambda: (
            torch.zeros(5, **d).scatter_reduce(0, _index(5, 8, **d), _leaf(8, **d), "sum").sum()
        ),
        "scatter_reduce_mean": lambda: (
            torch.zeros(5, **d).scatter_reduce(0, _index(5, 8, **d), _leaf(8, **d), "mean").sum()
        ),
        "scatter_reduce_prod": lambda: (
            torch.ones(5, **d).scatter_reduce(0, _index(5, 8, **d), _leaf(8, **d), "prod").sum()
        ),
        "put_accumulate": lambda: (
            torch.zeros(5, 3, **d).put_(_index(15, 20, **d), _leaf(20, **d), accumulate=True).sum()
        ),
        "median_dim": lambda: _leaf(5, 7, **d).median(1).values.sum(),
        "nanmedian_dim": lambda: _leaf(5, 7, **d).nanmedian(0).values.sum(),
        "cumsum": lambda: _leaf(64, **d).cumsum(0).sum(),
        "histc": lambda: torch.histc(_leaf(64, **d).detach(), bins=8).sum(),
        "bincount_weights": lambda: torch.bincount(_index(8, 64, **d), weights=_leaf(64, **d).detach()).sum(),
    }


def torchvision_candidates(device):
    """torchvision's RoI and deformable-convolution ops (empty without torchvision)."""
    try:
        import torchvision.ops as tv
    except ImportError:
        return {}
    d = dict(device=device)

    def features():  # [2, 8, 12, 12]: 8 channels = 2 groups of a 2 x 2 position-sensitive head
        return _leaf(2, 8, 12, 12, **d)

    def rois():
        return torch.tensor([[0, 1.0, 1.0, 9.0, 7.0], [1, 0.5, 2.0, 11.0, 11.0], [0, 3.0, 3.0, 5.0, 6.0]], **d)

    return {
        "roi_align": lambda: tv.roi_align(features(), rois(), 2, 1.0, 2).sum(),
        "roi_align_adaptive": lambda: tv.roi_align(features(), rois(), 2, 1.0, -1, aligned=True).sum(),
        "roi_pool": lambda: tv.roi_pool(features(), rois(), 2, 1.0).sum(),
        "ps_roi_align": lambda: tv.ps_roi_align(features(), rois(), 2, 1.0, 2).sum(),
        "ps_roi_pool": lambda: tv.ps_roi_pool(features(), rois(), 2, 1.0).sum(),
        "deform_conv2d": lambda: tv.deform_conv2d(
            features(),
            _leaf(2, 2 * 3 * 3, 10, 10, **d),
            _leaf(4, 8, 3, 3, **d),
            mask=torch.sigmoid(_leaf(2, 9, 10, 10, **d)),
        ).sum(),
    }


def probe(fn):
    """(raised for lack of a deterministic kernel, first error line) for forward + backward of ``fn``."""
    try:
        value = fn()
        if value.requires_grad:
            value.backward()
        if value.is_cuda:
            torch.cuda.synchronize()
        return False, None
    except Exception as error:  # noqa: BLE001 - record any failure, classify below
        message = f"{type(error).__name__}: " + (str(error).strip().splitlines() or [""])[0][:400]
        return "deterministic" in message, message


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="directory for refused_ops_list.json")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument(
        "--quick", action="store_true", help="accepted as in bench_refused_ops.py; the probe is small already"
    )
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a GPU (use --device cpu for a smoke run)")
    from deepep_lightning.ops import cuda_kernels_available, extension_available, refused_ops_routing, routed_aten_ops

    torch.use_deterministic_algorithms(True)
    results = []
    for name, fn in {**candidates(args.device), **torchvision_candidates(args.device)}.items():
        raised, message = probe(fn)
        entry = {"op": name, "raises": raised, "error": message}
        with refused_ops_routing():
            entry["raises_with_deepep_routing"], entry["error_with_deepep_routing"] = probe(fn)
        results.append(entry)
        print(
            f"{name:52s} {'RAISES' if raised else 'ok':7s} routed: "
            f"{'RAISES' if entry['raises_with_deepep_routing'] else 'ok'}",
            flush=True,
        )
    report = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu",
        "extension_available": extension_available(),
        "cuda_kernels_available": cuda_kernels_available(),
        "command": " ".join([sys.executable] + sys.argv),
        "raising_ops": [entry["op"] for entry in results if entry["raises"]],
        "raising_ops_with_deepep_routing": [entry["op"] for entry in results if entry["raises_with_deepep_routing"]],
        "routed_aten_ops": routed_aten_ops(),
        "results": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "refused_ops_list.json").write_text(json.dumps(report, indent=2))
    print(
        f"wrote {args.out / 'refused_ops_list.json'}: {len(report['raising_ops'])} of {len(results)} raise, "
        f"{len(report['raising_ops_with_deepep_routing'])} with the routing on"
    )


if __name__ == "__main__":
    main()
