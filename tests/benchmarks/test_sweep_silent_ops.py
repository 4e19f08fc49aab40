"""The silent-op sweep (benchmarks/sweep_silent_ops.py, bitwise_repeat.py, silent_op_cases.py) on the CPU.

The sweep must be able to show a failure: a planted sum in a shuffled order comes out ``differs``, the same
sum in a fixed order ``bitwise``, and a deterministic-mode refusal ``raises``; the driver runs OpInfo cases
in both modes and exits 1 while any case differs with the plugin on.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "benchmarks"


@pytest.fixture
def sweep_modules(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bitwise_repeat
    import silent_op_cases

    return bitwise_repeat, silent_op_cases


def test_planted_shuffled_sum_differs_and_fixed_order_is_bitwise(sweep_modules):
    bitwise_repeat, silent_op_cases = sweep_modules
    verdicts = {case.name: bitwise_repeat.run_case(case) for case in silent_op_cases.planted_cases("cpu")}
    shuffled, ordered = verdicts["planted/shuffled_sum"], verdicts["planted/ordered_sum"]
    assert shuffled.verdict == "differs" and "output 0" in shuffled.detail, shuffled
    assert ordered.verdict == "bitwise" and ordered.compared == 2, ordered  # the output and one gradient


def test_refusals_errors_and_random_ops_get_their_own_verdicts(sweep_modules):
    bitwise_repeat, _ = sweep_modules
    Case, run_case = bitwise_repeat.Case, bitwise_repeat.run_case

    def refused(x):
        raise RuntimeError("index_add_cuda_ does not have a deterministic implementation, but you set ...")

    def broken(x):
        raise ValueError("bad sample")

    x = torch.randn(4)
    assert run_case(Case("refused", refused, lambda: (x,))).verdict == "raises"
    assert run_case(Case("broken", broken, lambda: (x,))).verdict == "error"
    # the global RNG is reseeded before every repeat, so a random op repeats its draws
    assert run_case(Case("dropout", lambda t: torch.nn.functional.dropout(t, 0.5), lambda: (x,))).verdict == "bitwise"
    with pytest.raises(ValueError, match="repeats must be an int >= 2, got 1"):
        run_case(Case("x", torch.neg, lambda: (x,)), repeats=1)


def test_bytes_equal_sees_one_ulp_nan_payloads_and_signed_zero(sweep_modules):
    bitwise_repeat, _ = sweep_modules
    one = torch.tensor(1.0)
    assert bitwise_repeat.bytes_equal(one, one.clone())
    assert not bitwise_repeat.bytes_equal(one, torch.nextafter(one, torch.tensor(2.0)))
    assert not bitwise_repeat.bytes_equal(torch.tensor(0.0), torch.tensor(-0.0))
    assert bitwise_repeat.bytes_equal(torch.tensor(float("nan")), torch.tensor(float("nan")))


@pytest.mark.slow
def test_driver_runs_opinfo_in_both_modes_and_fails_on_the_planted_difference(tmp_path: Path, run_process):
    pytest.importorskip("expecttest")  # PyTorch's OpInfo database needs it
    command = [
        sys.executable,
        str(BENCHMARKS / "sweep_silent_ops.py"),
        "--out",
        str(tmp_path),
        "--device",
        "cpu",
        "--sources",
        "opinfo,planted",
        "--only",
        "index_add,cumsum,planted",
        "--dtypes",
        "float32,float64",
        "--max-samples",
        "2",
        "--shards",
        "1",
    ]
    result = run_process(command, cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr  # only the planted control differs
    report = json.loads((tmp_path / "silent_ops.json").read_text())
    for mode in ("pytorch", "plugin"):
        summary = report["modes"][mode]
        assert summary["all_workers_done"] and summary["not_reached"] == 0
        assert [case["name"] for case in summary["differs"]] == ["planted/shuffled_sum"]
        assert summary["silent"] == [] and summary["planted_control_detected"]
        assert summary["counts"]["bitwise"] >= 8  # index_add and cumsum: 2 dtypes x 2 samples each, and the control
        assert summary["by_path"]["opinfo"] == {"bitwise": summary["counts"]["bitwise"] - 1}
    assert "planted/shuffled_sum: repeat 1" in result.stdout


def test_exit_status_fails_on_a_silent_op_and_on_a_blind_sweep(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from sweep_silent_ops import exit_status

    clean = {"silent": [], "planted_control_detected": True}
    assert exit_status({"modes": {"pytorch": {**clean, "silent": ["x"]}, "plugin": clean}}) == 0
    assert exit_status({"modes": {"plugin": {**clean, "silent": ["cudnn/grid_sample"]}}}) == 1
    assert exit_status({"modes": {"plugin": {**clean, "planted_control_detected": False}}}) == 2
