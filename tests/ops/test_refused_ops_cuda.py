"""GPU tests of the deterministic grid_sample backward kernel, the routing and a model trained with both ops
(the bilinear interpolate kernel: test_interpolate_cuda.py).

Run on the GPU machine: ``python -m pytest tests/ops/test_refused_ops_cuda.py -q``.
"""

import hashlib
import os
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _refused_cuda import _assert_close_relative, _atomic_backward, _grid_inputs

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("cuda_kernels")]

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
        # The aten op itself (F.interpolate takes PyTorch's decomposition in deterministic mode on CUDA).
        torch._C._nn.upsample_bilinear2d(x, None, False, [2.0, 2.0]).sum().backward()
        F.interpolate(x, scale_factor=2.0, mode="bilinear").sum().backward()
        F.grid_sample(x, grid, mode="bicubic", align_corners=False).sum().backward()  # routed (decomposed)
        F.interpolate(x, scale_factor=0.5, mode="bilinear", antialias=True).sum().backward()  # routed
        # Uncovered cases keep PyTorch's kernel and errors: cropping reflection_pad3d (its refusal), and a
        # bicubic 5-D grid_sample (its argument error).
        volume = x.detach()[:, :, :4, :4].unsqueeze(2).expand(-1, -1, 3, -1, -1).contiguous().requires_grad_()
        with pytest.raises(RuntimeError, match="deterministic"):
            torch._C._nn.reflection_pad3d(volume, (-1, 2, 1, 1, 1, 1)).sum().backward()
        with pytest.raises(RuntimeError, match="bicubic"):
            F.grid_sample(volume, torch.zeros(x.shape[0], 1, 1, 1, 3, device="cuda"), mode="bicubic")


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


def test_model_trains_bitwise_reproducibly_in_two_processes(tmp_path, run_process):
    script = tmp_path / "train_stn.py"
    script.write_text(_TRAIN_SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    digests = []
    for _ in range(2):
        result = run_process([sys.executable, str(script)], env=env, cwd=str(REPO))
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        lines = [line for line in result.stdout.splitlines() if line.startswith("DIGEST ")]
        assert lines, result.stdout[-3000:]
        digests.append(lines[-1].split()[1])
    assert digests[0] == digests[1]
    assert digests[0] != hashlib.sha256(b"").hexdigest()  # something was hashed


@pytest.mark.parametrize("shape", GRID_SHAPES)
@pytest.mark.parametrize("padding_mode", PADDINGS)
@pytest.mark.parametrize("align_corners", [False, True])
def test_grid_sample_repeats_bitwise_and_matches_references(shape, padding_mode, align_corners):
    """Every shape, padding and align_corners, on another draw than the first test: three backward
    calls on one graph are bitwise equal; grad_grid (no reduction across points) matches PyTorch's
    kernel, grad_input a float64 CPU oracle."""
    from deepep_lightning.ops import grid_sample

    x, grid = _grid_inputs(shape, seed=1)
    kwargs = dict(padding_mode=padding_mode, align_corners=align_corners)
    out = grid_sample(x, grid, **kwargs)
    grad_output = torch.randn_like(out)
    first = torch.autograd.grad(out, (x, grid), grad_output, retain_graph=True)
    for _ in range(2):
        again = torch.autograd.grad(out, (x, grid), grad_output, retain_graph=True)
        assert all(torch.equal(a, b) for a, b in zip(again, first))
    theirs = _atomic_backward(lambda x_, grid_: F.grid_sample(x_, grid_, **kwargs), (x, grid), grad_output)
    _assert_close_relative(first[1], theirs[1])
    x64, grid64 = x.detach().double().cpu().requires_grad_(), grid.detach().double().cpu()
    oracle = torch.autograd.grad(F.grid_sample(x64, grid64, **kwargs), x64, grad_output.double().cpu())[0]
    _assert_close_relative(first[0].double().cpu(), oracle, rtol=1e-4)


@pytest.mark.parametrize("channels", [1, 2, 4, 5, 8, 9, 17, 64])
def test_grid_sample_channel_groupings(channels):
    """C == 1 (grad_output read in place), 4 or 8 channels per thread, partial last groups."""
    from deepep_lightning.ops import grid_sample

    x, grid = _grid_inputs((3, channels, 9, 13, 11, 7, -1.1, 1.1), seed=channels)
    out = grid_sample(x, grid, padding_mode="zeros", align_corners=False)
    grad_output = torch.randn_like(out)
    ours = torch.autograd.grad(out, (x, grid), grad_output, retain_graph=True)
    again = torch.autograd.grad(out, (x, grid), grad_output)
    assert torch.equal(again[0], ours[0]) and torch.equal(again[1], ours[1])
    theirs = _atomic_backward(lambda x_, grid_: F.grid_sample(x_, grid_, align_corners=False), (x, grid), grad_output)
    _assert_close_relative(ours[0], theirs[0])
    _assert_close_relative(ours[1], theirs[1])
    x64, grid64 = x.detach().double().cpu().requires_grad_(), grid.detach().double().cpu().requires_grad_()
    oracle = torch.autograd.grad(
        F.grid_sample(x64, grid64, align_corners=False), (x64, grid64), grad_output.double().cpu()
    )
    _assert_close_relative(ours[0].double().cpu(), oracle[0], rtol=1e-4)
    _assert_close_relative(ours[1].double().cpu(), oracle[1], rtol=1e-4)


@pytest.mark.parametrize("points", [(1, 31), (1, 32), (1, 33), (8, 8), (5, 13), (40, 50)])
def test_grid_sample_chunked_segments_match_oracle(points):
    """Segments of 31, 32, 33, 64, 65 and 2000 points: the full 32-point chunks are pre-summed,
    the tail walked point by point; every term must be counted exactly once."""
    from deepep_lightning.ops import grid_sample

    ho, wo = points
    for low, high in ((0.3, 0.3), (-0.15, 0.15)):  # one cell; a few neighbouring cells
        x, grid = _grid_inputs((3, 5, 6, 7, ho, wo, low, high), seed=ho * wo)
        out = grid_sample(x, grid, padding_mode="zeros", align_corners=False)
        grad_output = torch.randn_like(out)
        ours = torch.autograd.grad(out, (x, grid), grad_output)
        x64, grid64 = x.detach().double().cpu().requires_grad_(), grid.detach().double().cpu().requires_grad_()
        oracle = torch.autograd.grad(
            F.grid_sample(x64, grid64, align_corners=False), (x64, grid64), grad_output.double().cpu()
        )
        _assert_close_relative(ours[0].double().cpu(), oracle[0], rtol=1e-5)
        _assert_close_relative(ours[1].double().cpu(), oracle[1], rtol=1e-4)


def test_grid_sample_chunked_result_does_not_depend_on_the_batch_around_it():
    """Chunks start at each cell's own segment start: another batch around a heavily overlapped
    sample shifts its segments in the sorted array but must not change a bit."""
    from deepep_lightning.ops import grid_sample

    x, grid = _grid_inputs((4, 6, 16, 16, 57, 43, -0.2, 0.2), seed=5)
    grad_output = torch.randn(4, 6, 57, 43, device="cuda")
    batch = torch.autograd.grad(grid_sample(x, grid, align_corners=False), (x, grid), grad_output)
    for i in (1, 3):
        x2, grid2 = x.detach()[i : i + 1].clone().requires_grad_(), grid.detach()[i : i + 1].clone().requires_grad_()
        single = torch.autograd.grad(grid_sample(x2, grid2, align_corners=False), (x2, grid2), grad_output[i : i + 1])
        assert torch.equal(batch[0][i : i + 1], single[0]) and torch.equal(batch[1][i : i + 1], single[1])


def test_result_does_not_depend_on_the_batch_around_it():
    """Another batch size means another launch configuration (grid, sort length, tiles): the
    gradients of one sample must not change by a bit."""
    from deepep_lightning.ops import grid_sample, interpolate

    x, grid = _grid_inputs((5, 6, 20, 24, 30, 18, -1.1, 1.1), seed=3)
    grad_output = torch.randn(5, 6, 30, 18, device="cuda")
    batch = torch.autograd.grad(grid_sample(x, grid, align_corners=False), (x, grid), grad_output)
    x2, grid2 = x.detach()[2:3].clone().requires_grad_(), grid.detach()[2:3].clone().requires_grad_()
    single = torch.autograd.grad(grid_sample(x2, grid2, align_corners=False), (x2, grid2), grad_output[2:3])
    assert torch.equal(batch[0][2:3], single[0]) and torch.equal(batch[1][2:3], single[1])

    up = interpolate(x, size=(70, 45), mode="bilinear", align_corners=False)
    g_up = torch.randn_like(up)
    batch_up = torch.autograd.grad(up, x, g_up)[0]
    single_up = torch.autograd.grad(
        interpolate(x2, size=(70, 45), mode="bilinear", align_corners=False), x2, g_up[2:3]
    )[0]
    assert torch.equal(batch_up[2:3], single_up)


def _hand_back_nan(*likes):
    """Free NaN-filled blocks of these sizes, so the next allocations of those sizes likely reuse them."""
    torch.cuda.synchronize()
    poison = [torch.full_like(like, float("nan")) for like in likes]
    del poison


def test_writes_every_gradient_element():
    """The kernels skip at::empty's deterministic-mode NaN fill, so an element they forgot would keep
    whatever the caching allocator hands back. Hand back NaN: the gradients must still be finite."""
    from deepep_lightning.ops import grid_sample, interpolate

    torch.use_deterministic_algorithms(False)  # torch.empty_like below must not fill
    x, grid = _grid_inputs((2, 5, 16, 12, 9, 11, -1.3, 1.3), seed=4)
    out = grid_sample(x, grid, padding_mode="zeros", align_corners=False)
    up = interpolate(x, size=(37, 5), mode="bilinear", align_corners=True)
    g_out, g_up = torch.randn_like(out), torch.randn_like(up)
    # Control: the caching allocator does hand a freed NaN block of the same size back unwritten.
    _hand_back_nan(x)
    probe = torch.empty_like(x)
    if not torch.isnan(probe).all():
        pytest.skip("the caching allocator did not reuse the poisoned block; nothing to conclude")
    del probe
    for _ in range(3):
        _hand_back_nan(grid, x)  # allocated in this order by the backward: grad_grid, then grad_input
        grad_x, grad_grid = torch.autograd.grad(out, (x, grid), g_out, retain_graph=True)
        assert torch.isfinite(grad_x).all() and torch.isfinite(grad_grid).all()
        del grad_x, grad_grid
        _hand_back_nan(x)
        assert torch.isfinite(torch.autograd.grad(up, x, g_up, retain_graph=True)[0]).all()
