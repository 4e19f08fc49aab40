"""The patch_refused_ops switch of DeterminismCallback and configure()."""

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from deepep_lightning.determinism import DeterminismCallback, configure
from deepep_lightning.ops.routing import patch_refused_ops, refused_ops_patched


class _SeesRouting(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.routed_during_fit = None

    def training_step(self, batch, batch_idx):
        self.routed_during_fit = refused_ops_patched()
        image = batch[0].reshape(-1, 1, 2, 2)
        up = F.interpolate(image, scale_factor=2, mode="bilinear", align_corners=False)
        return self.layer(up.reshape(-1, 16)[:, :4]).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=4)


@pytest.mark.parametrize("enabled", [True, False])
def test_callback_routes_only_during_fit_and_restores(enabled, quiet_trainer):
    patch_refused_ops(False)
    module = _SeesRouting()
    trainer = quiet_trainer(
        max_steps=2,
        callbacks=[DeterminismCallback(seed=0, patch_refused_ops=enabled)],
    )
    trainer.fit(module)
    assert module.routed_during_fit is enabled
    assert refused_ops_patched() is False  # restored after fit


def test_configure_switch_installs_routing_and_rejects_non_bool():
    patch_refused_ops(False)
    try:
        configure(0, patch_refused_ops=True)
        assert refused_ops_patched()
    finally:
        patch_refused_ops(False)
        torch.use_deterministic_algorithms(False)
    with pytest.raises(MisconfigurationException, match="patch_refused_ops.*got 'yes'"):
        configure(0, patch_refused_ops="yes")
    with pytest.raises(MisconfigurationException, match="patch_refused_ops.*got 1"):
        DeterminismCallback(patch_refused_ops=1)
