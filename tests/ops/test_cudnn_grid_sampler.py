"""cuDNN's grid sampler backward, the op that ran silently non-deterministically (ops/grid_sample.py route).

``F.grid_sample`` takes ``aten::cudnn_grid_sampler`` for 4-D bilinear input with zeros padding and
``align_corners=True``; its backward adds with atomics and PyTorch's deterministic mode does not flag it.
The route serves it with the deterministic bilinear backward. CPU: the route's argument mapping against
PyTorch's bilinear backward. GPU (marked): bitwise x20 under the route while cuDNN's own backward differs,
equal to it to fp rounding, and RAFT-small (torchvision) bitwise in two fresh processes under
DeterminismCallback while plain deterministic mode differs, with the audit naming the op and its caller.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from deepep_lightning.ops import extension_available, refused_ops_routing, routed_aten_ops
from deepep_lightning.ops.grid_sample import _cudnn_backward_route, _cudnn_backward_route_covers


def _sampler_inputs(device: str, dtype: torch.dtype, n: int = 2, channels: int = 3, size: int = 9, out: int = 7):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, channels, size, size, generator=generator, dtype=torch.float64).to(device, dtype)
    grid = (torch.rand(n, out, out, 2, generator=generator, dtype=torch.float64) * 2.2 - 1.1).to(device, dtype)
    grad = torch.randn(n, channels, out, out, generator=generator, dtype=torch.float64).to(device, dtype)
    return x, grid, grad


def test_the_cudnn_sampler_backward_is_a_route():
    assert "cudnn_grid_sampler_backward" in routed_aten_ops()


@pytest.mark.skipif(not extension_available(), reason="deepep_lightning extension not buildable here")
def test_route_computes_the_zeros_padding_align_corners_backward():
    x, grid, grad = _sampler_inputs("cpu", torch.float64)
    assert _cudnn_backward_route_covers(x, grid, grad) is None
    grad_x, grad_grid = _cudnn_backward_route(x, grid, grad)

    def reference(align_corners: bool):
        return torch.ops.aten.grid_sampler_2d_backward(grad, x, grid, 0, 0, align_corners, [True, True])

    want_x, want_grid = reference(True)
    assert torch.equal(grad_x, want_x) and torch.equal(grad_grid, want_grid)
    assert not torch.equal(grad_x, reference(False)[0])  # negative control: the mapping is observable


def test_route_leaves_uncovered_cases_to_cudnn():
    x, grid, grad = _sampler_inputs("cpu", torch.float64)
    assert "dtype" in _cudnn_backward_route_covers(x.int(), grid, grad)
    assert "does not match" in _cudnn_backward_route_covers(x, grid, grad[:, :1])


def _cudnn_grads(x, grid, grad):
    x = x.detach().requires_grad_()
    grid = grid.detach().requires_grad_()
    out = F.grid_sample(x, grid, mode="bilinear", padding_mode="zeros", align_corners=True)
    return torch.autograd.grad(out, (x, grid), grad)


@pytest.mark.gpu
@pytest.mark.usefixtures("cuda_kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
def test_gpu_route_is_bitwise_where_cudnn_differs(dtype):
    x, grid, grad = _sampler_inputs("cuda", dtype, n=4, channels=32, size=64, out=128)
    torch.use_deterministic_algorithms(True)
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            plain = [_cudnn_grads(x, grid, grad) for _ in range(10)]
        assert any("cudnn_grid_sampler" in e.name for e in profile.events())  # the cuDNN path is the one taken
        # negative control: cuDNN's atomics under PyTorch's deterministic mode, no error, different bits
        assert any(not torch.equal(plain[0][0], p[0]) for p in plain[1:])
        with refused_ops_routing(True):
            routed = [_cudnn_grads(x, grid, grad) for _ in range(20)]
    finally:
        torch.use_deterministic_algorithms(False)
    for grads in routed[1:]:
        assert all(torch.equal(a, b) for a, b in zip(routed[0], grads))
    tolerance = {torch.float16: 2e-2, torch.float32: 1e-4, torch.float64: 1e-10}[dtype]
    for a, b in zip(routed[0], plain[0]):
        torch.testing.assert_close(a, b, rtol=tolerance, atol=tolerance)


_RAFT_RUN = """
import hashlib, json, sys
import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torchvision.models.optical_flow import raft_small
from deepep_lightning import DeterminismCallback

plugin = sys.argv[2] == "plugin"


class Flow(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = raft_small(weights=None)
        self.losses = []

    def training_step(self, batch, batch_idx):
        image1, image2, flow = batch
        loss = sum(F.l1_loss(p, flow) for p in self.net(image1, image2, num_flow_updates=4))
        self.losses.append(float(loss))
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        data = torch.utils.data.TensorDataset(
            torch.rand(12, 3, 128, 128, generator=g) * 2 - 1, torch.rand(12, 3, 128, 128, generator=g) * 2 - 1,
            torch.randn(12, 2, 128, 128, generator=g),
        )
        return torch.utils.data.DataLoader(data, batch_size=2)


pl.seed_everything(0, verbose=False)
module = Flow()
trainer = pl.Trainer(
    accelerator="cuda", devices=1, max_steps=6, logger=False, enable_checkpointing=False, enable_progress_bar=False,
    enable_model_summary=False, deterministic=None if plugin else True,
    callbacks=[DeterminismCallback(0)] if plugin else [],
)
trainer.fit(module)
digest = hashlib.sha256()
for tensor in module.state_dict().values():
    digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
json.dump({"digest": digest.hexdigest(), "losses": module.losses}, open(sys.argv[1], "w"))
"""


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.usefixtures("cuda_kernels")
def test_gpu_raft_trains_bitwise_under_the_callback_while_deterministic_mode_differs(tmp_path: Path, fit_process):
    pytest.importorskip("torchvision")
    script = tmp_path / "raft_run.py"
    script.write_text(textwrap.dedent(_RAFT_RUN))
    results = {}
    for run in ("plugin_a", "plugin_b", "plain_a", "plain_b"):
        out = tmp_path / f"{run}.json"
        process = fit_process(script, [str(out), run.split("_")[0]], log_path=tmp_path / f"{run}.txt")
        assert process.wait() == 0, process.output_tail()
        results[run] = json.loads(out.read_text())
    assert results["plugin_a"] == results["plugin_b"]
    assert results["plain_a"]["digest"] != results["plain_b"]["digest"]  # Trainer(deterministic=True) alone


@pytest.mark.gpu
@pytest.mark.usefixtures("cuda_kernels")
def test_gpu_audit_names_the_cudnn_sampler_and_raft_correlation_lookup():
    pytest.importorskip("torchvision")
    from torchvision.models.optical_flow import raft_small

    from deepep_lightning.audit.op_hashes import locate

    torch.manual_seed(0)
    net = raft_small(weights=None).cuda()
    g = torch.Generator().manual_seed(0)
    image1, image2 = ((torch.rand(2, 3, 128, 128, generator=g) * 2 - 1).cuda() for _ in range(2))

    def make_run():
        net.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        return net, lambda: net(image1, image2, num_flow_updates=2)[-1].square().mean().backward()

    torch.use_deterministic_algorithms(True)
    try:
        divergence, _ = locate(make_run, attempts=6)
    finally:
        torch.use_deterministic_algorithms(False)
    assert divergence is not None and divergence.op == "aten.cudnn_grid_sampler_backward.default"
    assert divergence.cause == "atomic accumulation" and "does not flag it" in divergence.explanation
    assert "raft.py" in divergence.forward_caller and "index_pyramid" in divergence.forward_caller
