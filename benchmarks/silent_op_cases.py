"""The cases the silent-op sweep repeats: PyTorch's OpInfo and ModuleInfo databases, and kernel paths they miss.

* :func:`opinfo_cases`: every op of ``op_db`` (``torch.testing._internal.common_methods_invocations``), every
  floating dtype it supports on the device, its first ``max_samples`` sample inputs, forward and backward.
* :func:`module_cases`: every module of ``module_db`` in training mode, with its parameters' gradients.
* :func:`path_cases`: what the databases' small samples do not reach: scatters large enough for atomics to
  race (>= 1e5 elements into >= 1e3 slots), cuDNN's own kernels (the grid sampler, CTC, RNNs, convolutions,
  batch norm), every SDPA backend, and ``torch.compile``d functions.

A case's inputs are built once and cloned for every repeat, so every repeat starts from the same bytes.
The databases need ``expecttest`` (a test dependency of PyTorch's own suite).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from bitwise_repeat import Case
from torch import Tensor
from torch.utils._pytree import tree_map

__all__ = ["FLOATING", "module_cases", "opinfo_cases", "path_cases", "planted_cases"]

FLOATING = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _fresh(value: Any) -> Any:
    """A copy with the same values and the same ``requires_grad`` (a new leaf)."""

    def copy(t: Any) -> Any:
        if not isinstance(t, Tensor):
            return t
        clone = t.detach().clone()
        return clone.requires_grad_() if t.requires_grad and (t.is_floating_point() or t.is_complex()) else clone

    return tree_map(copy, value)


def _call(function: Callable) -> Callable:
    return lambda input, args, kwargs: function(input, *args, **kwargs)


def _selected(name: str, only: Sequence[str]) -> bool:
    return not only or any(part == name or part == name.split(".")[0] for part in only)


def opinfo_cases(
    device: str, dtypes: Sequence[torch.dtype], max_samples: int, only: Sequence[str] = ()
) -> Iterator[Case]:
    """One case per (op, dtype, sample) of PyTorch's OpInfo database."""
    from torch.testing._internal.common_methods_invocations import op_db

    for op in op_db:
        name = f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name
        if not _selected(name, only):
            continue
        supported = op.supported_dtypes(device)
        backward = op.supported_backward_dtypes(device) if op.supports_autograd else set()
        for dtype in (d for d in dtypes if d in supported):
            try:
                samples = list(
                    itertools.islice(op.sample_inputs(device, dtype, requires_grad=dtype in backward), max_samples)
                )
            except Exception as error:  # noqa: BLE001 - a database entry that cannot build samples here
                yield Case(f"{name}/{str(dtype)[6:]}/samples", _raise(error), tuple, "opinfo")
                continue
            for index, sample in enumerate(samples):
                frozen = (sample.input, tuple(sample.args), dict(sample.kwargs))
                yield Case(f"{name}/{str(dtype)[6:]}/sample{index}", _call(op.op), lambda f=frozen: _fresh(f), "opinfo")


def _raise(error: Exception) -> Callable:
    def function() -> None:
        raise error

    return function


def module_cases(
    device: str, dtypes: Sequence[torch.dtype], max_samples: int, only: Sequence[str] = ()
) -> Iterator[Case]:
    """One case per (module, dtype, input) of PyTorch's ModuleInfo database, training mode, with the
    parameters' gradients (the module is rebuilt from one seed for every repeat)."""
    from torch.testing._internal.common_modules import module_db

    for info in module_db:
        name = info.module_cls.__name__ + (f".{info.name}" if getattr(info, "name", "") else "")
        if not _selected(name, only) and not _selected(info.module_cls.__name__, only):
            continue
        for dtype in (d for d in dtypes if d in info.supported_dtypes(device)):
            try:
                inputs = info.module_inputs_func(info, device=device, dtype=dtype, requires_grad=True, training=True)
            except Exception as error:  # noqa: BLE001
                yield Case(f"{name}/{str(dtype)[6:]}/inputs", _raise(error), tuple, "module")
                continue
            for index, module_input in enumerate(inputs[:max_samples]):
                if module_input.forward_input is None:
                    continue
                yield Case(
                    f"{name}/{str(dtype)[6:]}/input{index}",
                    _module_forward,
                    _module_maker(info.module_cls, module_input, device, dtype),
                    "module",
                )


def _module_maker(cls: type, module_input: Any, device: str, dtype: torch.dtype) -> Callable[[], tuple]:
    constructor = module_input.constructor_input
    forward = (module_input.forward_input.args, module_input.forward_input.kwargs)

    def make() -> tuple:
        torch.manual_seed(0)  # identical initial parameters in every repeat
        module = cls(*constructor.args, **constructor.kwargs).to(device=device, dtype=dtype).train()
        args, kwargs = _fresh(forward)
        return module, tuple(args), dict(kwargs), [p for p in module.parameters() if p.requires_grad]

    return make


def _module_forward(module: torch.nn.Module, args: tuple, kwargs: dict, parameters: list) -> Any:
    return module(*args, **kwargs)


def _leaf(generator: torch.Generator, *shape: int, device: str, dtype: torch.dtype = torch.float32) -> Tensor:
    return torch.randn(*shape, generator=generator, dtype=torch.float64).to(device, dtype).requires_grad_()


def _frozen(make: Callable[[torch.Generator], tuple]) -> Callable[[], tuple]:
    values = make(torch.Generator().manual_seed(0))
    return lambda: _fresh(values)


def path_cases(device: str) -> Iterator[Case]:
    """Large and cuDNN/SDPA/compile cases: kernel paths with atomics that small samples do not race on."""
    d = {"device": device}

    def scatter(g: torch.Generator) -> tuple:  # 2**20 values into 1000 slots
        return _leaf(g, 2**20, **d), torch.randint(0, 1000, (2**20,), generator=g).to(device)

    yield Case("large/index_add", lambda v, i: torch.zeros(1000, **d).index_add(0, i, v), _frozen(scatter), "large")
    yield Case("large/scatter_add", lambda v, i: torch.zeros(1000, **d).scatter_add(0, i, v), _frozen(scatter), "large")
    yield Case(
        "large/index_put_accumulate",
        lambda v, i: torch.zeros(1000, **d).index_put((i,), v, accumulate=True),
        _frozen(scatter),
        "large",
    )
    yield Case(
        "large/embedding_backward",
        lambda w, i: F.embedding(i.view(-1, 16), w).sum(-1),
        _frozen(lambda g: (_leaf(g, 1000, 64, **d), torch.randint(0, 1000, (2**16,), generator=g).to(device))),
        "large",
    )
    yield Case(
        "large/embedding_bag_backward",
        lambda w, i: F.embedding_bag(i.view(-1, 16), w, mode="sum"),
        _frozen(lambda g: (_leaf(g, 1000, 64, **d), torch.randint(0, 1000, (2**16,), generator=g).to(device))),
        "large",
    )
    yield Case(
        "large/nll_loss2d",
        lambda x, t: F.cross_entropy(x, t),
        _frozen(
            lambda g: (_leaf(g, 8, 21, 128, 128, **d), torch.randint(0, 21, (8, 128, 128), generator=g).to(device))
        ),
        "large",
    )
    for align_corners in (True, False):  # True: cuDNN's sampler on CUDA (4-D, bilinear, zeros)
        yield Case(
            f"cudnn/grid_sample_bilinear_zeros_align{align_corners}",
            lambda x, grid, a=align_corners: F.grid_sample(x, grid, align_corners=a),
            _frozen(
                lambda g: (
                    _leaf(g, 4, 32, 64, 64, **d),
                    (torch.rand(4, 128, 128, 2, generator=g) * 2 - 1).to(device).requires_grad_(),
                )
            ),
            "cudnn",
        )
    yield Case(
        "cudnn/ctc_loss",
        lambda lp, t: F.ctc_loss(lp.log_softmax(-1), t, [50] * 16, [20] * 16, reduction="sum"),
        _frozen(
            lambda g: (
                _leaf(g, 50, 16, 28, **d),
                torch.randint(1, 28, (16, 20), generator=g, dtype=torch.int32),  # int32 on the CPU: cuDNN-eligible
            )
        ),
        "cudnn",
    )
    for cell in ("LSTM", "GRU"):
        yield Case(
            f"cudnn/{cell}",
            _module_forward,
            _rnn_maker(cell, device),
            "cudnn",
        )
    yield Case(
        "cudnn/conv2d_batchnorm",
        lambda x, w, gamma, beta: F.batch_norm(F.conv2d(x, w, padding=1), None, None, gamma, beta, training=True),
        _frozen(
            lambda g: (_leaf(g, 16, 64, 32, 32, **d), _leaf(g, 64, 64, 3, 3, **d), _leaf(g, 64, **d), _leaf(g, 64, **d))
        ),
        "cudnn",
    )
    yield Case(
        "cudnn/conv_transpose2d",
        lambda x, w: F.conv_transpose2d(x, w, stride=2),
        _frozen(lambda g: (_leaf(g, 16, 64, 32, 32, **d), _leaf(g, 64, 32, 4, 4, **d))),
        "cudnn",
    )
    yield from _large_backward_cases(device)
    yield from _sdpa_cases(device)
    yield Case(
        "compile/index_add_mlp",
        torch.compile(_compiled_body, dynamic=False),
        _frozen(lambda g: (*scatter(g), _leaf(g, 1000, 1000, **d))),
        "compile",
    )
    yield Case(  # inductor generates its own scatter kernels for these
        "compile/index_put_accumulate",
        torch.compile(lambda v, i: torch.zeros(1000, **d).index_put((i,), v, accumulate=True).tanh(), dynamic=False),
        _frozen(scatter),
        "compile",
    )
    yield Case(
        "compile/embedding_layer_norm",
        torch.compile(lambda w, i: F.layer_norm(F.embedding(i.view(-1, 16), w), (64,)), dynamic=False),
        _frozen(lambda g: (_leaf(g, 1000, 64, **d), torch.randint(0, 1000, (2**16,), generator=g).to(device))),
        "compile",
    )
    yield Case(
        "compile/grid_sample_align_corners",
        torch.compile(lambda x, grid: F.grid_sample(x, grid, align_corners=True).square(), dynamic=False),
        _frozen(
            lambda g: (
                _leaf(g, 4, 32, 64, 64, **d),
                (torch.rand(4, 128, 128, 2, generator=g) * 2 - 1).to(device).requires_grad_(),
            )
        ),
        "compile",
    )


def _compiled_body(values: Tensor, index: Tensor, weight: Tensor) -> Tensor:
    summed = torch.zeros(1000, device=values.device, dtype=values.dtype).index_add(0, index, values)
    return torch.tanh(weight @ summed)


def _rnn_maker(cell: str, device: str) -> Callable[[], tuple]:
    def make() -> tuple:
        torch.manual_seed(0)
        module = getattr(torch.nn, cell)(64, 128, num_layers=2, batch_first=True).to(device)
        x = torch.randn(32, 50, 64, generator=torch.Generator().manual_seed(1)).to(device).requires_grad_()
        return module, (x,), {}, list(module.parameters())

    return make


def _sdpa_cases(device: str) -> Iterator[Case]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {
        "math": SDPBackend.MATH,
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
    }
    for (name, backend), dtype in itertools.product(backends.items(), (torch.float16, torch.bfloat16, torch.float32)):

        def attend(q: Tensor, k: Tensor, v: Tensor, backend: Any = backend) -> Tensor:
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        yield Case(
            f"sdpa/{name}/{str(dtype)[6:]}",
            attend,
            _frozen(lambda g, dt=dtype: tuple(_leaf(g, 4, 8, 512, 64, device=device, dtype=dt) for _ in range(3))),
            "sdpa",
        )


def planted_cases(device: str) -> Iterator[Case]:
    """The sweep's negative control: a sum in a different order on every call must come out ``differs``; the
    same sum in a fixed order ``bitwise``."""
    import os

    def values_and_index(g: torch.Generator) -> tuple:
        scale = 10.0 ** torch.randint(-8, 9, (2**16,), generator=g)  # a wide range: the order moves the bits
        values = _leaf(g, 2**16, device=device, dtype=torch.float64) * scale.to(device)
        return values.detach().requires_grad_(), torch.randint(0, 16, (2**16,), generator=g).to(device)

    # A float64 running sum (cumsum) adds in the order it is given, on every device and whatever the plugin
    # routes (float32 sums may be carried in float64 and lose the order): the shuffled one changes the order.
    def shuffled(values: Tensor, index: Tensor) -> Tensor:
        generator = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
        sums = []
        for slot in range(16):
            members = values[index == slot]
            sums.append(members[torch.randperm(len(members), generator=generator).to(values.device)].cumsum(0)[-1])
        return torch.stack(sums)

    def ordered(values: Tensor, index: Tensor) -> Tensor:
        return torch.stack([values[index == slot].cumsum(0)[-1] for slot in range(16)])

    yield Case("planted/shuffled_sum", shuffled, _frozen(values_and_index), "planted")
    yield Case("planted/ordered_sum", ordered, _frozen(values_and_index), "planted")


def _large_backward_cases(device: str) -> Iterator[Case]:
    """Backwards that scatter into their input (resampling, pooling, padding, gathers), at sizes where
    atomics collide: a [8, 32, 64, 64] image (2**20 elements) or 2**20 gathered entries into 1000 rows."""
    d = {"device": device}

    def image(g: torch.Generator) -> tuple:
        return (_leaf(g, 8, 32, 64, 64, **d),)

    def volume(g: torch.Generator) -> tuple:
        return (_leaf(g, 2, 16, 32, 32, 32, **d),)

    def rows(g: torch.Generator) -> tuple:
        return _leaf(g, 1000, 64, **d), torch.randint(0, 1000, (2**14,), generator=g).to(device)

    image_ops: dict[str, Callable[[Tensor], Tensor]] = {
        "interpolate_bilinear_up": lambda x: F.interpolate(x, scale_factor=1.7, mode="bilinear"),
        "interpolate_bilinear_down_aligned": lambda x: F.interpolate(
            x, size=(37, 29), mode="bilinear", align_corners=True
        ),
        "interpolate_bicubic": lambda x: F.interpolate(x, scale_factor=1.3, mode="bicubic"),
        "interpolate_nearest": lambda x: F.interpolate(x, scale_factor=0.7, mode="nearest"),
        "interpolate_area": lambda x: F.interpolate(x, size=(23, 41), mode="area"),
        "interpolate_bilinear_antialias": lambda x: F.interpolate(x, size=(30, 30), mode="bilinear", antialias=True),
        "adaptive_avg_pool2d": lambda x: F.adaptive_avg_pool2d(x, (7, 9)),
        "adaptive_max_pool2d": lambda x: F.adaptive_max_pool2d(x, (7, 9)),
        "avg_pool2d_overlapping": lambda x: F.avg_pool2d(x, 3, stride=1, padding=1),
        "max_pool2d_overlapping": lambda x: F.max_pool2d(x, 3, stride=1, padding=1),
        "fractional_max_pool2d": lambda x: F.fractional_max_pool2d(x, 3, output_size=(40, 40)),
        "reflection_pad2d": lambda x: F.pad(x, (3, 3, 3, 3), mode="reflect"),
        "replication_pad2d": lambda x: F.pad(x, (3, 3, 3, 3), mode="replicate"),
        "unfold_fold": lambda x: F.fold(F.unfold(x, 3, padding=1), (64, 64), 3, padding=1),
        "pixel_shuffle_conv": lambda x: F.pixel_shuffle(x, 2),
    }
    for name, op in image_ops.items():
        yield Case(f"large/{name}", op, _frozen(image), "large")
    volume_ops: dict[str, Callable[[Tensor], Tensor]] = {
        "interpolate_trilinear": lambda x: F.interpolate(x, scale_factor=1.5, mode="trilinear"),
        "adaptive_avg_pool3d": lambda x: F.adaptive_avg_pool3d(x, (5, 6, 7)),
        "adaptive_max_pool3d": lambda x: F.adaptive_max_pool3d(x, (5, 6, 7)),
        "avg_pool3d_overlapping": lambda x: F.avg_pool3d(x, 3, stride=1, padding=1),
        "max_pool3d_overlapping": lambda x: F.max_pool3d(x, 3, stride=1, padding=1),
        "replication_pad3d": lambda x: F.pad(x, (2, 2, 2, 2, 2, 2), mode="replicate"),
        "grid_sample_3d": lambda x: F.grid_sample(
            x,
            torch.linspace(-1.1, 1.1, 3 * 20 * 20 * 20, **d).view(1, 20, 20, 20, 3).expand(2, -1, -1, -1, -1),
            align_corners=False,
        ),
    }
    for name, op in volume_ops.items():
        yield Case(f"large/{name}", op, _frozen(volume), "large")
    row_ops: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
        "index_select": lambda w, i: w.index_select(0, i),
        "gather": lambda w, i: w.gather(0, i[:, None].expand(-1, 64)),
        "advanced_indexing": lambda w, i: w[i],
        "take": lambda w, i: w.take(i * 64),
        "scatter_reduce_mean": lambda w, i: torch.zeros(1000, 64, **d).scatter_reduce(
            0, i[:, None].expand(-1, 64), w[i], "mean"
        ),
        "scatter_reduce_amax": lambda w, i: torch.zeros(1000, 64, **d).scatter_reduce(
            0, i[:, None].expand(-1, 64), w[i], "amax"
        ),
        "index_reduce_mean": lambda w, i: torch.zeros(1000, 64, **d).index_reduce(0, i, w[i], "mean"),
        "embedding_bag_mean": lambda w, i: F.embedding_bag(i.view(-1, 16), w, mode="mean"),
        "embedding_bag_max": lambda w, i: F.embedding_bag(i.view(-1, 16), w, mode="max"),
        "cumsum": lambda w, i: w[i].cumsum(0),
        "sort_values": lambda w, i: w[i].sort(0).values,
        "kthvalue": lambda w, i: w[i].kthvalue(5, 0).values,
        "median_dim": lambda w, i: w[i].median(0).values,
        "histc": lambda w, i: torch.histc(w[i], bins=1000),
        "bincount_weighted": lambda w, i: torch.bincount(i, weights=w[i, 0].detach(), minlength=1000),  # no backward
    }
    for name, op in row_ops.items():
        yield Case(f"large/{name}", op, _frozen(rows), "large")
