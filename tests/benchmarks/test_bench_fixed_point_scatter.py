"""benchmarks/bench_fixed_point_scatter.py on the CPU: the smoke run fills every column for every method, the
deterministic ones repeat bitwise, and bad input is refused by name."""

import json
import sys
from pathlib import Path

import pytest

from deepep_lightning.ops import extension_available

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_fixed_point_scatter  # noqa: E402

pytestmark = pytest.mark.skipif(not extension_available(), reason="deepep_lightning extension not buildable here")


def test_the_smoke_run_times_every_method_and_the_deterministic_ones_repeat(tmp_path):
    out = tmp_path / "fps.json"
    assert bench_fixed_point_scatter.main(["--device", "cpu", "--quick", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["done"] and len(result["rows"]) == 1
    row = result["rows"][0]
    for method in bench_fixed_point_scatter.METHODS:
        assert row[method]["median_ms"] > 0 and row[method]["max_abs_difference_from_float64"] < 1e-5
    assert row["fixed_point"]["bitwise_repeat"] and row["sorted"]["bitwise_repeat"]
    assert row["pytorch_atomic"]["ratio_vs_atomic"] == 1.0
    assert set(result["summary"]) == set(bench_fixed_point_scatter.METHODS)


def test_bad_arguments_are_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        bench_fixed_point_scatter.main(["--device", "cpu", "--repeats", "0", "--out", "/tmp/x.json"])
    assert "--repeats must be >= 1, got 0" in capsys.readouterr().err
