"""Bad inputs to deepep_lightning/deepep/kernels/all_action_q.py: every error names the argument and what it got."""

import importlib

import pytest
import torch

from deepep_lightning.deepep.kernels import all_action_q
from deepep_lightning.ops import extension_available


def valid(n=4, a=3, h=8, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    return {
        "z": torch.randn(n, h, generator=gen, dtype=dtype),
        "action_embedding": torch.randn(a, h, generator=gen, dtype=dtype),
        "w": torch.randn(h, generator=gen, dtype=dtype),
        "b": torch.randn(1, generator=gen, dtype=dtype),
    }


BAD_CASES = [
    # (argument, bad value, exception, message pattern)
    ("z", torch.randn(5), ValueError, r"z must be 2-D \[N, H\], got shape \(5,\)"),
    ("z", torch.randn(4, 8).long(), TypeError, r"z must be float32 or float64, got torch.int64"),
    ("z", torch.randn(4, 8).half(), TypeError, r"z must be float32 or float64, got torch.float16"),
    ("action_embedding", torch.randn(3), ValueError, r"action_embedding must be \[A, 8\].*got shape \(3,\)"),
    ("action_embedding", torch.randn(3, 7), ValueError, r"action_embedding must be \[A, 8\].*got shape \(3, 7\)"),
    ("action_embedding", torch.randn(0, 8), ValueError, r"A >= 1.*got shape \(0, 8\)"),
    (
        "action_embedding",
        torch.randn(3, 8).double(),
        TypeError,
        r"action_embedding must have z's dtype torch.float32, got torch.float64",
    ),
    ("w", torch.randn(7), ValueError, r"w must be \[8\] to match z of shape \(4, 8\), got shape \(7,\)"),
    ("w", torch.randn(1, 8), ValueError, r"w must be \[8\].*got shape \(1, 8\)"),
    ("w", torch.randn(8, device="meta"), ValueError, r"w must be on z's device cpu, got device\(type='meta'\)"),
    ("b", torch.randn(2), ValueError, r"b must be 0-dim or \[1\], got shape \(2,\)"),
    ("b", torch.randn(1, 1), ValueError, r"b must be 0-dim or \[1\], got shape \(1, 1\)"),
    ("b", 0.5, TypeError, r"b must be a torch.Tensor, got float 0.5"),
    ("b", torch.randn(1).double(), TypeError, r"b must have z's dtype torch.float32, got torch.float64"),
]


@pytest.mark.parametrize("argument,bad,error,pattern", BAD_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(BAD_CASES)])
def test_wrapper_rejects_bad_input(argument, bad, error, pattern):
    kwargs = valid()
    all_action_q(**kwargs)  # negative control: the unmodified inputs are accepted
    kwargs[argument] = bad
    with pytest.raises(error, match=pattern):
        all_action_q(**kwargs)


def test_wrapper_rejects_non_bool_deterministic():
    with pytest.raises(TypeError, match=r"deterministic must be a bool, got 'yes'"):
        all_action_q(**valid(), deterministic="yes")


def test_reference_fallback_gets_the_same_checks(monkeypatch):
    # The package attribute `all_action_q` is the function; the module lives in sys.modules.
    module = importlib.import_module("deepep_lightning.deepep.kernels.all_action_q")
    monkeypatch.setattr(module, "kernels_reason", lambda tensor: "no extension here")
    kwargs = valid()
    kwargs["w"] = torch.randn(7)
    with pytest.raises(ValueError, match=r"w must be \[8\]"):
        module.all_action_q(**kwargs)


COMPILED_CASES = [
    ("action_embedding", torch.randn(3, 7), r"action_embedding must be \[A, 8\].*got shape \[3, 7\]"),
    ("z", torch.randn(4, 8).int(), r"z must be float32 or float64, got Int"),
    ("w", torch.randn(8).double(), r"w must have z's dtype Float, got Double"),
    ("b", torch.randn(3), r"b must be 0-dim or \[1\], got shape \[3\]"),
]


@pytest.mark.parametrize("argument,bad,pattern", COMPILED_CASES, ids=[c[0] for c in COMPILED_CASES])
def test_compiled_op_checks_its_inputs_too(argument, bad, pattern):
    # Callers of torch.ops.deepep.* bypass the Python checks; the C++ TORCH_CHECKs must hold.
    assert extension_available()
    kwargs = valid()
    kwargs[argument] = bad
    with pytest.raises(RuntimeError, match=pattern):
        torch.ops.deepep.all_action_q(kwargs["z"], kwargs["action_embedding"], kwargs["w"], kwargs["b"])


def test_compiled_backward_checks_grad_q_shape():
    assert extension_available()
    kwargs = valid()
    with pytest.raises(RuntimeError, match=r"grad_q must be \[4, 3\] \(N, A\), got shape \[4, 2\]"):
        torch.ops.deepep.all_action_q_backward(torch.randn(4, 2), kwargs["z"], kwargs["action_embedding"], kwargs["w"])
