"""End-to-end GPU test: torchvision's Faster R-CNN, Mask R-CNN and Keypoint R-CNN, an R-FCN-style
``ps_roi_align`` head, a ``roi_pool`` head and a small DCNv2 net (random init, tiny images, 3 AdamW steps in
Lightning) train bitwise-equal in two fresh processes under DeterminismCallback, with the RoI backwards served by the
deterministic kernels (torchvision's pure-PyTorch ``_roi_align`` never runs)."""

import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]

_SCRIPT = textwrap.dedent(
    """
    import hashlib, sys
    model_name = sys.argv[1]
    from deepep_lightning.determinism import DeterminismCallback, configure
    configure(seed=0)  # before CUDA starts
    import lightning.pytorch as pl
    import torch
    import torchvision
    import torchvision.ops.roi_align as roi_align_module
    from torchvision.models import detection

    def refuse(*args, **kwargs):
        raise AssertionError("torchvision's pure-PyTorch _roi_align ran: the dispatcher path was bypassed")

    roi_align_module._roi_align = refuse

    BUILDERS = {
        "fasterrcnn": detection.fasterrcnn_resnet50_fpn,
        "maskrcnn": detection.maskrcnn_resnet50_fpn,
        "keypointrcnn": detection.keypointrcnn_resnet50_fpn,
    }

    def sample(generator, index):
        image = torch.rand(3, 160, 192, generator=generator)
        xy = torch.rand(3, 2, generator=generator) * 100
        boxes = torch.cat([xy, xy + 20 + torch.rand(3, 2, generator=generator) * 60], dim=1)
        target = {"boxes": boxes, "labels": torch.randint(1, 3, (3,), generator=generator)}
        if model_name == "maskrcnn":
            target["masks"] = (torch.rand(3, 160, 192, generator=generator) > 0.5).to(torch.uint8)
        if model_name == "keypointrcnn":
            points = boxes[:, None, :2] + torch.rand(3, 17, 2, generator=generator) * 20
            target["keypoints"] = torch.cat([points, torch.ones(3, 17, 1)], dim=2)
        return image, target

    class PoolingHead(torch.nn.Module):
        # a conv backbone (with a DCNv2 block: dcnnet) and an R-FCN-style position-sensitive head
        # (psroihead) or a roi_pool head (roipoolhead, dcnnet)

        def __init__(self, kind):
            super().__init__()
            self.kind = kind
            self.backbone = torch.nn.Sequential(
                torch.nn.Conv2d(3, 32, 3, stride=2, padding=1), torch.nn.ReLU(),
                torch.nn.Conv2d(32, 3 * 9, 3, stride=2, padding=1),
            )
            self.classifier = torch.nn.Linear(27 * 9, 3)
            self.offset_mask = torch.nn.Conv2d(27, 27, 3, padding=1)
            self.deform_weight = torch.nn.Parameter(torch.randn(27, 27, 3, 3) * 0.05)

        def forward(self, images, targets):
            features = self.backbone(torch.stack(images))  # [B, 27, 40, 48]
            boxes = [target["boxes"] for target in targets]
            labels = torch.cat([target["labels"] for target in targets])
            if self.kind == "dcnnet":  # a DCNv2 block: offsets and mask predicted from the features
                offset_mask = self.offset_mask(features)
                offset, mask = offset_mask[:, :18], torch.sigmoid(offset_mask[:, 18:])
                deformed = torchvision.ops.deform_conv2d(features, offset, self.deform_weight, padding=1, mask=mask)
                features = torch.relu(deformed)
            if self.kind == "psroihead":
                scores = torchvision.ops.ps_roi_align(features, boxes, 3, 0.25, 2).mean((2, 3))  # [R, 3]
            else:
                scores = self.classifier(torchvision.ops.roi_pool(features, boxes, 3, 0.25).flatten(1))
            return {"classification": torch.nn.functional.cross_entropy(scores, labels)}

    class Detection(pl.LightningModule):
        def __init__(self):
            super().__init__()
            if model_name in ("psroihead", "roipoolhead", "dcnnet"):
                self.model = PoolingHead(model_name)
                return
            self.model = BUILDERS[model_name](
                weights=None, weights_backbone=None, num_classes=3, min_size=160, max_size=192
            )

        def training_step(self, batch, batch_index):
            images, targets = batch
            return sum(self.model(images, targets).values())

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    generator = torch.Generator().manual_seed(1)
    data = [sample(generator, i) for i in range(6)]
    loader = torch.utils.data.DataLoader(data, batch_size=2, collate_fn=lambda items: tuple(zip(*items)))
    trainer = pl.Trainer(accelerator="gpu", devices=1, max_steps=3, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False,
                         callbacks=[DeterminismCallback(seed=0)])
    module = Detection()
    trainer.fit(module, loader)
    digest = hashlib.sha256()
    for tensor in module.state_dict().values():
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    print("DIGEST", digest.hexdigest())
    """
)


def _digest(tmp_path, run_process, model_name):
    script = tmp_path / "train_detection.py"
    script.write_text(_SCRIPT)
    result = run_process([sys.executable, str(script), model_name], cwd=REPO)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return [line for line in result.stdout.splitlines() if line.startswith("DIGEST ")][-1].split()[1]


@pytest.mark.parametrize("model_name", ["fasterrcnn", "maskrcnn", "keypointrcnn", "psroihead", "roipoolhead", "dcnnet"])
def test_rcnn_trains_bitwise_reproducibly_under_the_plugin(tmp_path, run_process, model_name):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    assert _digest(tmp_path, run_process, model_name) == _digest(tmp_path, run_process, model_name)
