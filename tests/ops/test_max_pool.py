"""CPU tests of the argmax-scatter routes (max pool backwards, max_unpool, embedding_bag "max"): their arithmetic,
run on CPU tensors through segment_scatter_add's CPU kernel, equals PyTorch's CPU kernels."""

import pytest
import torch
import torch.nn.functional as F

from deepep_lightning.ops import extension_available
from deepep_lightning.ops import max_pool as max_pool_module
from deepep_lightning.ops._routes import registered_routes

needs_extension = pytest.mark.skipif(not extension_available(), reason="needs the compiled deepep_lightning extension")
aten = torch.ops.aten

ROUTED = (
    "adaptive_max_pool2d_backward",
    "adaptive_max_pool3d_backward",
    "max_pool3d_with_indices_backward",
    "fractional_max_pool2d_backward",
    "fractional_max_pool3d_backward",
    "max_unpool2d",
    "max_unpool3d",
    "_embedding_bag_dense_backward",
)


def _randn(*shape, seed=0):
    return torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


@needs_extension
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("unbatched", [False, True])
def test_adaptive_max_pool2d_backward(channels_last, unbatched):
    x = _randn(2, 3, 9, 7)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    if unbatched:
        x = x[0]
    out, indices = F.adaptive_max_pool2d(x, (4, 3), return_indices=True)
    grad = _randn(*out.shape, seed=1)
    expected = aten.adaptive_max_pool2d_backward(grad, x, indices)
    ours = max_pool_module._adaptive2d(grad, x, indices)
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-15)
    assert ours.stride() == expected.stride()


@needs_extension
def test_overlapping_windows_sum_every_contribution():
    """Stride 1, kernel 3: one input element is the max of up to 9 windows; a dropped term must show."""
    x = _randn(1, 2, 6, 6, 6)
    args = ([3, 3, 3], [1, 1, 1], [1, 1, 1], [1, 1, 1], False)
    out, indices = F.max_pool3d(x, 3, stride=1, padding=1, return_indices=True)
    grad = _randn(*out.shape, seed=1)
    expected = aten.max_pool3d_with_indices_backward(grad, x, *args, indices)
    ours = max_pool_module._max_pool3d(grad, x, *args, indices)
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-14)
    dropped = grad.clone()
    dropped.view(-1)[0] = 0
    assert not torch.allclose(max_pool_module._max_pool3d(dropped, x, *args, indices), expected)  # negative control


@needs_extension
def test_adaptive3d_and_fractional_backwards():
    v = _randn(2, 2, 7, 6, 5)
    out, indices = F.adaptive_max_pool3d(v, (3, 2, 4), return_indices=True)
    grad = _randn(*out.shape, seed=1)
    torch.testing.assert_close(
        max_pool_module._adaptive3d(grad, v, indices), aten.adaptive_max_pool3d_backward(grad, v, indices)
    )
    x = _randn(2, 3, 11, 11)
    out, indices = F.fractional_max_pool2d(x, 3, output_size=5, return_indices=True)
    grad = _randn(*out.shape, seed=2)
    torch.testing.assert_close(
        max_pool_module._fractional2d(grad, x, [3, 3], [5, 5], indices),
        aten.fractional_max_pool2d_backward(grad, x, [3, 3], [5, 5], indices),
    )
    out, indices = F.fractional_max_pool3d(v, 2, output_size=3, return_indices=True)
    grad = _randn(*out.shape, seed=3)
    torch.testing.assert_close(
        max_pool_module._fractional3d(grad, v, [2, 2, 2], [3, 3, 3], indices),
        aten.fractional_max_pool3d_backward(grad, v, [2, 2, 2], [3, 3, 3], indices),
    )


@needs_extension
def test_max_unpool_matches_and_last_duplicate_wins():
    x = _randn(2, 3, 8, 8)
    out, indices = F.max_pool2d(x, 3, stride=1, return_indices=True)  # overlapping: duplicate indices
    torch.testing.assert_close(max_pool_module._unpool2d(out, indices, [8, 8]), aten.max_unpool2d(out, indices, [8, 8]))
    values = torch.tensor([[[[1.0, 2.0, 3.0]]]], dtype=torch.float64)
    same = torch.tensor([[[[5, 5, 0]]]])
    unpooled = max_pool_module.max_unpool(values, same, [2, 4])
    assert unpooled.view(-1).tolist() == [3.0, 0, 0, 0, 0, 2.0, 0, 0]
    v = _randn(1, 2, 6, 6, 6)
    out, indices = F.max_pool3d(v, 2, return_indices=True)
    torch.testing.assert_close(
        max_pool_module._unpool3d(out, indices, [6, 6, 6], [2, 2, 2], [0, 0, 0]),
        aten.max_unpool3d(out, indices, [6, 6, 6], [2, 2, 2], [0, 0, 0]),
    )


@needs_extension
def test_embedding_bag_max_backward():
    weight = _randn(10, 4)
    indices = torch.randint(0, 10, (9,), generator=torch.Generator().manual_seed(5))
    offsets = torch.tensor([0, 2, 5])  # no empty bag: PyTorch's CPU and CUDA kernels agree on those
    out, offset2bag, bag_size, max_indices = aten._embedding_bag(weight, indices, offsets, False, 2)
    grad = _randn(*out.shape, seed=6)
    args = (grad, indices, offset2bag, bag_size, max_indices, 10, False, 2, None, -1)
    torch.testing.assert_close(max_pool_module._embedding_bag(*args), aten._embedding_bag_dense_backward(*args))
    # CUDA's convention: an empty bag's max index is -1 and adds nothing, padding_idx adds nothing.
    marked = max_indices.clone()
    marked[0] = -1
    marked[1, 0] = 3
    summed = max_pool_module._embedding_bag(grad, indices, offset2bag, bag_size, marked, 10, False, 2, None, 3)
    assert summed[3].abs().sum() == 0
    expected = torch.zeros(10, 4, dtype=torch.float64)
    for bag in (1, 2):
        for feature in range(4):
            row = int(marked[bag, feature])
            if row != 3:
                expected[row, feature] += grad[bag, feature]
    torch.testing.assert_close(summed, expected)


def test_routes_registered_and_cpu_left_to_pytorch():
    routes = registered_routes()
    for name in ROUTED:
        assert name in routes
    x = _randn(1, 1, 4, 4)
    out, indices = F.adaptive_max_pool2d(x, 2, return_indices=True)
    assert routes["adaptive_max_pool2d_backward"].covers(out, x, indices) is not None
    assert (
        routes["_embedding_bag_dense_backward"].covers(out, indices, indices, indices, indices, 4, False, 0, None)
        == "only mode 'max' is refused (sum and mean are deterministic)"
    )


@needs_extension
@pytest.mark.parametrize(
    "kernel,stride,padding,dilation,ceil_mode",
    [(3, 2, 1, 1, False), (2, 1, 0, 2, False), (3, 2, 1, 2, True), ((1, 3, 2), (1, 2, 3), (0, 1, 1), (1, 1, 1), True)],
)
def test_max_pool3d_gather_windows_match_pytorch(kernel, stride, padding, dilation, ceil_mode):
    """The gather visits only the windows that can hold a cell: every stride/padding/dilation/ceil_mode case must
    find every window PyTorch's scatter adds from."""
    x = _randn(2, 3, 7, 9, 8)
    out, indices = F.max_pool3d(x, kernel, stride, padding, dilation, ceil_mode, return_indices=True)
    grad = _randn(*out.shape, seed=1)

    def triple(v):
        return list(v) if isinstance(v, tuple) else [v]

    args = (triple(kernel), triple(stride), triple(padding), triple(dilation), ceil_mode)
    expected = aten.max_pool3d_with_indices_backward(grad, x, *args, indices)
    torch.testing.assert_close(max_pool_module._max_pool3d(grad, x, *args, indices), expected, rtol=0, atol=1e-14)


@needs_extension
@pytest.mark.parametrize("in_size,out_size", [((5, 13), (7, 4)), ((1, 9), (3, 9)), ((16, 16), (16, 16))])
def test_adaptive_gather_windows_match_pytorch(in_size, out_size):
    """Adaptive windows that overlap (more outputs than inputs), tile, or are 1 wide."""
    x = _randn(2, 3, *in_size)
    out, indices = F.adaptive_max_pool2d(x, out_size, return_indices=True)
    grad = _randn(*out.shape, seed=1)
    expected = aten.adaptive_max_pool2d_backward(grad, x, indices)
    torch.testing.assert_close(max_pool_module._adaptive2d(grad, x, indices), expected, rtol=0, atol=1e-15)


@needs_extension
def test_argmax_window_backward_opcheck_and_errors():
    x = _randn(2, 3, 9, 7)
    out, indices = F.adaptive_max_pool2d(x, (4, 3), return_indices=True)
    grad = _randn(*out.shape, seed=1)
    torch.library.opcheck(
        torch.ops.deepep_lightning.argmax_window_backward.default, (grad, indices, [9, 7], [], [], [], [])
    )
    torch.library.opcheck(torch.ops.deepep_lightning.max_unpool_forward.default, (out, indices, [9, 7]))
    with pytest.raises(RuntimeError, match="indices must have grad_output's shape"):
        torch.ops.deepep_lightning.argmax_window_backward(grad, indices[..., :2], [9, 7], [], [], [], [])
    with pytest.raises(RuntimeError, match="must all be empty"):
        torch.ops.deepep_lightning.argmax_window_backward(grad, indices, [9, 7], [2, 2], [], [], [])


@needs_extension
@pytest.mark.parametrize("kernel,stride,passes", [(3, 2, 4), (2, 2, 1), (3, 1, 9)])
def test_a_cell_that_is_the_max_of_several_windows_gets_every_term(kernel, stride, passes):
    """One input cell is the max of every window that holds it: the windows of 1 (disjoint), 4 (scattered in
    passes of disjoint windows) and 9 (more passes than are worth launching: gathered) classes all add to it."""
    x = torch.zeros(1, 2, 5, 5, dtype=torch.float64)
    x[..., 2, 2] = 10.0
    out, indices = F.max_pool2d(x, kernel, stride, return_indices=True)
    grad = _randn(*out.shape, seed=1)
    expected = aten.max_pool2d_with_indices_backward(
        grad, x, [kernel] * 2, [stride] * 2, [0, 0], [1, 1], False, indices
    )
    ours = torch.ops.deepep_lightning.argmax_window_backward(
        grad, indices, [5, 5], [kernel] * 2, [stride] * 2, [0, 0], [1, 1]
    )
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-14)
    holding = int((indices[0, 0] == 12).sum())  # windows whose max is cell (2, 2), per plane
    assert holding == {4: 4, 1: 1, 9: 9}[passes]
    torch.testing.assert_close(ours[..., 2, 2], (grad * (indices == 12)).sum((-2, -1)), rtol=0, atol=1e-14)


@needs_extension
@pytest.mark.parametrize("kernel,stride", [(3, 2), (3, 1)])  # scattered in passes, gathered
def test_an_index_outside_its_window_is_not_counted(kernel, stride):
    x = _randn(1, 1, 7, 7)
    out, indices = F.max_pool2d(x, kernel, stride, return_indices=True)
    grad = torch.ones_like(out)
    planted = indices.clone()
    planted.view(-1)[0] = 48  # window (0, 0) cannot hold cell (6, 6)
    ours = torch.ops.deepep_lightning.argmax_window_backward(
        grad, planted, [7, 7], [kernel] * 2, [stride] * 2, [0, 0], [1, 1]
    )
    assert ours.sum() == grad.numel() - 1 and ours[0, 0, 6, 6] == (indices == 48).sum()


@needs_extension
def test_a_half_precision_cell_of_several_windows_is_summed_in_float():
    """float16 with overlapping windows gathers in float: 1024 + 0.5 + 0.5 + 0.5 = 1025.5 rounds to 1026 once, where
    adding pass by pass in float16 would round each partial sum (1024.5 -> 1024) and end at 1024."""
    x = torch.zeros(1, 1, 5, 5, dtype=torch.float16)
    x[..., 2, 2] = 10.0
    out, indices = F.max_pool2d(x.float(), 3, 2, return_indices=True)
    grad = torch.tensor([[[[1024.0, 0.5], [0.5, 0.5]]]], dtype=torch.float16)
    ours = torch.ops.deepep_lightning.argmax_window_backward(grad, indices, [5, 5], [3, 3], [2, 2], [0, 0], [1, 1])
    assert ours.dtype == torch.float16 and ours[0, 0, 2, 2].item() == 1026.0
