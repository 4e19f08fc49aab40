"""Benchmark the deterministic kernels of refused ops against PyTorch's atomic kernels.

Side by side in one process, per shape, the backward pass only (``torch.autograd.grad`` of a
retained graph w.r.t. input and grid): the median over repetitions, after warm-up, of the wall time
per call of a burst of ``--burst`` back-to-back calls between CUDA events (the steady-state cost in a
training loop, see :class:`Timer`), interleaved round-robin so drift hits every method alike, with the
host time per call beside it:

* ``deepep_deterministic``: ``deepep_lightning.ops.grid_sample`` / ``.interpolate`` (sort +
  segmented gather / windowed gather kernels, bitwise reproducible);
* ``pytorch_atomic``: ``F.grid_sample`` / ``F.interpolate`` outside deterministic mode (float
  ``atomicAdd`` scatter, not reproducible);
* ``pytorch_deterministic_decomposition`` (interpolate only): ``F.interpolate`` inside
  deterministic mode, where PyTorch switches CUDA inputs to a pure-PyTorch decomposition.

The ops routed at the dispatcher (``nll_loss2d_forward``, adaptive/3-D pooling and padding backwards,
``_ctc_loss_backward``, ``index_add``/``scatter_add``, ``index_reduce`` (prod, mean,
amax, amin), ``scatter_reduce.two`` (prod), ``put_`` (accumulate), ``median.dim_values`` /
``nanmedian.dim_values``, ``histc``, ``bincount`` with weights) are timed as the aten overload the route
registers (``torch.ops.aten.<op>.<overload>``), called directly with that overload's arguments:
``deepep_deterministic`` with the routing on and deterministic mode on, ``pytorch_atomic`` with the
routing off and deterministic mode off, and ``pytorch_deterministic`` (routing off, deterministic mode
on) for the ops where PyTorch has a deterministic kernel of its own (:data:`HAS_PYTORCH_DETERMINISTIC`;
the others raise there). Each row also holds the peak extra CUDA memory of one call
(``peak_extra_mib``: peak allocated during the call minus allocated before it, outputs included, except
the preallocated ``values``/``indices`` of ``median.dim_values``), and for a routed op the route's
verdict on those arguments (``route_covers``: ``None`` when the deterministic implementation runs, else
why PyTorch's kernel does); on CUDA a routed row whose case the route does not cover fails the run,
since its ``deepep_deterministic`` column would time PyTorch's kernel.

The issue's target: ``deepep_deterministic`` <= 1.0x ``pytorch_atomic`` median, <= 1.3x worst. Writes
``DIR/refused_ops.json``::

    PYTHONPATH=$PWD python benchmarks/bench_refused_ops.py --out benchmarks/results/refused_ops

Per shape it also checks that ``deepep_deterministic`` repeats bitwise (``repeat_bitwise``; the
script exits non-zero when a shape does not). ``--ops index_reduce,histc`` times only those ops
(``grid_sample``, ``interpolate_bilinear`` or keys of :data:`ROUTED_SHAPES`).
``--profile`` writes ``DIR/refused_ops_profile.txt``: per shape and method, torch.profiler's
kernel table (where the time goes: launches, sort, gather, fills, CPU overhead), and adds each
method's GPU kernel time per call to the JSON (``kernel_ms``, ``kernel_ratio_vs_atomic``).

``--device cpu --quick`` is a smoke run of this script without a GPU.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

# (N, C, H_in, W_in, H_out, W_out, grid half-width): points uniform in [-w, w]^2.
GRID_SHAPES = [
    (8, 3, 256, 256, 256, 256, 1.0),  # image warping, few channels
    (16, 32, 64, 64, 64, 64, 1.0),  # feature-map spatial transformer
    (4, 64, 128, 128, 128, 128, 1.0),
    (32, 16, 32, 32, 64, 64, 1.0),  # upsampling grid: 4 points per pixel
    (8, 32, 32, 32, 128, 128, 0.2),  # heavy overlap: ~160 points per pixel
]
# (N, C, H, W, interpolate kwargs)
INTERPOLATE_SHAPES = [
    (8, 64, 64, 64, dict(scale_factor=2.0)),
    (16, 32, 128, 128, dict(scale_factor=2.0)),
    (8, 256, 32, 32, dict(scale_factor=4.0)),
    (8, 64, 128, 128, dict(scale_factor=0.5)),
    (4, 3, 512, 512, dict(size=(768, 768))),
]
QUICK_GRID = [(2, 3, 8, 8, 8, 8, 1.0)]
QUICK_INTERPOLATE = [(2, 3, 8, 8, dict(scale_factor=2.0))]
# Ops routed at the dispatcher: op -> [(input shape, op arguments)], timed through the aten op itself.
ROUTED_SHAPES = {
    "nll_loss2d_forward": [  # (N, C, H, W), (weighted, ignore_index): segmentation losses
        ((8, 19, 512, 512), (False, -100)),  # Cityscapes-like, 19 classes
        ((8, 19, 512, 512), (True, 255)),  # class weights + ignored void pixels
        ((16, 21, 256, 256), (False, 255)),  # VOC-like
        ((4, 150, 128, 128), (True, -100)),  # ADE20K-like, many classes
    ],
    "_adaptive_avg_pool2d_backward": [  # (N, C, H, W), output size
        ((64, 2048, 7, 7), (1, 1)),  # ResNet-50 head
        ((8, 2048, 64, 64), (6, 6)),  # PSPNet pyramid level
        ((32, 512, 14, 14), (5, 5)),  # overlapping windows
    ],
    "_adaptive_avg_pool3d_backward": [
        ((8, 512, 8, 14, 14), (1, 1, 1)),  # video ResNet head
        ((2, 32, 32, 64, 64), (4, 8, 8)),
        ((4, 64, 16, 28, 28), (3, 5, 5)),  # overlapping windows
    ],
    "avg_pool3d_backward": [  # (N, C, D, H, W), (kernel, stride, padding)
        ((2, 32, 32, 64, 64), (3, 2, 1)),
        ((2, 32, 32, 64, 64), (3, 1, 1)),
        ((8, 64, 16, 28, 28), (2, 2, 0)),
    ],
    "reflection_pad3d_backward": [  # (N, C, D, H, W), padding per side
        ((2, 32, 32, 64, 64), 1),
        ((2, 32, 32, 64, 64), 3),
        ((8, 64, 16, 28, 28), 2),
    ],
    "replication_pad3d_backward": [((2, 32, 32, 64, 64), 1), ((8, 64, 16, 28, 28), 2), ((2, 16, 64, 64, 64), 4)],
    "adaptive_max_pool2d_backward": [
        ((32, 512, 7, 7), (1, 1)),
        ((32, 256, 14, 14), (7, 7)),
        ((8, 64, 112, 112), (5, 5)),
    ],
    "max_pool3d_with_indices_backward": [  # (N, C, D, H, W), (kernel, stride, padding)
        ((8, 64, 16, 56, 56), (3, 2, 1)),
        ((2, 32, 32, 64, 64), (2, 2, 0)),
        ((2, 32, 32, 64, 64), (3, 1, 1)),
    ],
    "max_unpool2d": [((16, 64, 56, 56), 2), ((8, 128, 28, 28), 2), ((4, 3, 256, 256), 2)],  # SegNet-style decoder
    "_ctc_loss_backward": [  # (T, N, C), target length
        ((200, 32, 29), 40),
        ((100, 64, 29), 20),
        ((400, 16, 1000), 60),
    ],
    # PyTorch has a deterministic path for these (slower); pytorch_deterministic is timed too
    "index_add": [((1000,), 8 * 2**20), ((10000, 64), 2**20), ((100000,), 2**20)],  # (self shape, entries)
    "scatter_add": [
        ((1000,), 8 * 2**20),
        ((100000,), 2**20),
        ((10, 1000), 2**20),
        ((10_000, 64), ("expanded", 200_000)),  # PyG message passing: a row index expanded over features
    ],
    # (self shape, (entries, reduce, include_self)): graph-neural-net message aggregation, edges into nodes
    "index_reduce": [
        case
        for reduce in ("prod", "mean", "amax", "amin")
        for case in (
            ((10_000, 64), (100_000, reduce, True)),  # 1e5 edges into 1e4 nodes x 64 features
            ((100_000, 64), (1_000_000, reduce, True)),  # 1e6 edges into 1e5 nodes
            ((50_000, 128), (500_000, reduce, False)),  # PyG-style: reached nodes start from the identity
        )
    ],
    "scatter_reduce.two": [  # (self shape, (index shape, dim)), reduce="prod"
        ((100_000,), ((2**20,), 0)),
        ((10_000, 64), ((2**18, 64), 0)),
        ((64, 10_000), ((64, 2**16), 1)),
    ],
    "put_": [((1000, 1000), 1_000_000), ((100_000,), 1_000_000), ((4096, 1024), 8 * 2**20)],  # accumulate=True
    "median.dim_values": [  # (shape, dim)
        ((4096, 1024), -1),
        ((64, 50_000), -1),
        ((16, 1_000_000), 0),  # coordinate-wise median of 16 gradient copies (robust aggregation)
    ],
    "nanmedian.dim_values": [((4096, 1024), -1), ((64, 50_000), -1), ((16, 1_000_000), 0)],  # 5% NaN
    "histc": [  # (shape, (bins, min, max)); min == max takes the data's range (a host sync, as PyTorch)
        ((10_000_000,), (100, -4.0, 4.0)),
        ((10_000_000,), (1000, -4.0, 4.0)),
        ((4096, 4096), (256, 0.0, 0.0)),
    ],
    "bincount": [((10_000_000,), 100), ((10_000_000,), 1000), ((1_000_000,), 100_000)],  # (entries, bins), weights
}
#: Routed ops for which PyTorch's deterministic mode has an implementation of its own (no refusal).
HAS_PYTORCH_DETERMINISTIC = ("index_add", "scatter_add")
QUICK_ROUTED = {
    "nll_loss2d_forward": [((2, 3, 8, 8), (True, -100))],
    "_adaptive_avg_pool2d_backward": [((2, 3, 8, 8), (3, 3))],
    "_adaptive_avg_pool3d_backward": [((2, 3, 4, 8, 8), (2, 3, 3))],
    "avg_pool3d_backward": [((2, 3, 4, 8, 8), (3, 2, 1))],
    "reflection_pad3d_backward": [((2, 3, 4, 8, 8), 1)],
    "replication_pad3d_backward": [((2, 3, 4, 8, 8), 1)],
    "adaptive_max_pool2d_backward": [((2, 3, 8, 8), (3, 3))],
    "max_pool3d_with_indices_backward": [((2, 3, 4, 8, 8), (3, 2, 1))],
    "_ctc_loss_backward": [((12, 2, 5), 3)],
    "index_add": [((10,), 100)],
    "scatter_add": [((10,), 100)],
    "index_reduce": [((10, 4), (30, reduce, reduce != "amin")) for reduce in ("prod", "mean", "amax", "amin")],
    "scatter_reduce.two": [((10, 4), ((30, 4), 0))],
    "put_": [((10, 4), 100)],
    "median.dim_values": [((8, 16), -1)],
    "nanmedian.dim_values": [((8, 16), 0)],
    "histc": [((1000,), (10, -2.0, 2.0)), ((1000,), (10, 0.0, 0.0))],
    "bincount": [((1000,), 10)],
}


class Timer:
    """Milliseconds per call of a burst of ``burst`` back-to-back calls: (wall between CUDA events, host).

    One call alone would time the host's dispatch plus the kernels run after it (the GPU idles while
    the host launches). A burst keeps the GPU queue full, so the wall time per call is the steady-state
    cost a training loop pays: the kernels' time when they take longer than the dispatch, the dispatch
    when it does. The host time per call (``perf_counter`` around the launches, before the sync) says
    which. On CPU both are ``perf_counter``.
    """

    def __init__(self, device, burst):
        self.cuda, self.burst = device == "cuda", burst

    def __call__(self, fn):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        begin = time.perf_counter()
        for _ in range(self.burst):
            fn()
        host = (time.perf_counter() - begin) * 1e3 / self.burst
        if not self.cuda:
            return host, host
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / self.burst, host


def backward_call(output, leaves, grad_output, deterministic):
    """A closure running the backward of one retained forward graph, in the given mode; returns the grads."""

    def run():
        torch.use_deterministic_algorithms(deterministic)
        return torch.autograd.grad(output, leaves, grad_output, retain_graph=True)

    return run


def forward_graph(forward, deterministic):
    torch.use_deterministic_algorithms(deterministic)
    return forward()


def measure(methods, timer, warmup, repeats):
    """Per method: (median wall ms per call, median host ms per call), round-robin over ``repeats`` bursts."""
    for run in methods.values():
        _prepare(run)
        for _ in range(warmup):
            run()
    samples = {name: [] for name in methods}
    for _ in range(repeats):
        for name, run in methods.items():  # round-robin
            _prepare(run)
            samples[name].append(timer(run))
    return {
        name: (statistics.median(v[0] for v in values), statistics.median(v[1] for v in values))
        for name, values in samples.items()
    }


def _prepare(run):
    """Set the process-global state a method needs (the dispatcher routing) before it is timed."""
    prepare = getattr(run, "prepare", None)
    if prepare is not None:
        prepare()


def peak_extra_mib(methods, device):
    """Per method: peak CUDA memory allocated during one call minus what was allocated before it (MiB)."""
    if device != "cuda":
        return None
    peaks = {}
    for name, run in methods.items():
        _prepare(run)
        run()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        result = run()
        torch.cuda.synchronize()
        peaks[name] = (torch.cuda.max_memory_allocated() - before) / 2**20
        del result
    return peaks


def aten_overload(op):
    """``torch.ops.aten.<name>.<overload>`` for a route's ``"name"`` (default overload) or ``"name.overload"``."""
    name, _, overload = op.partition(".")
    return getattr(getattr(torch.ops.aten, name), overload or "default")


def _routed_args(op, shape, arguments, device):
    """``(args, kwargs)`` of the aten overload ``op`` for one case of :data:`ROUTED_SHAPES`."""
    generator = torch.Generator().manual_seed(0)

    def randn(*size):
        return torch.randn(*size, generator=generator).to(device)

    def near_one(*size):  # products of many factors stay finite (no inf * 0 = NaN in a long segment)
        return (1 + 0.01 * torch.randn(*size, generator=generator)).to(device)

    def randint(high, *size):
        return torch.randint(0, high, size, generator=generator).to(device)

    if op == "nll_loss2d_forward":
        weighted, ignore_index = arguments
        n, c, h, w = shape
        target = torch.randint(0, c, (n, h, w), generator=generator)
        target[:, : h // 8] = ignore_index  # a void border
        weight = torch.rand(c, generator=generator).to(device) + 0.5 if weighted else None
        return (randn(*shape).log_softmax(1), target.to(device), weight, 1, ignore_index), {}
    if op in ("_adaptive_avg_pool2d_backward", "_adaptive_avg_pool3d_backward"):
        x = randn(*shape)
        return (randn(*shape[:2], *arguments), x), {}
    if op == "avg_pool3d_backward":
        kernel, stride, padding = arguments
        x = randn(*shape)
        out = F.avg_pool3d(x, kernel, stride, padding)
        return (randn(*out.shape), x, [kernel] * 3, [stride] * 3, [padding] * 3, False, True, None), {}
    if op == "adaptive_max_pool2d_backward":
        x = randn(*shape)
        out, indices = F.adaptive_max_pool2d(x, arguments, return_indices=True)
        return (randn(*out.shape), x, indices), {}
    if op == "max_pool3d_with_indices_backward":
        kernel, stride, padding = arguments
        x = randn(*shape)
        out, indices = F.max_pool3d(x, kernel, stride, padding, return_indices=True)
        return (randn(*out.shape), x, [kernel] * 3, [stride] * 3, [padding] * 3, [1, 1, 1], False, indices), {}
    if op == "max_unpool2d":
        kernel = arguments
        pooled, indices = F.max_pool2d(randn(*shape), kernel, return_indices=True)
        return (pooled, indices, list(shape[2:])), {}
    if op == "_ctc_loss_backward":
        (t, n, c), target_length = shape, arguments
        log_probs = randn(t, n, c).log_softmax(2)
        targets = torch.randint(1, c, (n, target_length), generator=generator).to(device)
        input_lengths, target_lengths = [t] * n, [target_length] * n
        nll, log_alpha = torch.ops.aten._ctc_loss(log_probs, targets, input_lengths, target_lengths, 0, False)
        grad = torch.ones_like(nll)
        return (grad, log_probs, targets, input_lengths, target_lengths, nll, log_alpha, 0, False), {}
    if op == "scatter_add" and isinstance(arguments, tuple):  # ("expanded", entries)
        entries = arguments[1]
        index = torch.randint(0, shape[0], (entries, 1), generator=generator).to(device).expand(-1, shape[1])
        return (torch.zeros(shape, device=device), 0, index, randn(entries, shape[1])), {}
    if op in HAS_PYTORCH_DETERMINISTIC:
        entries = arguments
        rows = shape[0]
        index = torch.randint(0, rows, (entries,), generator=generator).to(device)
        values = randn(entries, *shape[1:])
        if op == "index_add":
            return (torch.zeros(shape, device=device), 0, index, values), {}
        if len(shape) == 1:  # scatter_add
            return (torch.zeros(shape, device=device), 0, index, values), {}
        columns = torch.randint(0, shape[1], (shape[0], entries // shape[0]), generator=generator)
        return (torch.zeros(shape, device=device), 1, columns.to(device), randn(*columns.shape)), {}
    if op == "index_reduce":  # index_reduce(self, dim, index, source, reduce, *, include_self=True)
        entries, reduce, include_self = arguments
        values = near_one if reduce == "prod" else randn
        index = randint(shape[0], entries)
        return (values(*shape), 0, index, values(entries, *shape[1:]), reduce), {"include_self": include_self}
    if op == "scatter_reduce.two":  # scatter_reduce.two(self, dim, index, src, reduce, *, include_self=True)
        index_shape, dim = arguments
        index = randint(shape[dim], *index_shape)
        return (near_one(*shape), dim, index, near_one(*index_shape), "prod"), {"include_self": True}
    if op == "put_":  # put_(self, index, source, accumulate=False)
        entries = arguments
        numel = 1
        for size in shape:
            numel *= size
        return (torch.zeros(shape, device=device), randint(numel, entries), randn(entries), True), {}
    if op in ("median.dim_values", "nanmedian.dim_values"):  # (self, dim, keepdim=False, *, values, indices)
        dim = arguments
        x = randn(*shape)
        if op.startswith("nan"):
            x[torch.rand(shape, generator=generator).to(device) < 0.05] = float("nan")
        reduced = list(shape)
        del reduced[dim]
        values, indices = torch.empty(reduced, device=device), torch.empty(reduced, dtype=torch.int64, device=device)
        return (x, dim, False), {"values": values, "indices": indices}
    if op == "histc":  # histc(self, bins=100, min=0, max=0)
        bins, low, high = arguments
        return (randn(*shape), bins, low, high), {}
    if op == "bincount":  # bincount(self, weights=None, minlength=0)
        bins = arguments
        return (randint(bins, *shape), randn(*shape), 0), {}
    pad = arguments
    spatial = 3 if op.endswith("3d_backward") else 2
    x = randn(*shape)
    padded = [size + 2 * pad for size in shape[2:]]
    return (randn(*shape[:2], *padded), x, [pad] * (2 * spatial)), {}


def route_covers(op, args, kwargs):
    """The route's verdict on these arguments: ``None`` when its deterministic implementation runs, else why not.

    Calling ``covers`` with the arguments the bench passes to the aten overload also checks that they
    fit the route's signature (a mismatch raises ``TypeError`` here, on any device).
    """
    from deepep_lightning.ops._routes import registered_routes
    from deepep_lightning.ops.routing import routed_aten_ops

    if op not in routed_aten_ops():
        raise KeyError(f"{op!r} is not a routed aten op; routed: {routed_aten_ops()}")
    return registered_routes()[op].covers(*args, **kwargs)


def routed_methods(op, shape, arguments, device):
    """deepep_deterministic (routing on, deterministic mode on) and pytorch_atomic (both off) for one aten op,
    and pytorch_deterministic (routing off, deterministic mode on) where PyTorch has a deterministic kernel."""
    from deepep_lightning.ops import patch_refused_ops

    aten = aten_overload(op)
    args, kwargs = _routed_args(op, shape, arguments, device)

    def call(*positional):
        out = aten(*positional, **kwargs)
        return out if isinstance(out, tuple) else (out,)

    def method(deterministic, routing):
        def run():
            return call(*args)

        def prepare():
            patch_refused_ops(routing)
            torch.use_deterministic_algorithms(deterministic)

        def fresh():  # on a copy of ``self``: an in-place op (put_) accumulates into it on every call
            return call(args[0].clone(), *args[1:])

        run.prepare, run.fresh = prepare, fresh
        return run

    methods = {"deepep_deterministic": method(True, True), "pytorch_atomic": method(False, False)}
    if op in HAS_PYTORCH_DETERMINISTIC:
        methods["pytorch_deterministic"] = method(True, False)
    methods["deepep_deterministic"].route_covers = route_covers(op, args, kwargs)
    return methods


def repeats_bitwise(methods):
    """Whether deepep_deterministic run twice gives bitwise equal gradients."""
    run = methods["deepep_deterministic"]
    _prepare(run)
    call = getattr(run, "fresh", run)
    first = [tensor.clone() for tensor in call()]
    again = call()
    return all(torch.equal(a, b) for a, b in zip(first, again))


def grid_sample_methods(shape, device):
    from deepep_lightning.ops import grid_sample

    n, c, h, w, ho, wo, half_width = shape
    x = torch.randn(n, c, h, w, device=device, requires_grad=True)
    grid = ((torch.rand(n, ho, wo, 2, device=device) * 2 - 1) * half_width).requires_grad_()
    leaves = (x, grid)
    ours = forward_graph(lambda: grid_sample(x, grid, align_corners=False), True)
    theirs = forward_graph(lambda: F.grid_sample(x, grid, align_corners=False), False)
    grad_output = torch.randn_like(ours)
    methods = {"deepep_deterministic": backward_call(ours, leaves, grad_output, True)}
    methods["pytorch_atomic"] = backward_call(theirs, leaves, grad_output, False)
    return methods


def interpolate_methods(shape, device):
    from deepep_lightning.ops import interpolate

    n, c, h, w, kwargs = shape
    x = torch.randn(n, c, h, w, device=device, requires_grad=True)
    kwargs = dict(kwargs, mode="bilinear", align_corners=False)
    ours = forward_graph(lambda: interpolate(x, **kwargs), True)
    grad_output = torch.randn_like(ours)
    methods = {"deepep_deterministic": backward_call(ours, (x,), grad_output, True)}
    methods["pytorch_atomic"] = backward_call(
        forward_graph(lambda: F.interpolate(x, **kwargs), False), (x,), grad_output, False
    )
    methods["pytorch_deterministic_decomposition"] = backward_call(
        forward_graph(lambda: F.interpolate(x, **kwargs), True), (x,), grad_output, True
    )
    return methods


def profile_table(methods, label, device, iterations=5):
    """torch.profiler's kernel table of each method, ``iterations`` calls after one warm-up, and the
    methods' GPU kernel time per call (ms; the sum of the CUDA kernels' own times, no launch gaps)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    sort_by = "self_device_time_total" if device == "cuda" else "self_cpu_time_total"
    sections, kernel_ms = [], {}
    for name, run in methods.items():
        if name == "pytorch_deterministic_decomposition":
            continue  # hundreds of small kernels, known to be 10-50x slower
        _prepare(run)
        run()
        with profile(activities=activities) as prof:
            for _ in range(iterations):
                run()
            if device == "cuda":
                torch.cuda.synchronize()
        averages = prof.key_averages()
        kernel_ms[name] = (
            sum(e.self_device_time_total for e in averages if e.device_type == DeviceType.CUDA) / iterations / 1e3
        )
        table = averages.table(sort_by=sort_by, row_limit=14, max_name_column_width=70)
        sections.append(f"##### {label} {name} ({iterations} calls)\n{table}")
    return "\n".join(sections), kernel_ms


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="directory for refused_ops.json")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--quick", action="store_true", help="tiny shapes, few repetitions (smoke run)")
    parser.add_argument("--repeats", type=int, default=25)
    parser.add_argument("--burst", type=int, default=20, help="back-to-back calls per timed sample")
    parser.add_argument(
        "--ops",
        help="comma-separated ops to time (default: all): grid_sample, interpolate_bilinear, keys of ROUTED_SHAPES",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="write refused_ops_profile.txt (torch.profiler) and add each method's GPU kernel ms",
    )
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a GPU (use --device cpu --quick for a smoke run)")
    from deepep_lightning.ops import cuda_kernels_available, extension_available, extension_error

    if not extension_available() or (args.device == "cuda" and not cuda_kernels_available()):
        parser.error(f"the deepep kernels are not available: {extension_error()}")
    timer = Timer(args.device, 1 if args.quick else args.burst)
    warmup, repeats = (1, 3) if args.quick else (5, args.repeats)
    started = time.time()
    rows = []
    profiles = []
    routed = QUICK_ROUTED if args.quick else ROUTED_SHAPES
    benchmarks = [
        ("grid_sample", QUICK_GRID if args.quick else GRID_SHAPES, grid_sample_methods),
        ("interpolate_bilinear", QUICK_INTERPOLATE if args.quick else INTERPOLATE_SHAPES, interpolate_methods),
        *(
            (name, cases, lambda case, device, name=name: routed_methods(name, case[0], case[1], device))
            for name, cases in routed.items()
        ),
    ]
    if args.ops:
        wanted = [op for op in args.ops.split(",") if op]
        known = [name for name, _, _ in benchmarks]
        unknown = [op for op in wanted if op not in known]
        if unknown:
            parser.error(f"--ops {unknown!r} are not benchmarked; known: {known}")
        benchmarks = [entry for entry in benchmarks if entry[0] in wanted]
    for op, shapes, make_methods in benchmarks:
        for shape in shapes:
            label = [s for s in shape if not isinstance(s, dict)] + [d for d in shape if isinstance(d, dict)]
            methods = make_methods(shape, args.device)
            repeat_bitwise = repeats_bitwise(methods)
            measured = measure(methods, timer, warmup, repeats)
            times = {name: wall for name, (wall, _) in measured.items()}
            ratio = times["deepep_deterministic"] / times["pytorch_atomic"]
            row = {
                "op": op,
                "shape": label,
                "median_ms": times,
                "host_ms": {name: host for name, (_, host) in measured.items()},
                "ratio_vs_atomic": ratio,
                "pytorch_deterministic_vs_atomic": (
                    times["pytorch_deterministic"] / times["pytorch_atomic"]
                    if "pytorch_deterministic" in times
                    else None
                ),
                "meets_1_5x_target": ratio <= 1.5,
                "repeat_bitwise": repeat_bitwise,
                "peak_extra_mib": peak_extra_mib(methods, args.device),
            }
            if hasattr(methods["deepep_deterministic"], "route_covers"):
                row["route_covers"] = methods["deepep_deterministic"].route_covers
            if args.profile:
                table, kernel_ms = profile_table(methods, f"{op} {label}", args.device)
                profiles.append(table)
                row["kernel_ms"] = kernel_ms
                row["kernel_ratio_vs_atomic"] = (
                    kernel_ms["deepep_deterministic"] / kernel_ms["pytorch_atomic"]
                    if kernel_ms["pytorch_atomic"] > 0
                    else None
                )
            rows.append(row)
            summary = f"  ratio={ratio:.2f} repeat_bitwise={repeat_bitwise}"
            if row.get("route_covers") is not None:
                summary += f" NOT ROUTED ({row['route_covers']})"
            if row.get("kernel_ratio_vs_atomic") is not None:
                summary += f" kernel_ratio={row['kernel_ratio_vs_atomic']:.2f}"
            print(
                f"{op:22s} {str(label):60s} "
                + " ".join(f"{k}={v:.3f}ms(host {row['host_ms'][k]:.3f})" for k, v in times.items())
                + summary,
                flush=True,
            )
    torch.use_deterministic_algorithms(False)
    from deepep_lightning.ops import patch_refused_ops

    patch_refused_ops(False)
    ratios = sorted(row["ratio_vs_atomic"] for row in rows)
    report = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "command": " ".join([sys.executable] + sys.argv),
        "median_ratio_vs_atomic": statistics.median(ratios),
        "worst_ratio_vs_atomic": ratios[-1],
        "what": "float32; grid_sample/interpolate: backward only, align_corners=False; routed aten ops: the"
        " overload the route registers, called directly (int64 indices; bincount: float32 weights);"
        " median_ms: wall ms per call over bursts of back-to-back calls (round-robin, after warm-up);"
        " host_ms: host ms per call; kernel_ms (--profile): GPU kernel ms per call",
        "burst": timer.burst,
        "warmup": warmup,
        "repeats": repeats,
        "wall_s": time.time() - started,
        "rows": rows,
        "all_repeat_bitwise": all(row["repeat_bitwise"] for row in rows),
        "not_routed": [[row["op"], row["shape"], row["route_covers"]] for row in rows if row.get("route_covers")],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "refused_ops.json").write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out / 'refused_ops.json'} in {report['wall_s']:.1f}s")
    if args.profile:
        (args.out / "refused_ops_profile.txt").write_text("\n\n".join(profiles) + "\n")
        print(f"wrote {args.out / 'refused_ops_profile.txt'}")
    if not report["all_repeat_bitwise"]:
        sys.exit("deepep_deterministic does not repeat bitwise on some shape (see refused_ops.json)")
    if args.device == "cuda" and report["not_routed"]:
        sys.exit(f"a route does not cover these cases, PyTorch's kernel was timed: {report['not_routed']}")


if __name__ == "__main__":
    main()
