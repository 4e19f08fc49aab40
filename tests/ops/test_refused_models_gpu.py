"""End-to-end GPU test: a tiny segmentation net (Conv -> AdaptiveAvgPool2d(5) -> bilinear upsample -> 4-D
F.cross_entropy) trains bitwise reproducibly under DeterminismCallback in two fresh processes, while
Trainer(deterministic=True) refuses it (PyTorch's nll_loss2d / adaptive-pool errors)."""

import os
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
    mode = sys.argv[1]
    from deepep_lightning.determinism import DeterminismCallback, configure
    if mode == "plugin":
        configure(seed=0)  # before CUDA starts
    import lightning.pytorch as pl
    import torch
    import torch.nn.functional as F
    from torch import nn

    class TinySegmentation(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.features = nn.Conv2d(3, 16, 3, padding=1)
            self.pool = nn.AdaptiveAvgPool2d(5)
            self.classifier = nn.Conv2d(16, 6, 1)

        def forward(self, images):  # [B, 3, 32, 32] -> [B, 6, 32, 32]
            context = self.pool(F.relu(self.features(images)))  # [B, 16, 5, 5]
            logits = self.classifier(context)  # [B, 6, 5, 5]
            return F.interpolate(logits, size=images.shape[-2:], mode="bilinear", align_corners=False)

        def training_step(self, batch, batch_index):
            images, masks = batch
            return F.cross_entropy(self(images), masks, ignore_index=255)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    generator = torch.Generator().manual_seed(1)
    masks = torch.randint(0, 6, (64, 32, 32), generator=generator)
    masks[:, :3] = 255
    data = torch.utils.data.TensorDataset(torch.randn(64, 3, 32, 32, generator=generator), masks)
    common = dict(accelerator="gpu", devices=1, max_steps=10, logger=False, enable_progress_bar=False,
                  enable_model_summary=False, enable_checkpointing=False)
    if mode == "plugin":
        trainer = pl.Trainer(callbacks=[DeterminismCallback(seed=0)], **common)
    else:
        pl.seed_everything(0)
        trainer = pl.Trainer(deterministic=True, **common)
    model = TinySegmentation()
    try:
        trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=16))
    except RuntimeError as error:
        print("RAISED", str(error).splitlines()[0])
        sys.exit(3)
    digest = hashlib.sha256()
    for tensor in model.state_dict().values():
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    print("DIGEST", digest.hexdigest())
    """
)


def _run(run_process, tmp_path, mode):
    script = tmp_path / "train_segmentation.py"
    script.write_text(_SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return run_process([sys.executable, str(script), mode], env=env, cwd=str(REPO))


@pytest.fixture
def gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")


def test_segmentation_net_trains_bitwise_reproducibly_under_the_plugin(gpu, tmp_path, run_process):
    digests = []
    for _ in range(2):
        result = _run(run_process, tmp_path, "plugin")
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        digests.append([line for line in result.stdout.splitlines() if line.startswith("DIGEST ")][-1].split()[1])
    assert digests[0] == digests[1]


def test_lightning_deterministic_trainer_refuses_the_segmentation_net(gpu, tmp_path, run_process):
    result = _run(run_process, tmp_path, "lightning")
    assert result.returncode == 3, result.stdout[-3000:] + result.stderr[-3000:]
    assert "does not have a deterministic implementation" in result.stdout
