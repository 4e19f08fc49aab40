"""CPU tests of the deepep_lightning ops behind the dispatcher routes (nll_loss2d, adaptive/3-D pooling, padding):
schema and fake kernels (torch.library.opcheck), and equality with PyTorch's CPU kernels."""

import pytest
import torch
from torch.library import opcheck

from deepep_lightning.ops import extension_available, routed_aten_ops

pytestmark = pytest.mark.skipif(not extension_available(), reason="deepep_lightning extension not buildable here")
routed_aten_ops()  # imports the op modules: their fake kernels are registered


def _randn(*shape, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)), dtype=dtype)


def _nll_args():
    logp = _randn(2, 4, 5, 6).log_softmax(1)
    target = torch.randint(0, 4, (2, 5, 6), generator=torch.Generator().manual_seed(0))
    target[0, 0] = -1
    return logp, target


CASES = {
    "nll_loss2d_mean_weight": (
        "nll_loss2d_forward",
        lambda: (*_nll_args(), _randn(4).abs(), 1, -1),
        lambda logp, target, weight, reduction, ignore: torch.ops.aten.nll_loss2d_forward(
            logp, target, weight, reduction, ignore
        ),
    ),
    "nll_loss2d_sum": (
        "nll_loss2d_forward",
        lambda: (*_nll_args(), None, 2, -1),
        lambda *a: torch.ops.aten.nll_loss2d_forward(*a),
    ),
    "adaptive_avg_pool2d": (
        "adaptive_avg_pool2d_backward",
        lambda: (_randn(2, 3, 5, 4), _randn(2, 3, 7, 9)),
        torch.ops.aten._adaptive_avg_pool2d_backward,
    ),
    "adaptive_avg_pool3d": (
        "adaptive_avg_pool3d_backward",
        lambda: (_randn(3, 2, 3, 4), _randn(3, 5, 7, 6)),
        torch.ops.aten._adaptive_avg_pool3d_backward,
    ),
    "avg_pool3d": (
        "avg_pool3d_backward",
        lambda: (_randn(1, 2, 4, 4, 5), _randn(1, 2, 6, 7, 8), [3, 3, 3], [2, 2, 2], [1, 1, 1], True, False, None),
        torch.ops.aten.avg_pool3d_backward,
    ),
    "reflection_pad3d": (
        "reflection_pad_backward",
        lambda: (_randn(1, 2, 6, 7, 8), _randn(1, 2, 4, 5, 6), [1, 1, 1, 1, 1, 1]),
        torch.ops.aten.reflection_pad3d_backward,
    ),
    "upsample_bicubic2d": (
        "upsample_bicubic2d_backward",
        lambda: (_randn(2, 3, 9, 7), [2, 3, 4, 5], False, None, None),
        lambda grad, size, align, sh, sw: torch.ops.aten.upsample_bicubic2d_backward(
            grad, grad.shape[2:], size, align, sh, sw
        ),
    ),
    "upsample_bicubic2d_align_scales": (
        "upsample_bicubic2d_backward",
        lambda: (_randn(1, 2, 8, 10), [1, 2, 4, 5], True, 2.0, 2.0),
        lambda grad, size, align, sh, sw: torch.ops.aten.upsample_bicubic2d_backward(
            grad, grad.shape[2:], size, align, sh, sw
        ),
    ),
    "upsample_aa2d_bilinear": (
        "upsample_aa2d_backward",
        lambda: (_randn(2, 3, 4, 3), [2, 3, 9, 7], False, None, None, False),
        lambda grad, size, align, sh, sw, bicubic: torch.ops.aten._upsample_bilinear2d_aa_backward(
            grad, grad.shape[2:], size, align, sh, sw
        ),
    ),
    "upsample_aa2d_bicubic_align": (
        "upsample_aa2d_backward",
        lambda: (_randn(1, 2, 5, 4), [1, 2, 11, 12], True, None, None, True),
        lambda grad, size, align, sh, sw, bicubic: torch.ops.aten._upsample_bicubic2d_aa_backward(
            grad, grad.shape[2:], size, align, sh, sw
        ),
    ),
    "replication_pad1d": (
        "replication_pad_backward",
        lambda: (_randn(3, 12), _randn(3, 7), [2, 3]),
        torch.ops.aten.replication_pad1d_backward,
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_opcheck_and_equal_to_pytorch(case):
    op_name, make_args, aten = CASES[case]
    args = make_args()
    op = getattr(torch.ops.deepep_lightning, op_name).default
    opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
    got, want = op(*args), aten(*args)
    for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        assert torch.equal(g, w)
