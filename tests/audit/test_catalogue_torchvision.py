"""The torchvision family of the L1 catalogue (deepep_lightning/audit/catalogue/torchvision.py): its entries
name routes that exist, run reproducibly on CPU, and on CUDA the plugin column makes them reproducible."""

import pytest
import torch

pytest.importorskip("torchvision")

from deepep_lightning.audit import audit_catalogue  # noqa: E402
from deepep_lightning.audit.catalogue import CATALOGUE  # noqa: E402
from deepep_lightning.ops import extension_available, routed_aten_ops  # noqa: E402

ENTRIES = [
    "roi_align_backward",
    "roi_align_adaptive_backward",
    "roi_pool_backward",
    "ps_roi_align_backward",
    "ps_roi_pool_backward",
    "deform_conv2d_backward",
]


def test_entries_name_registered_routes():
    if not extension_available():
        pytest.skip("deepep_lightning extension not buildable here")
    routes = set(routed_aten_ops())
    for name in ENTRIES:
        assert CATALOGUE[name].routed and set(CATALOGUE[name].routed) <= routes, name


def test_entries_are_reproducible_on_cpu():
    table = audit_catalogue(ENTRIES, device="cpu", repeats=2, columns=["default"])
    assert all(table["rows"][name]["default"]["status"] == "reproducible" for name in ENTRIES), table["rows"]


@pytest.mark.gpu
def test_plugin_column_makes_them_reproducible_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    table = audit_catalogue(ENTRIES, device="cuda", repeats=20, columns=["deterministic", "plugin"])
    for name in ENTRIES:
        assert table["rows"][name]["plugin"]["status"] == "reproducible", (name, table["rows"][name])
