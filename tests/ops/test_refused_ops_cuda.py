"""GPU tests of the deterministic grid_sample / bilinear interpolate backward kernels.

Run on the GPU machine: ``python -m pytest tests/ops/test_refused_ops_cuda.py -q``.
"""

import hashlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]
PADDINGS = ("zeros", "border", "reflection")
# (N, C, H_in, W_in, H_out, W_out, grid low, grid high): sample points uniform in [low, high]^2.
GRID_SHAPES = [
    (2, 3, 16, 16, 24, 24, -1.2, 1.2),
    (4, 16, 32, 48, 64, 64, -1.0, 1.0),
    (2, 8, 8, 8, 64, 64, -0.1, 0.1),  # heavy overlap: 4096 points on the same 4 pixels
    (1, 4, 4, 4, 128, 128, 0.3, 0.3),  # 16k identical points
    (3, 5, 64, 64, 8, 8, -1.0, 1.0),  # sparse: most pixels get nothing
]


@pytest.fixture(autouse=True)
def _cuda_kernels():
    from deepep_lightning.ops import cuda_kernels_available

    if not torch.cuda.is_available() or not cuda_kernels_available():
        pytest.skip("needs CUDA and the compiled deepep CUDA kernels")
    was = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(was)


def _grid_inputs(shape, seed=0, dtype=torch.float32):
    n, c, h, w, ho, wo, low, high = shape
    generator = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(n, c, h, w, device="cuda", dtype=dtype, generator=generator).requires_grad_()
    grid = torch.rand(n, ho, wo, 2, device="cuda", dtype=dtype, generator=generator) * (high - low) + low
    return x, grid.requires_grad_()


def _assert_close_relative(actual, expected, rtol=1e-5):
    scale = expected.abs().max().clamp_min(1e-30)
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=rtol * scale.item())


def _grads(fn, leaves, grad_output):
    return torch.autograd.grad(fn(), leaves, grad_output)


@pytest.mark.parametrize("shape", GRID_SHAPES)
@pytest.mark.parametrize("padding_mode", PADDINGS)
@pytest.mark.parametrize("align_corners", [False, True])
def test_grid_sample_matches_pytorch_atomic_backward(shape, padding_mode, align_corners):
    from deepep_lightning.ops import grid_sample

    x, grid = _grid_inputs(shape)
    kwargs = dict(padding_mode=padding_mode, align_corners=align_corners)
    ours = grid_sample(x, grid, **kwargs)
    torch.use_deterministic_algorithms(False)
    theirs = F.grid_sample(x, grid, **kwargs)
    assert torch.equal(ours, theirs)  # same forward kernel
    grad_output = torch.randn_like(ours)
    ours_dx, ours_dgrid = torch.autograd.grad(ours, (x, grid), grad_output)
    theirs_dx, theirs_dgrid = torch.autograd.grad(theirs, (x, grid), grad_output)
    _assert_close_relative(ours_dx, theirs_dx)
    _assert_close_relative(ours_dgrid, theirs_dgrid)
    # And both against a float64 CPU oracle.
    x64, grid64 = x.detach().double().cpu().requires_grad_(), grid.detach().double().cpu().requires_grad_()
    oracle = torch.autograd.grad(F.grid_sample(x64, grid64, **kwargs), (x64, grid64), grad_output.double().cpu())
    _assert_close_relative(ours_dx.double().cpu(), oracle[0], rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_grid_sample_other_dtypes(dtype):
    from deepep_lightning.ops import grid_sample

    x, grid = _grid_inputs(GRID_SHAPES[0], dtype=dtype)
    ours = grid_sample(x, grid, align_corners=False)
    grad_output = torch.randn_like(ours)
    ours_dx = torch.autograd.grad(ours, x, grad_output)[0].double()
    x64, grid64 = x.detach().double().requires_grad_(), grid.detach().double()
    oracle = torch.autograd.grad(F.grid_sample(x64, grid64, align_corners=False), x64, grad_output.double())[0]
    _assert_close_relative(ours_dx, oracle, rtol=1e-12 if dtype == torch.float64 else 2e-2)


def test_bitwise_repeat_100_runs():
    from deepep_lightning.ops import grid_sample, interpolate

    x, grid = _grid_inputs(GRID_SHAPES[2])
    out = grid_sample(x, grid, align_corners=False)
    up = interpolate(x, scale_factor=3.7, mode="bilinear", align_corners=False)
    g_out, g_up = torch.randn_like(out), torch.randn_like(up)
    first = torch.autograd.grad(out, (x, grid), g_out, retain_graph=True)
    first_up = torch.autograd.grad(up, x, g_up, retain_graph=True)[0]
    for _ in range(100):
        again = torch.autograd.grad(out, (x, grid), g_out, retain_graph=True)
        assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])
        assert torch.equal(torch.autograd.grad(up, x, g_up, retain_graph=True)[0], first_up)


INTERPOLATE_CASES = [  # (N, C, H, W, kwargs)
    (2, 3, 16, 16, dict(scale_factor=2.0)),
    (4, 8, 33, 47, dict(size=(100, 70))),
    (2, 4, 64, 64, dict(size=(21, 30))),  # downsampling
    (2, 4, 17, 19, dict(scale_factor=2.3)),  # kernel scale 1/2.3, not H_out / H
    (2, 4, 17, 19, dict(scale_factor=2.3, recompute_scale_factor=True)),
    (1, 2, 8, 8, dict(size=(256, 256))),  # heavy overlap: 32x32 outputs per input pixel
]


@pytest.mark.parametrize("case", INTERPOLATE_CASES)
@pytest.mark.parametrize("align_corners", [False, True])
def test_interpolate_matches_pytorch_atomic_backward(case, align_corners):
    from deepep_lightning.ops import interpolate

    n, c, h, w, kwargs = case
    x = torch.randn(n, c, h, w, device="cuda", requires_grad=True)
    kwargs = dict(kwargs, mode="bilinear", align_corners=align_corners)
    ours = interpolate(x, **kwargs)
    torch.use_deterministic_algorithms(False)  # PyTorch's native (atomic) kernels
    theirs = F.interpolate(x, **kwargs)
    assert torch.equal(ours, theirs)
    grad_output = torch.randn_like(ours)
    _assert_close_relative(torch.autograd.grad(ours, x, grad_output)[0], torch.autograd.grad(theirs, x, grad_output)[0])


def test_deterministic_mode_routing_and_negative_controls():
    from deepep_lightning.ops import refused_ops_routing

    x, grid = _grid_inputs(GRID_SHAPES[0])
    torch.use_deterministic_algorithms(True)
    # Negative control: PyTorch itself refuses this backward (the reason for the kernels).
    with pytest.raises(RuntimeError, match="deterministic"):
        F.grid_sample(x, grid, align_corners=False).sum().backward()
    with refused_ops_routing():
        F.grid_sample(x, grid, align_corners=False).sum().backward()  # routed: no error
        assert x.grad is not None and grid.grad is not None
        up = F.interpolate(x, scale_factor=2.0, mode="bilinear")
        assert "deepep_upsample" in type(up.grad_fn).__name__
        up.sum().backward()
        # Uncovered case: still PyTorch's kernel and PyTorch's error.
        with pytest.raises(RuntimeError, match="deterministic"):
            F.grid_sample(x, grid, mode="bicubic", align_corners=False).sum().backward()


_TRAIN_SCRIPT = textwrap.dedent(
    """
    import contextlib, hashlib, sys
    from deepep_lightning.determinism import DeterminismCallback, configure
    configure(seed=0)  # before CUDA starts
    import lightning.pytorch as pl
    import torch
    import torch.nn.functional as F
    from torch import nn
    from deepep_lightning.ops import refused_ops_routing

    class SpatialTransformerNet(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.features = nn.Conv2d(3, 8, 3, padding=1)
            self.localisation = nn.Linear(8, 6)
            self.head = nn.Linear(8, 4)

        def forward(self, images):  # [B, 3, 16, 16]
            features = F.relu(self.features(images))  # [B, 8, 16, 16]
            identity = torch.tensor([1.0, 0, 0, 0, 1.0, 0], device=images.device)
            theta = (0.1 * self.localisation(features.mean((2, 3))) + identity).view(-1, 2, 3)
            grid = F.affine_grid(theta, (images.shape[0], 8, 24, 24), align_corners=False)
            warped = F.grid_sample(features, grid, padding_mode="border", align_corners=False)
            upsampled = F.interpolate(warped, scale_factor=2, mode="bilinear", align_corners=False)
            return self.head(upsampled.mean((2, 3)))  # [B, 4]

        def training_step(self, batch, batch_index):
            images, labels = batch
            return F.cross_entropy(self(images), labels)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    generator = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(128, 3, 16, 16, generator=generator),
                                          torch.randint(0, 4, (128,), generator=generator))
    try:
        callback = DeterminismCallback(seed=0, patch_refused_ops=True)
        routing = contextlib.nullcontext()
    except TypeError:  # callback without the switch: route by hand
        callback = DeterminismCallback(seed=0)
        routing = refused_ops_routing()
    model = SpatialTransformerNet()
    trainer = pl.Trainer(accelerator="gpu", devices=1, max_steps=12, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, callbacks=[callback])
    with routing:
        trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=16))
    digest = hashlib.sha256()
    for tensor in model.state_dict().values():
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    print("DIGEST", digest.hexdigest())
    """
)


def test_model_trains_bitwise_reproducibly_in_two_processes(tmp_path):
    script = tmp_path / "train_stn.py"
    script.write_text(_TRAIN_SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    digests = []
    for _ in range(2):
        result = subprocess.run([sys.executable, str(script)], env=env, cwd=str(REPO), capture_output=True,
                                text=True, timeout=600)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        lines = [line for line in result.stdout.splitlines() if line.startswith("DIGEST ")]
        assert lines, result.stdout[-3000:]
        digests.append(lines[-1].split()[1])
    assert digests[0] == digests[1]
    assert digests[0] != hashlib.sha256(b"").hexdigest()  # something was hashed
