"""Exact hashes and bitwise comparison (deepep_lightning/audit/hashing.py)."""

import math

import torch

from deepep_lightning.audit.hashing import bitwise_equal, iter_named_tensors, max_abs_diff, tensor_hash, tensor_sha256


def _same_hash(a, b):
    return bool(torch.equal(tensor_hash(a), tensor_hash(b)))


def test_hash_is_a_function_of_the_bytes():
    x = torch.randn(1000)
    assert _same_hash(x, x.clone())
    assert not _same_hash(x, x.flip(0))  # same values, other positions
    y = x.clone()
    y[123] = torch.nextafter(y[123], torch.tensor(math.inf))  # one ulp
    assert not _same_hash(x, y)
    assert not _same_hash(torch.tensor([0.0]), torch.tensor([-0.0]))  # equal values, different bits


def test_hash_handles_dtypes_views_and_empty():
    for dtype in (torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.bool, torch.complex64):
        t = (torch.randn(7, 3) * 10).to(dtype)
        assert _same_hash(t, t.clone())
    t = torch.randn(6, 5)
    assert _same_hash(t.t(), t.t().contiguous())
    assert tensor_hash(torch.empty(0)).tolist() == [0, 0]


def test_bitwise_equal_is_stricter_than_torch_equal():
    assert torch.equal(torch.tensor([0.0]), torch.tensor([-0.0]))
    assert not bitwise_equal(torch.tensor([0.0]), torch.tensor([-0.0]))
    nan = torch.tensor([float("nan")])
    assert bitwise_equal(nan, nan.clone()) and not torch.equal(nan, nan.clone())
    assert not bitwise_equal(torch.zeros(2), torch.zeros(2, dtype=torch.float64))


def test_max_abs_diff_and_sha():
    a = torch.tensor([1.0, float("nan"), float("inf")])
    assert max_abs_diff(a, a.clone()) == 0.0
    assert max_abs_diff(a, torch.tensor([1.5, float("nan"), float("inf")])) == 0.5
    assert max_abs_diff(a, torch.tensor([1.0, 2.0, float("inf")])) == math.inf
    assert max_abs_diff(a, torch.zeros(4)) is None
    assert tensor_sha256(a) == tensor_sha256(a.clone()) != tensor_sha256(a[:2])


def test_iter_named_tensors_names_nested_results():
    names = [n for n, _ in iter_named_tensors({"loss": torch.zeros(()), "grads": [torch.ones(1), (torch.ones(2),)]})]
    assert names == ["loss", "grads[0]", "grads[1][0]"]
