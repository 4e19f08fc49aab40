"""Heuristics that name the likely cause of a divergent op (atomics, uninitialised memory, RNG, ...)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = [
    "ATOMIC_OPS",
    "EMPTY_LIKE_OPS",
    "OVERWRITING_OPS",
    "RANDOM_OPS",
    "SILENT_OPS",
    "base_name",
    "likely_cause",
]

# ATen ops whose CUDA kernels accumulate with atomics (or race on duplicate indices): the order of
# the floating-point additions, hence the last bits, changes from call to call. Names without the
# namespace and overload; matched also with a trailing underscore stripped.
ATOMIC_OPS = frozenset(
    {
        "index_add",
        "scatter_add",
        "scatter_reduce",
        "_scatter_reduce",
        "index_reduce",
        "index_copy",
        "put",
        "embedding_dense_backward",
        "embedding_backward",
        "_embedding_bag_backward",
        "_embedding_bag_dense_backward",
        "_embedding_bag_per_sample_weights_backward",
        "grid_sampler_2d_backward",
        "grid_sampler_3d_backward",
        "bincount",
        "histc",
        "cumsum",
        "_ctc_loss_backward",
        "nll_loss2d_forward",
        "adaptive_avg_pool2d_backward",
        "_adaptive_avg_pool2d_backward",
        "adaptive_avg_pool3d_backward",
        "_adaptive_avg_pool3d_backward",
        "adaptive_max_pool2d_backward",
        "adaptive_max_pool3d_backward",
        "avg_pool3d_backward",
        "max_pool3d_with_indices_backward",
        "fractional_max_pool2d_backward",
        "fractional_max_pool3d_backward",
        "reflection_pad1d_backward",
        "reflection_pad2d_backward",
        "reflection_pad3d_backward",
        "replication_pad1d_backward",
        "replication_pad2d_backward",
        "replication_pad3d_backward",
        "max_unpool2d",
        "max_unpool3d",
        "median",
        "kthvalue",
        "_unsafe_index_put",
    }
)
# Ops whose CUDA kernels are nondeterministic although PyTorch's deterministic mode neither raises nor
# picks another kernel for them: they run and differ silently. Each names its cause and its fix.
SILENT_OPS = {
    "cudnn_grid_sampler_backward": (
        "cuDNN's grid sampler backward accumulates with atomics; PyTorch's deterministic mode does not flag it"
        " (F.grid_sample takes cuDNN for 4-D bilinear input, zeros padding, align_corners=True). HINT:"
        " DeterminismCallback (patch_refused_ops) routes it to a deterministic kernel"
    ),
    "adaptive_max_pool3d_backward": (
        "PyTorch's CUDA backward of 3-D adaptive max pooling adds into overlapping windows with atomics and its"
        " deterministic mode does not flag it (measured: nn.AdaptiveMaxPool3d's gradients differ run to run)."
        " HINT: DeterminismCallback (patch_refused_ops) routes it to a deterministic kernel"
    ),
}
# index_put and friends accumulate atomically only with accumulate=True
ACCUMULATE_OPS = frozenset({"index_put", "_index_put_impl", "_unsafe_index_put", "put"})
EMPTY_LIKE_OPS = frozenset(
    {
        "empty",
        "empty_like",
        "empty_strided",
        "new_empty",
        "new_empty_strided",
        "empty_permuted",
        "resize",
        "_resize_output",
    }
)
# ops that overwrite their `self` without reading it (an uninitialised `self` is fine)
OVERWRITING_OPS = frozenset(
    {
        "fill",
        "zero",
        "copy",
        "normal",
        "uniform",
        "bernoulli",
        "random",
        "exponential",
        "geometric",
        "cauchy",
        "log_normal",
        "set",
        "resize",
        "index_fill",
        "masked_fill",
        "randperm",
        "arange",
        "linspace",
        "full",
        "empty",
        "empty_like",
        "_to_copy",
    }
)
RANDOM_OPS = frozenset(
    {
        "rand",
        "rand_like",
        "randn",
        "randn_like",
        "randint",
        "randint_like",
        "randperm",
        "normal",
        "bernoulli",
        "multinomial",
        "uniform",
        "exponential",
        "geometric",
        "cauchy",
        "log_normal",
        "random",
        "native_dropout",
        "dropout",
        "feature_dropout",
        "alpha_dropout",
        "_fused_dropout",
        "poisson",
        "_standard_gamma",
        "_sample_dirichlet",
        "binomial",
        "rrelu_with_noise",
    }
)


def base_name(op: str) -> str:
    """``'aten.index_add_.default'`` → ``'index_add'``; ``'deepep.all_action_q.default'`` → ``'all_action_q'``."""
    parts = op.split(".")
    name = parts[1] if len(parts) >= 2 else parts[0]
    return name[:-1] if name.endswith("_") and not name.endswith("__") else name


def _upsample_backward(name: str) -> bool:
    return "upsample" in name and name.endswith("backward")


def likely_cause(
    record: Any,
    *,
    inputs_identical: bool,
    scalars_identical: bool = True,
    differing_input_producers: Sequence[str | None] = (),
) -> tuple[str, str]:
    """``(cause, explanation)`` for the first divergent op.

    ``cause`` is one of ``"atomic accumulation"``, ``"uninitialised memory"``, ``"RNG"``,
    ``"Python state"``, ``"input from outside"``, ``"unknown"``.

    Args:
        record: an :class:`~deepep_lightning.audit.op_hashes.OpRecord` (``op``, ``accumulate``,
            ``deterministic_arg``).
        inputs_identical: every tensor input had the same bytes in both runs.
        scalars_identical: the non-tensor arguments were equal.
        differing_input_producers: for inputs that differed, the op that last wrote each (None: a
            tensor created outside the audited computation).
    """
    name = base_name(record.op)
    if not inputs_identical:
        empty = [p for p in differing_input_producers if p and base_name(p) in EMPTY_LIKE_OPS]
        if empty:
            return (
                "uninitialised memory",
                f"it reads a tensor made by {empty[0]} that was never fully written; its bytes are whatever"
                " the allocator handed out",
            )
        if any(p is None for p in differing_input_producers):
            return (
                "input from outside",
                "an input tensor already differed when it entered the audited computation (made before it or"
                " outside PyTorch ops: data, a module attribute, NumPy/Python randomness, global state)",
            )
        return ("unknown", "an input differs, written by an op the log does not compare")
    if name in SILENT_OPS:
        return ("atomic accumulation", "same inputs, different outputs: " + SILENT_OPS[name])
    if (
        name in ATOMIC_OPS
        or _upsample_backward(name)
        or (name in ACCUMULATE_OPS and record.accumulate)
        or record.deterministic_arg is False
    ):
        return (
            "atomic accumulation",
            "same inputs, different outputs from an op whose kernel adds with atomics in a varying order;"
            " HINT: torch.use_deterministic_algorithms(True) (DeterminismCallback) selects a deterministic"
            " kernel or raises; CUDA_LAUNCH_BLOCKING=1 does not help",
        )
    if name in RANDOM_OPS:
        return (
            "RNG",
            "a random op drew different numbers from the same inputs: its generator was not reset between"
            " runs (a private torch.Generator kept across calls, or one seeded from time/os entropy)",
        )
    uninitialised = getattr(record, "uninitialised_inputs", [])
    if uninitialised and name not in OVERWRITING_OPS:
        return (
            "uninitialised memory",
            f"input #{uninitialised[0]} comes straight from {record.input_producers[uninitialised[0]]} and is"
            " read before being written: its bytes are whatever the allocator handed out",
        )
    if not scalars_identical:
        return (
            "Python state",
            "the tensor inputs are identical but a non-tensor argument differs (a call counter, time,"
            " Python's random module, or a value read from a previous run)",
        )
    return ("unknown", "identical inputs and arguments, different outputs, and the op is not a known offender")
