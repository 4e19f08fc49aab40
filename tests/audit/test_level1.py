"""L1: one op N times, and the catalogue table (deepep_lightning/audit/level1.py, catalogue/)."""

import itertools
import re

import pytest
import torch

import deepep_lightning.deepep.kernels  # noqa: F401  (registers DeepEP's value head)
from deepep_lightning.audit.catalogue import CATALOGUE, CatalogueEntry, catalogue_names, register
from deepep_lightning.audit.level1 import audit_callable, audit_catalogue, format_catalogue_table
from deepep_lightning.audit.repeat import run_repeats

FAST_OPS = ["index_add_", "scatter_add_", "cumsum", "embedding_backward", "grid_sample_backward", "gru_cell"]


def test_clean_callable_is_reproducible():
    x = torch.randn(4096)
    result = audit_callable(lambda: x.cumsum(0), repeats=20, name="cumsum")
    assert result.status == "reproducible" and result.distinct_results == 1 and result.max_abs_diff == 0.0


def test_planted_call_count_dependence_is_flagged_with_every_distinct_result():
    x, calls = torch.randn(64), itertools.count()
    result = audit_callable(lambda: x * (1 + 1e-6 * next(calls)), repeats=12)
    assert result.status == "divergent"
    assert result.distinct_results == 12 and 0 < result.max_abs_diff < 1e-3


def test_last_bit_difference_is_flagged():
    x, calls = torch.randn(8), itertools.count()

    def flip_last_bit_every_other_call():
        y = x.clone()
        if next(calls) % 2:
            y.view(torch.int32)[3] ^= 1
        return y

    stats = run_repeats(flip_last_bit_every_other_call, repeats=6)
    assert not stats.reproducible and stats.distinct_results == 2 and stats.max_abs_diff < 1e-6


def test_run_repeats_validates():
    with pytest.raises(ValueError, match="repeats"):
        run_repeats(lambda: torch.zeros(1), repeats=1)
    with pytest.raises(ValueError, match="no tensor"):
        run_repeats(lambda: 3, repeats=2)


def test_catalogue_covers_the_known_offenders_and_deepep():
    names = set(catalogue_names())
    for required in (
        "index_add_",
        "scatter_add_",
        "index_put_accumulate",
        "grid_sample_backward",
        "interpolate_bilinear_backward",
        "embedding_backward",
        "cumsum",
        "gru_cell",
        "multinomial",
        "all_action_q_reference",
        "all_action_q_atomic",
    ):
        assert required in names
    assert CATALOGUE["all_action_q_atomic"].cuda_only


def test_registering_adds_rows_and_refuses_a_taken_name_or_a_non_entry():
    entry = CATALOGUE["all_action_q_reference"]
    register(entry)  # the same entry again (a module imported twice): no change
    assert catalogue_names().count("all_action_q_reference") == 1
    impostor = CatalogueEntry("cumsum", entry.build, "another op")
    with pytest.raises(ValueError, match="already has an entry named 'cumsum'"):
        register(impostor)
    assert CATALOGUE["cumsum"] is not impostor
    with pytest.raises(ValueError, match="`entries` must be CatalogueEntry objects, got str"):
        register("cumsum")  # type: ignore[arg-type]


def test_catalogue_table_on_cpu():
    table = audit_catalogue(FAST_OPS + ["all_action_q_atomic"], device="cpu", repeats=3)
    rows = table["rows"]
    assert all(rows[op]["default"]["status"] == "reproducible" for op in FAST_OPS)  # CPU kernels: no atomics
    assert all(rows[op]["deterministic"]["status"] == "reproducible" for op in FAST_OPS)
    assert all(rows[op]["plugin"]["status"] == "reproducible" for op in FAST_OPS)
    assert rows["index_add_"]["launch_blocking"]["status"] == "n/a"
    assert rows["all_action_q_atomic"]["default"]["status"] == "n/a"
    markdown = format_catalogue_table(table)
    assert re.search(r"\| index_add_ \| yes \S+ ms \| yes \d+\.\d\dx \| yes \d+\.\d\dx \| n/a \|", markdown), markdown
    with pytest.raises(ValueError, match="not in the catalogue"):
        audit_catalogue(["no_such_op"], device="cpu")
    with pytest.raises(ValueError, match="columns"):
        audit_catalogue(["cumsum"], columns=["fast"], device="cpu")


@pytest.mark.gpu
def test_catalogue_on_cuda_atomics_differ_launch_blocking_does_not_help_deterministic_does():
    table = audit_catalogue(["index_add_", "scatter_add_", "grid_sample_backward", "matmul"], device="cuda", repeats=20)
    rows = table["rows"]
    for op in ("index_add_", "scatter_add_"):
        assert rows[op]["default"]["status"] == "divergent", rows[op]
        assert rows[op]["launch_blocking"]["status"] == "divergent", rows[op]
        assert rows[op]["deterministic"]["status"] == "reproducible", rows[op]
    assert rows["grid_sample_backward"]["deterministic"]["raises"], rows["grid_sample_backward"]
    assert rows["matmul"]["default"]["status"] == "reproducible"


@pytest.mark.parametrize("name", [n for n, e in CATALOGUE.items() if not e.needs_extension])
def test_every_catalogue_entry_builds_and_runs_on_cpu(name):
    fn = CATALOGUE[name].build(torch.device("cpu"), 1 << 10, torch.Generator().manual_seed(0))
    first, second = fn(), fn()
    first = first if isinstance(first, (tuple, list)) else [first]
    second = second if isinstance(second, (tuple, list)) else [second]
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert any(t.float().abs().sum() > 0 for t in first)  # fixed random inputs, never all zeros
