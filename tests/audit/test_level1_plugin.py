"""The ``plugin`` column of the L1 catalogue: deterministic mode with ``patch_refused_ops(True)``
(deepep_lightning/audit/level1.py, catalogue/)."""

import re

import pytest
import torch

from deepep_lightning.audit import level1
from deepep_lightning.audit.catalogue import CATALOGUE, CatalogueEntry
from deepep_lightning.audit.level1 import COLUMNS, audit_catalogue, format_catalogue_table
from deepep_lightning.ops import refused_ops_patched, refused_ops_routing, routed_aten_ops

THREE = ["default", "deterministic", "plugin"]
#: Refused by PyTorch's deterministic mode on CUDA (torch 2.11, benchmarks/list_refused_ops.py), routed by the plugin.
REFUSED_ON_CUDA = [
    "cross_entropy_4d",
    "ctc_loss",
    "grid_sample_backward",
    "interpolate_bicubic_backward",
    "adaptive_avg_pool2d_backward",
    "avg_pool3d_backward",
    "max_pool3d_backward",
    "index_reduce_prod",
    "scatter_reduce_prod",
    "put_accumulate",
    "bincount_weights",
    "histc",
    "median_dim",
]


def _planted_refused(device, n, generator):
    """A stand-in for a refused op on CPU: raises PyTorch's refusal in deterministic mode unless routing is on."""
    values = torch.randn(64, generator=generator).to(device)

    def run():
        if torch.are_deterministic_algorithms_enabled() and not refused_ops_patched():
            raise RuntimeError("planted_refused does not have a deterministic implementation")
        return values.cumsum(0)

    return run


@pytest.fixture
def planted(monkeypatch):
    monkeypatch.setitem(
        CATALOGUE, "planted_refused", CatalogueEntry("planted_refused", _planted_refused, "planted", routed=("histc",))
    )
    return "planted_refused"


def test_plugin_is_a_column_between_deterministic_and_launch_blocking():
    assert COLUMNS == ("default", "deterministic", "plugin", "launch_blocking")


def test_catalogue_holds_the_refused_ops_the_plugin_routes():
    routed = set(routed_aten_ops())
    for name in (
        "cross_entropy_4d",
        "ctc_loss",
        "grid_sample_backward",
        "interpolate_bicubic_backward",
        "adaptive_avg_pool2d_backward",
        "max_pool3d_backward",
        "index_add_",
        "scatter_add_",
        "index_reduce_prod",
        "index_reduce_mean",
        "histc",
        "median_dim",
    ):
        assert CATALOGUE[name].routed, name
    for name, entry in CATALOGUE.items():
        assert set(entry.routed) <= routed, (name, entry.routed)  # names a route that exists
    assert not CATALOGUE["cumsum"].routed and not CATALOGUE["matmul"].routed


def test_plugin_column_runs_with_routing_on_and_restores_the_state_on_cpu():
    was_patched, was_deterministic = refused_ops_patched(), torch.are_deterministic_algorithms_enabled()
    table = audit_catalogue(["cumsum", "index_add_", "cross_entropy_4d"], columns=THREE, device="cpu", repeats=3)
    for op, cells in table["rows"].items():
        assert (cells["default"]["deterministic_mode"], cells["default"]["routing"]) == (False, False), op
        assert (cells["deterministic"]["deterministic_mode"], cells["deterministic"]["routing"]) == (True, False)
        assert (cells["plugin"]["deterministic_mode"], cells["plugin"]["routing"]) == (True, True), op
        assert cells["plugin"]["routed_ops"] == []  # the overrides sit at the CUDA key: a CPU op reaches none
        assert all(cell["seconds_per_call"] > 0 for cell in cells.values())
    # an op the plugin does not route reports what PyTorch's deterministic mode reports
    assert table["rows"]["cumsum"]["plugin"]["status"] == table["rows"]["cumsum"]["deterministic"]["status"]
    assert table["routed"] == {"cumsum": [], "index_add_": ["index_add_"], "cross_entropy_4d": ["nll_loss2d_forward"]}
    assert (refused_ops_patched(), torch.are_deterministic_algorithms_enabled()) == (was_patched, was_deterministic)


def test_plugin_column_buys_a_refused_op_and_forced_off_it_raises(planted, monkeypatch):
    table = audit_catalogue([planted, "cumsum"], columns=THREE, device="cpu", repeats=3)
    cells = table["rows"][planted]
    assert cells["default"]["status"] == "reproducible"
    assert cells["deterministic"]["raises"] and cells["deterministic"]["status"] == "error"
    assert cells["plugin"]["status"] == "reproducible" and not cells["plugin"]["raises"]
    row = next(line for line in format_catalogue_table(table).splitlines() if line.startswith(f"| {planted} |"))
    assert re.match(
        rf"\| {planted} \| yes \S+ ms \| raises \| yes \d+\.\d\dx \| planted \[plugin routes histc\] \|", row
    )

    # negative control: with the column's routing forced off, the plugin column shows PyTorch's refusal
    monkeypatch.setattr(level1, "_routing", lambda enabled: refused_ops_routing(False))
    forced_off = audit_catalogue([planted], columns=["plugin"], device="cpu", repeats=3)["rows"][planted]["plugin"]
    assert forced_off["raises"] and forced_off["routing"] is False


@pytest.mark.slow
def test_plugin_column_in_a_fresh_subprocess_runs_with_routing_on(monkeypatch):
    monkeypatch.setenv("DEEPEP_LIGHTNING_DISABLE_EXTENSION", "1")  # the workers skip the build; routing is on
    table = audit_catalogue(["cumsum"], columns=["deterministic", "plugin"], device="cpu", repeats=2, isolate=True)
    cells = table["rows"]["cumsum"]
    assert cells["deterministic"]["status"] == cells["plugin"]["status"] == "reproducible", cells
    assert cells["deterministic"]["routing"] is False and cells["plugin"]["routing"] is True


def _cell(status, seconds=None, **extra):
    return {"status": status, "seconds_per_call": seconds, "distinct_results": 3, "max_abs_diff": 2e-6, **extra}


def test_table_gives_default_time_and_the_other_columns_as_ratios():
    table = {
        "device": "cuda",
        "repeats": 10,
        "size": "large",
        "columns": THREE + ["launch_blocking"],
        "notes": {"index_add_": "atomic", "grid_sample_backward": "bilinear", "multi": "n/a default"},
        "routed": {"index_add_": ["index_add_"], "grid_sample_backward": ["grid_sampler_2d_backward"]},
        "rows": {
            "index_add_": {
                "default": _cell("divergent", 0.002),
                "deterministic": _cell("reproducible", 0.0076),
                "plugin": _cell("reproducible", 0.0021),
                "launch_blocking": _cell("divergent", 0.002),
            },
            "grid_sample_backward": {
                "default": _cell("divergent", 0.004),
                "deterministic": _cell("error", None, raises=True),
                "plugin": _cell("reproducible", 0.00001),
                "launch_blocking": _cell("n/a"),
            },
            "multi": {
                "default": _cell("n/a"),
                "deterministic": _cell("error", None, error="RuntimeError: boom"),
                "plugin": _cell("reproducible", 0.0005),
                "launch_blocking": _cell("n/a"),
            },
        },
    }
    lines = format_catalogue_table(table).splitlines()
    assert lines[2] == "| op | default | deterministic | plugin | launch_blocking | what |"
    assert lines[4] == (
        "| index_add_ | NO (3 distinct, max 2e-06) 2 ms | yes 3.80x | yes 1.05x | NO (3 distinct, max 2e-06) 1.00x"
        " | atomic [plugin routes index_add_] |"
    )
    assert lines[5].startswith(
        "| grid_sample_backward | NO (3 distinct, max 2e-06) 4 ms | raises | yes 0.0025x | n/a |"
    )
    assert lines[6].startswith("| multi | n/a | error: RuntimeError: boom | yes 0.5 ms | n/a | n/a default |")
    assert "plugin = deterministic mode with deepep_lightning's kernels" in "\n".join(lines)


@pytest.mark.gpu
def test_plugin_column_on_cuda_makes_refused_ops_reproducible_and_forced_off_they_raise(monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from deepep_lightning.ops import cuda_kernels_available

    if not cuda_kernels_available():
        pytest.skip("the deepep_lightning CUDA kernels did not build")
    ops = REFUSED_ON_CUDA + ["matmul"]
    table = audit_catalogue(ops, columns=THREE, device="cuda", repeats=5, size="small")  # plugin: a subprocess
    rows = table["rows"]
    for op in REFUSED_ON_CUDA:
        assert rows[op]["deterministic"]["raises"], (op, rows[op])
        assert rows[op]["plugin"]["status"] == "reproducible", (op, rows[op])
        assert rows[op]["plugin"]["routing"] and rows[op]["plugin"]["routed_ops"], (op, rows[op])
        assert rows[op]["plugin"]["seconds_per_call"] > 0
    assert rows["matmul"]["plugin"]["status"] == rows["matmul"]["deterministic"]["status"] == "reproducible"
    markdown = format_catalogue_table(table)
    assert re.search(r"\| cross_entropy_4d \| \S+.* ms \| raises \| yes \d+\.\d+x \|", markdown), markdown

    # negative control, in this process: the plugin column with its routing forced off meets PyTorch's refusal
    monkeypatch.setattr(level1, "_routing", lambda enabled: refused_ops_routing(False))
    forced = audit_catalogue(REFUSED_ON_CUDA, columns=["plugin"], device="cuda", repeats=3, size="small", isolate=False)
    for op in REFUSED_ON_CUDA:
        cell = forced["rows"][op]["plugin"]
        assert cell["raises"] and cell["routing"] is False and cell["routed_ops"] == [], (op, cell)


def test_cli_help_and_default_columns_name_the_plugin_column(capsys):
    from deepep_lightning.audit.cli import main

    with pytest.raises(SystemExit):
        main(["--help"])
    help_text = capsys.readouterr().out
    assert "plugin" in help_text and "patch_refused_ops(True)" in help_text
    with pytest.raises(SystemExit):
        main(["l1", "--help"])
    assert "default,deterministic,plugin,launch_blocking" in capsys.readouterr().out
