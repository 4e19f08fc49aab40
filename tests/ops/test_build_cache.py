"""Tests of deepep_lightning/ops/_build_cache.py: the keyed cache directory and the two build lines.

The JIT build itself is replaced by a stub that writes the library file where torch would, so a
"first use" costs nothing here; the real build's lines are seen at the start of every test session
on a machine without a cache.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.utils.cpp_extension as cpp_extension
from lightning.fabric.utilities.rank_zero import rank_zero_only

from deepep_lightning.ops import _build_cache, extension_loader

BUILDING = "deepep_lightning: building the C++/CUDA extension (first use, about "
BUILT = "deepep_lightning: built the C++/CUDA extension in "


@pytest.fixture
def stub_build(tmp_path, monkeypatch):
    """The loader's JIT path with ``load`` stubbed, on a copy of the sources; returns the calls made."""
    sources = tmp_path / "csrc"
    shutil.copytree(extension_loader.csrc_dir(), sources)
    monkeypatch.setattr(extension_loader, "csrc_dir", lambda: sources)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the CPU build, also on a GPU machine
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    calls: list[Path] = []

    def fake_load(name, sources, build_directory, **kwargs):
        calls.append(Path(build_directory))
        (Path(build_directory) / f"{name}.so").write_bytes(b"")

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    return calls


def _lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("deepep_lightning: ")]


def test_a_first_build_prints_both_lines_and_a_cached_load_none(stub_build, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(rank_zero_only, "rank", 0)
    directory = tmp_path / "extensions" / "deepep_lightning_ext_cpu"
    library, with_cuda = extension_loader.jit_build_and_load()
    assert with_cuda is False
    first = _lines(capsys)
    assert len(first) == 2, first
    assert first[0].startswith(BUILDING) and f"CPU kernels; cached in {directory})" in first[0]
    assert first[1].startswith(BUILT) and first[1].endswith(" s")
    assert library == directory / "deepep_lightning_ext_cpu.so"
    # negative control: the library is cached, so the next load says nothing (and still goes through torch)
    extension_loader.jit_build_and_load()
    assert _lines(capsys) == []
    assert stub_build == [directory, directory]
    # an edited header makes the next load compile again, and say so
    header = next((extension_loader.csrc_dir()).glob("*.h"))
    later = (directory / "deepep_lightning_ext_cpu.so").stat().st_mtime + 10
    os.utime(header, (later, later))
    extension_loader.jit_build_and_load()
    again = _lines(capsys)
    assert len(again) == 2 and again[0].startswith(BUILDING) and again[1].startswith(BUILT)


def test_a_cuda_source_edited_before_a_cpu_build_is_announced_once(stub_build, tmp_path, capsys, monkeypatch):
    """ninja leaves a CPU-only build's library alone when only a ``.cu`` changed; the load after that says nothing."""
    monkeypatch.setattr(rank_zero_only, "rank", 0)
    extension_loader.jit_build_and_load()
    _lines(capsys)

    def up_to_date_load(name, sources, build_directory, **kwargs):  # nothing it compiles changed: no new library
        assert not any(source.endswith(".cu") for source in sources)

    monkeypatch.setattr(cpp_extension, "load", up_to_date_load)
    library = tmp_path / "extensions" / "deepep_lightning_ext_cpu" / "deepep_lightning_ext_cpu.so"
    now = time.time()
    os.utime(library, (now - 100, now - 100))
    kernel = next(extension_loader.csrc_dir().rglob("*.cu"))
    os.utime(kernel, (now - 50, now - 50))  # newer than the library, as after an edit
    extension_loader.jit_build_and_load()
    assert len(_lines(capsys)) == 2  # a source is newer: the load asks ninja, and says so
    extension_loader.jit_build_and_load()
    assert _lines(capsys) == []  # the library was marked current: no second announcement


def test_other_ranks_build_silently(stub_build, capsys, monkeypatch):
    monkeypatch.setattr(rank_zero_only, "rank", 1)
    extension_loader.jit_build_and_load()
    assert _lines(capsys) == []
    assert len(stub_build) == 1


def test_the_estimate_grows_with_the_cuda_sources_and_shrinks_with_jobs(monkeypatch):
    monkeypatch.setenv("MAX_JOBS", "2")
    cpu_only = _build_cache._estimated_minutes(cpp_files=19, cu_files=0)
    with_cuda = _build_cache._estimated_minutes(cpp_files=19, cu_files=18)
    monkeypatch.setenv("MAX_JOBS", "16")
    assert cpu_only == 2 and with_cuda > cpu_only and _build_cache._estimated_minutes(19, 18) < with_cuda


def test_done_before_start_is_refused(tmp_path):
    with pytest.raises(RuntimeError, match="before start"):
        _build_cache.BuildAnnouncement(tmp_path, ["a.cpp"]).done()


def test_default_cache_directory_is_keyed_by_interpreter_torch_and_cuda(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setattr(cpp_extension, "get_default_build_root", lambda: str(tmp_path / "root"))
    here = _build_cache.build_directory("ext")
    assert here.is_dir() and here.name == "ext"
    assert here.parent.parent == tmp_path / "root" / "deepep_lightning"
    key = here.parent.name
    assert key.startswith(f"py{sys.version_info.major}{sys.version_info.minor}")
    assert f"_torch{torch.__version__.split('+')[0]}_" in key
    assert ("_cpu_" if torch.version.cuda is None else f"_cu{torch.version.cuda.replace('.', '')}_") in key
    assert _build_cache.build_directory("ext") == here  # stable for one environment
    # another environment (a venv: another prefix; another torch; another CUDA) gets another directory
    others = set()
    with monkeypatch.context() as patched:
        patched.setattr(sys, "prefix", str(tmp_path / "venv"))
        others.add(_build_cache.build_directory("ext"))
    with monkeypatch.context() as patched:
        patched.setattr(torch, "__version__", "0.0.1")
        others.add(_build_cache.build_directory("ext"))
    with monkeypatch.context() as patched:
        patched.setattr(torch.version, "cuda", "99.9")
        others.add(_build_cache.build_directory("ext"))
    assert len(others) == 3 and here not in others


def test_torch_extensions_dir_keeps_torchs_layout(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "mine"))
    monkeypatch.setattr(cpp_extension, "get_default_build_root", lambda: pytest.fail("the default root was read"))
    assert _build_cache.build_directory("ext") == tmp_path / "mine" / "ext"
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "venv"))  # not keyed: the user chose the directory
    assert _build_cache.build_directory("ext") == tmp_path / "mine" / "ext"
