"""GPU tests of the deterministic kernels behind the dispatcher routes: nll_loss2d forward (4-D
F.cross_entropy), adaptive avg pool 2-D/3-D, avg_pool3d, reflection/replication padding, linear 1-D,
bicubic and antialiased bilinear/bicubic interpolate, and trilinear 3-D / nearest 2-D and 3-D / bicubic 2-D
grid_sample backwards.

Per case: PyTorch refuses it in deterministic mode (negative control), the routed result equals PyTorch's
float64 CPU result to fp rounding, repeats bitwise x20, does not depend on the batch around a sample, and
runs under torch.compile and inside a CUDA graph."""

import pytest
import torch
import torch.nn.functional as F

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("cuda_kernels")]


def _inputs(shape, dtype, channels_last=False, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=generator, dtype=torch.float64)
    x = x.to("cuda", dtype)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d)
    return x.requires_grad_()


def _segmentation_target(n, h, w, classes, seed=1):
    target = torch.randint(0, classes, (n, h, w), generator=torch.Generator().manual_seed(seed))
    target[:, :2, :3] = -100
    return target.cuda()


def _volume_grid(x, spread=1.2, seed=3):
    generator = torch.Generator().manual_seed(seed)
    grid = (torch.rand(x.shape[0], 3, 4, 5, 3, generator=generator, dtype=torch.float64) * 2 - 1) * spread
    # multiples of 1/64: exact in every dtype, so nearest picks the same pixels as the float64 oracle
    return (grid * 64).round().div(64).to("cuda", x.dtype)


def _weight(classes):
    return (torch.rand(classes, generator=torch.Generator().manual_seed(2), dtype=torch.float64) + 0.5).cuda()


# name -> (input shape, loss of x as a scalar; per_sample: the op treats batch entries independently)
CASES = {
    "nll_loss2d_mean": ((4, 19, 33, 45), lambda x: F.cross_entropy(x, _segmentation_target(4, 33, 45, 19)), False),
    "nll_loss2d_sum_weight": (
        (4, 19, 33, 45),
        lambda x: F.cross_entropy(
            x, _segmentation_target(4, 33, 45, 19), weight=_weight(19).to(x.dtype), reduction="sum"
        ),
        False,
    ),
    "nll_loss2d_mean_weight_ignore": (
        (3, 5, 16, 16),
        lambda x: F.nll_loss(x.log_softmax(1), _segmentation_target(3, 16, 16, 5), weight=_weight(5).to(x.dtype)),
        False,
    ),
    "adaptive_avg_pool2d": ((4, 8, 17, 23), lambda x: (F.adaptive_avg_pool2d(x, 5) ** 2).sum(), True),
    "adaptive_avg_pool2d_upsampling": ((4, 8, 3, 5), lambda x: (F.adaptive_avg_pool2d(x, (7, 11)) ** 2).sum(), True),
    "interpolate_area": ((4, 8, 17, 23), lambda x: (F.interpolate(x, size=(6, 9), mode="area") ** 2).sum(), True),
    "adaptive_avg_pool3d": ((2, 4, 9, 10, 11), lambda x: (F.adaptive_avg_pool3d(x, (4, 3, 5)) ** 2).sum(), True),
    "avg_pool3d": ((2, 4, 9, 10, 11), lambda x: (F.avg_pool3d(x, 3, stride=2, padding=1) ** 2).sum(), True),
    "avg_pool3d_ceil_no_pad_count": (
        (2, 4, 9, 10, 11),
        lambda x: (
            F.avg_pool3d(x, (3, 2, 3), stride=(2, 1, 2), padding=1, ceil_mode=True, count_include_pad=False) ** 2
        ).sum(),
        True,
    ),
    "avg_pool3d_divisor": ((2, 4, 8, 8, 8), lambda x: (F.avg_pool3d(x, 3, 1, divisor_override=5) ** 2).sum(), True),
    "reflection_pad3d": ((2, 4, 6, 7, 8), lambda x: (F.pad(x, (2, 3, 1, 2, 3, 1), mode="reflect") ** 2).sum(), True),
    "reflection_pad1d_aten": ((2, 4, 9), lambda x: (torch._C._nn.reflection_pad1d(x, (4, 3)) ** 2).sum(), True),
    "replication_pad3d_aten": (
        (2, 4, 6, 7, 8),
        lambda x: torch._C._nn.replication_pad3d(x, (2, 3, 1, 2, 3, 1)).square().sum(),
        True,
    ),
    "replication_pad2d_aten": (
        (2, 4, 7, 8),
        lambda x: (torch._C._nn.replication_pad2d(x, (5, 2, 1, 4)) ** 2).sum(),
        True,
    ),
    "replication_pad1d_aten": ((2, 4, 9), lambda x: (torch._C._nn.replication_pad1d(x, (4, 11)) ** 2).sum(), True),
    "grid_sample_3d_zeros": (
        (2, 3, 5, 6, 7),
        lambda x: (F.grid_sample(x, _volume_grid(x), align_corners=False) ** 2).sum(),
        False,
    ),
    "grid_sample_3d_reflection_align": (
        (2, 3, 5, 6, 7),
        lambda x: (F.grid_sample(x, _volume_grid(x), padding_mode="reflection", align_corners=True) ** 2).sum(),
        False,
    ),
    "grid_sample_3d_border": (
        (2, 3, 5, 6, 7),
        lambda x: (F.grid_sample(x, _volume_grid(x), padding_mode="border", align_corners=False) ** 2).sum(),
        False,
    ),
    "grid_sample_3d_nearest": (
        (2, 3, 5, 6, 7),
        lambda x: (F.grid_sample(x, _volume_grid(x), mode="nearest", align_corners=False) ** 2).sum(),
        False,
    ),
    "grid_sample_2d_nearest_border": (
        (2, 3, 9, 11),
        lambda x: (
            F.grid_sample(x, _volume_grid(x)[:, 0, :, :, :2], mode="nearest", padding_mode="border", align_corners=True)
            ** 2
        ).sum(),
        False,
    ),
    "grid_sample_2d_bicubic_reflection": (
        (2, 3, 9, 11),
        lambda x: (
            F.grid_sample(
                x, _volume_grid(x)[:, 0, :, :, :2], mode="bicubic", padding_mode="reflection", align_corners=False
            )
            ** 2
        ).sum(),
        False,
    ),
    "interpolate_bilinear_antialias_down": (
        (2, 4, 23, 17),
        lambda x: (F.interpolate(x, scale_factor=0.3, mode="bilinear", antialias=True) ** 2).sum(),
        True,
    ),
    "interpolate_bicubic_antialias_align_corners": (
        (2, 4, 23, 17),
        lambda x: (F.interpolate(x, size=(9, 20), mode="bicubic", antialias=True, align_corners=True) ** 2).sum(),
        True,
    ),
    "interpolate_linear_1d": (
        (2, 4, 9),
        lambda x: (F.interpolate(x, scale_factor=2.5, mode="linear") ** 2).sum(),
        True,
    ),
    "interpolate_bicubic": (
        (2, 4, 9, 11),
        lambda x: (F.interpolate(x, scale_factor=2.5, mode="bicubic") ** 2).sum(),
        True,
    ),
    "interpolate_bicubic_align_corners_down": (
        (2, 4, 23, 17),
        lambda x: (F.interpolate(x, size=(7, 9), mode="bicubic", align_corners=True) ** 2).sum(),
        True,
    ),
    "interpolate_linear_1d_align_corners_down": (
        (2, 4, 37),
        lambda x: (F.interpolate(x, size=10, mode="linear", align_corners=True) ** 2).sum(),
        True,
    ),
}
DTYPES = {torch.float32: 1e-5, torch.float64: 1e-12, torch.float16: 2e-2, torch.bfloat16: 5e-2}


def _grad(loss_fn, x):
    loss = loss_fn(x)
    (grad,) = torch.autograd.grad(loss, x)
    return loss.detach(), grad


@pytest.mark.parametrize("case", sorted(CASES))
def test_pytorch_refuses_without_routing(case):
    from deepep_lightning.ops import patch_refused_ops

    shape, loss_fn, _ = CASES[case]
    patch_refused_ops(False)
    torch.use_deterministic_algorithms(True)
    with pytest.raises(RuntimeError, match="deterministic"):
        _grad(loss_fn, _inputs(shape, torch.float32))


@pytest.mark.parametrize("dtype", sorted(DTYPES, key=str))
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_float64_oracle(deterministic_routing, case, dtype):
    shape, loss_fn, _ = CASES[case]
    x = _inputs(shape, dtype)
    loss, grad = _grad(loss_fn, x)
    torch.use_deterministic_algorithms(False)
    x64 = x.detach().double().requires_grad_()
    want_loss, want_grad = _grad(loss_fn, x64)  # float64 CUDA: exact enough, whatever the order
    tolerance = DTYPES[dtype]
    scale = want_grad.abs().max().clamp_min(1e-30).item()
    torch.testing.assert_close(grad.double(), want_grad, rtol=tolerance, atol=tolerance * scale)
    torch.testing.assert_close(loss.double(), want_loss, rtol=tolerance, atol=tolerance * want_loss.abs().item())


@pytest.mark.parametrize("case", sorted(CASES))
def test_channels_last_and_non_contiguous(deterministic_routing, case):
    shape, loss_fn, _ = CASES[case]
    if len(shape) < 4:
        pytest.skip("no channels-last layout for 3-D input")
    x = _inputs(shape, torch.float32)
    _, want = _grad(loss_fn, x)
    channels_last = _inputs(shape, torch.float32, channels_last=True)
    _, got = _grad(loss_fn, channels_last)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    wide = _inputs((*shape[:-1], 2 * shape[-1]), torch.float32)
    sliced = wide[..., ::2]
    _, got = _grad(loss_fn, sliced)
    assert not sliced.is_contiguous()
    _, want = _grad(loss_fn, sliced.detach().contiguous().requires_grad_())
    assert torch.equal(got, want)


@pytest.mark.parametrize("case", sorted(CASES))
def test_bitwise_repeat_20(deterministic_routing, case):
    shape, loss_fn, _ = CASES[case]
    x = _inputs(shape, torch.float32)
    first_loss, first = _grad(loss_fn, x)
    for _ in range(19):
        loss, grad = _grad(loss_fn, x)
        assert torch.equal(grad, first) and torch.equal(loss, first_loss)


@pytest.mark.parametrize("case", sorted(name for name, (_, _, per_sample) in CASES.items() if per_sample))
def test_result_does_not_depend_on_the_batch_around_it(deterministic_routing, case):
    shape, loss_fn, _ = CASES[case]
    x = _inputs(shape, torch.float32)
    _, batched = _grad(loss_fn, x)
    _, alone = _grad(loss_fn, x.detach()[1:2].clone().requires_grad_())
    assert torch.equal(batched[1:2], alone)


def test_nll_loss2d_all_ignored_and_empty_batch_match_pytorch(deterministic_routing):
    x = _inputs((2, 3, 4, 4), torch.float32)
    ignored = torch.full((2, 4, 4), -100, device="cuda")
    assert torch.isnan(F.cross_entropy(x, ignored))  # 0 / 0, as PyTorch
    assert F.cross_entropy(x, ignored, reduction="sum").item() == 0.0
    empty = _inputs((0, 3, 4, 4), torch.float32)
    assert torch.isnan(F.cross_entropy(empty, torch.zeros(0, 4, 4, dtype=torch.long, device="cuda")))


def test_empty_batch_backwards(deterministic_routing):
    for name in (
        "adaptive_avg_pool3d",
        "avg_pool3d",
        "reflection_pad3d",
        "replication_pad3d_aten",
        "interpolate_bicubic",
        "interpolate_linear_1d",
        "grid_sample_3d_zeros",
        "grid_sample_2d_nearest_border",
        "grid_sample_2d_bicubic_reflection",
    ):
        shape, loss_fn, _ = CASES[name]
        x = _inputs((0, *shape[1:]), torch.float32)
        _, grad = _grad(loss_fn, x)
        assert grad.shape == x.shape


def test_uncovered_case_keeps_pytorchs_error(deterministic_routing):
    x = _inputs((1, 2, 6, 6, 6), torch.float32)
    _grad(lambda t: torch._C._nn.reflection_pad3d(t, (1, 2, 1, 1, 1, 1)).square().sum(), x)  # covered: routed
    with pytest.raises(RuntimeError, match="reflection_pad3d_backward.*deterministic"):
        # negative padding (cropping) is left to PyTorch's kernel, which refuses deterministic mode
        _grad(lambda t: torch._C._nn.reflection_pad3d(t, (-1, 2, 1, 1, 1, 1)).square().sum(), x)


@pytest.mark.parametrize("padding_mode", ["zeros", "border", "reflection"])
@pytest.mark.parametrize("mode, spatial", [("bilinear", 3), ("bicubic", 2)])
def test_decomposed_grid_sample_grid_gradient_matches_pytorch(deterministic_routing, padding_mode, mode, spatial):
    x = _inputs((2, 3, 5, 6, 7)[: spatial + 2], torch.float32)
    grid = _volume_grid(x) if spatial == 3 else _volume_grid(x)[:, 0, :, :, :2].contiguous()
    grid = grid.requires_grad_()
    grad_output = torch.randn(2, 3, *grid.shape[1:-1], device="cuda")

    def grads():
        out = F.grid_sample(x, grid, mode=mode, padding_mode=padding_mode, align_corners=False)
        return torch.autograd.grad(out, (x, grid), grad_output)

    first = grads()
    assert all(torch.equal(a, b) for a, b in zip(grads(), first))
    torch.use_deterministic_algorithms(False)
    want = grads()  # PyTorch's atomic kernel
    for got, expected in zip(first, want):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


def test_reflection_pad2d_backward_is_left_to_pytorchs_deterministic_kernel(cuda_kernels):
    from deepep_lightning.ops import patch_refused_ops, routed_aten_ops

    assert "reflection_pad2d_backward" not in routed_aten_ops()
    assert "reflection_pad3d_backward" in routed_aten_ops()
    patch_refused_ops(False)
    torch.use_deterministic_algorithms(True)
    x = _inputs((2, 4, 7, 8), torch.float32)
    loss_fn = lambda t: (torch._C._nn.reflection_pad2d(t, (3, 2, 1, 4)) ** 2).sum()  # noqa: E731
    _, first = _grad(loss_fn, x)  # PyTorch's own gather: no refusal
    for _ in range(5):
        assert torch.equal(_grad(loss_fn, x)[1], first)
    torch.use_deterministic_algorithms(False)
    _, want = _grad(loss_fn, x.detach().double().requires_grad_())
    torch.testing.assert_close(first.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("case", ["nll_loss2d_sum_weight", "adaptive_avg_pool2d", "avg_pool3d", "reflection_pad3d"])
def test_under_torch_compile(deterministic_routing, case):
    shape, loss_fn, _ = CASES[case]
    x = _inputs(shape, torch.float32)
    compiled = torch.compile(lambda t: torch.autograd.grad(loss_fn(t), t)[0], fullgraph=False)
    first = compiled(x)
    assert torch.equal(compiled(x), first)
    _, eager = _grad(loss_fn, x)
    torch.testing.assert_close(first, eager, rtol=1e-5, atol=1e-5)


def test_routes_inside_cuda_graph_capture(deterministic_routing):
    x = _inputs((4, 19, 33, 45), torch.float32).detach()
    target = _segmentation_target(4, 33, 45, 19)
    pooled_grad = torch.randn(4, 19, 5, 5, device="cuda")
    volume = torch.randn(2, 4, 6, 7, 8, device="cuda")
    volume_grad = torch.randn(2, 4, 8, 9, 10, device="cuda")

    def step():
        loss = F.cross_entropy(x, target)
        pool = torch.ops.aten._adaptive_avg_pool2d_backward(pooled_grad, x)
        pad = torch.ops.aten.reflection_pad3d_backward(volume_grad, volume, [1, 1, 1, 1, 1, 1])
        return loss, pool, pad

    eager = step()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(captured, eager):
        assert torch.equal(got, want)
