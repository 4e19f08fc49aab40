"""Vision models of the zoo: torchvision classification, segmentation, detection, video, optical flow; timm.

Every model is built with ``weights=None`` (and ``weights_backbone=None`` where the builder has a backbone):
random init, nothing downloaded. Batch shapes are those of ordinary training at a small scale (32 images of
224 px for classification, 8 of 256 px for segmentation, 4 of 384 px for detection), so a step takes tens of
milliseconds on an H200.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from zoo_models import ZooModel, ZooTask, with_bf16

__all__ = ["MODELS"]

POOL = 2  # distinct synthetic batches per model; steps cycle through them


def _images(generator: torch.Generator, batch: int, size: int, classes: int) -> list[Any]:
    return [
        (
            torch.randn(batch, 3, size, size, generator=generator),
            torch.randint(0, classes, (batch,), generator=generator),
        )
        for _ in range(POOL)
    ]


def _classification_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    images, labels = batch
    return F.cross_entropy(model(images), labels)


def _torchvision_classifier(name: str, size: int = 224, batch: int = 32, **kwargs: Any):
    def build(generator: torch.Generator) -> ZooTask:
        import torchvision

        model = torchvision.models.get_model(name, weights=None, num_classes=1000, **kwargs)
        return ZooTask(model, _images(generator, batch, size, 1000), _classification_loss)

    return build


def _timm_classifier(name: str, size: int = 224, batch: int = 32):
    def build(generator: torch.Generator) -> ZooTask:
        import timm

        model = timm.create_model(name, pretrained=False, num_classes=1000)
        return ZooTask(model, _images(generator, batch, size, 1000), _classification_loss)

    return build


def _segmentation_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    images, masks = batch
    return F.cross_entropy(model(images)["out"], masks)  # 4-D cross entropy: nll_loss2d


def _segmenter(name: str, size: int = 256, batch: int = 8, classes: int = 21):
    def build(generator: torch.Generator) -> ZooTask:
        import torchvision

        model = torchvision.models.get_model(name, weights=None, weights_backbone=None, num_classes=classes)
        batches = [
            (
                torch.randn(batch, 3, size, size, generator=generator),
                torch.randint(0, classes, (batch, size, size), generator=generator),
            )
            for _ in range(POOL)
        ]
        return ZooTask(model, batches, _segmentation_loss)

    return build


def _detection_target(generator: torch.Generator, size: int, kind: str) -> dict[str, torch.Tensor]:
    count = int(torch.randint(2, 9, (), generator=generator))
    corner = torch.rand(count, 2, generator=generator) * (size * 0.6)
    extent = 16 + torch.rand(count, 2, generator=generator) * (size * 0.35)
    boxes = torch.cat([corner, corner + extent], dim=1)  # [N, 4] x1 y1 x2 y2
    target = {"boxes": boxes, "labels": torch.randint(1, 91, (count,), generator=generator)}
    if kind == "mask":
        rows = torch.arange(size).view(1, size, 1)
        cols = torch.arange(size).view(1, 1, size)
        x1, y1, x2, y2 = (boxes[:, index].view(count, 1, 1) for index in range(4))
        target["masks"] = ((cols >= x1) & (cols < x2) & (rows >= y1) & (rows < y2)).to(torch.uint8)  # [N, H, W]
    if kind == "keypoint":
        low, high = boxes[:, None, :2], boxes[:, None, 2:]
        points = low + torch.rand(count, 17, 2, generator=generator) * (high - low)  # [N, 17, 2]
        target["labels"] = torch.ones(count, dtype=torch.int64)
        target["keypoints"] = torch.cat([points, torch.ones(count, 17, 1)], dim=2)  # [N, 17, 3], all visible
    return target


def _detection_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    images, targets = batch
    return sum(model(images, targets).values())  # type: ignore[return-value]


def _detector(name: str, kind: str = "box", size: int = 384, batch: int = 4, **kwargs: Any):
    def build(generator: torch.Generator) -> ZooTask:
        import torchvision

        if "ssd" not in name:
            kwargs.update(min_size=size, max_size=size)
        num_classes = 2 if kind == "keypoint" else 91
        model = torchvision.models.get_model(
            name, weights=None, weights_backbone=None, num_classes=num_classes, **kwargs
        )
        batches = [
            (
                [torch.rand(3, size, size, generator=generator) for _ in range(batch)],
                [_detection_target(generator, size, kind) for _ in range(batch)],
            )
            for _ in range(POOL)
        ]
        return ZooTask(model, batches, _detection_loss)

    return build


def _video(generator: torch.Generator) -> ZooTask:
    import torchvision

    model = torchvision.models.video.r3d_18(weights=None, num_classes=400)
    batches = [
        (torch.randn(8, 3, 16, 112, 112, generator=generator), torch.randint(0, 400, (8,), generator=generator))
        for _ in range(POOL)
    ]
    return ZooTask(model, batches, _classification_loss)


def _flow_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    first, second, flow = batch
    predictions = model(first, second)
    weights = [0.8 ** (len(predictions) - index - 1) for index in range(len(predictions))]  # RAFT's sequence loss
    return sum(weight * (prediction - flow).abs().mean() for weight, prediction in zip(weights, predictions))  # type: ignore[return-value]


def _raft(generator: torch.Generator) -> ZooTask:
    import torchvision

    model = torchvision.models.optical_flow.raft_small(weights=None)
    batches = [
        (
            torch.rand(4, 3, 256, 256, generator=generator) * 2 - 1,
            torch.rand(4, 3, 256, 256, generator=generator) * 2 - 1,
            torch.randn(4, 2, 256, 256, generator=generator) * 4,
        )
        for _ in range(POOL)
    ]
    return ZooTask(model, batches, _flow_loss)


def _torchvision(name: str, build: Any, *groups: str) -> ZooModel:
    return ZooModel(name, ("vision", "torchvision", *groups), ("torchvision",), build)


MODELS = with_bf16(
    [
        *(
            _torchvision(name, _torchvision_classifier(name), "classification")
            for name in (
                "resnet18",
                "resnet50",
                "mobilenet_v3_large",
                "efficientnet_b0",
                "convnext_tiny",
                "regnet_y_400mf",
                "vit_b_16",
                "swin_t",
                "maxvit_t",
            )
        ),
        *(
            _torchvision(name, _segmenter(name), "segmentation")
            for name in ("fcn_resnet50", "deeplabv3_mobilenet_v3_large", "lraspp_mobilenet_v3_large")
        ),
        _torchvision("fasterrcnn_mobilenet_v3_large_fpn", _detector("fasterrcnn_mobilenet_v3_large_fpn"), "detection"),
        _torchvision("fasterrcnn_resnet50_fpn", _detector("fasterrcnn_resnet50_fpn"), "detection"),
        _torchvision("maskrcnn_resnet50_fpn", _detector("maskrcnn_resnet50_fpn", "mask"), "detection"),
        _torchvision("keypointrcnn_resnet50_fpn", _detector("keypointrcnn_resnet50_fpn", "keypoint"), "detection"),
        _torchvision("retinanet_resnet50_fpn", _detector("retinanet_resnet50_fpn"), "detection"),
        _torchvision("fcos_resnet50_fpn", _detector("fcos_resnet50_fpn"), "detection"),
        _torchvision(
            "ssdlite320_mobilenet_v3_large", _detector("ssdlite320_mobilenet_v3_large", size=320), "detection"
        ),
        _torchvision("r3d_18", _video, "video"),
        _torchvision("raft_small", _raft, "flow"),
        *(
            ZooModel(f"timm_{name}", ("vision", "timm"), ("timm",), _timm_classifier(name))
            for name in ("resnet50d", "vit_small_patch16_224", "convnext_nano", "efficientnet_b2")
        ),
    ],
    ["resnet50", "vit_b_16", "deeplabv3_mobilenet_v3_large"],
)
