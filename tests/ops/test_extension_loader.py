"""Tests of deepep_lightning/ops/extension_loader.py: build once, thread-safe, one warning on fallback."""

import importlib.machinery
import os
import shutil
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from deepep_lightning.ops import extension_available, extension_loader, grid_sample
from deepep_lightning.ops.extension_loader import ExtensionLoader


@pytest.fixture
def fresh_loader(monkeypatch):
    """The process's loader replaced by one that has not tried yet, whose build is a counting stub."""
    monkeypatch.delenv(extension_loader.DISABLE_ENV, raising=False)
    calls = []

    def fake_build():
        calls.append(threading.get_ident())
        time.sleep(0.05)  # widen the race window for the concurrency test
        return Path("fake.so"), False

    monkeypatch.setattr(extension_loader, "LOADER", ExtensionLoader(fake_build))
    return calls


def test_sources_cover_every_cpp_and_cu_file():
    cpu_sources = extension_loader.sources(with_cuda=False)
    all_sources = extension_loader.sources(with_cuda=True)
    assert any(s.endswith("csrc/refused_ops.cpp") for s in cpu_sources)
    assert any(s.endswith("csrc/deepep/all_action_q.cpp") for s in cpu_sources)  # the workload's, same build
    assert all(s.endswith(".cpp") for s in cpu_sources)
    assert any(s.endswith("csrc/cuda/grid_sample_backward.cu") for s in all_sources)
    assert any(s.endswith("csrc/deepep/cuda/all_action_q_cuda.cu") for s in all_sources)
    assert set(cpu_sources) < set(all_sources)
    on_disk = set()
    for folder in (extension_loader.csrc_dir(), extension_loader.csrc_dir() / "deepep"):
        on_disk |= {str(p) for p in folder.glob("*.cpp")} | {str(p) for p in folder.glob("cuda/*.cu")}
    assert set(all_sources) == on_disk


def test_build_failure_falls_back_with_exactly_one_warning(fresh_loader, monkeypatch):
    def broken_build():
        raise OSError("c++: command not found")

    monkeypatch.setattr(extension_loader, "LOADER", ExtensionLoader(broken_build))
    x, grid = torch.randn(1, 2, 5, 5, requires_grad=True), torch.rand(1, 3, 3, 2) * 2 - 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert extension_available() is False
        assert extension_available() is False
        out = grid_sample(x, grid, align_corners=False)
    fallbacks = [w for w in caught if issubclass(w.category, RuntimeWarning) and "falling back" in str(w.message)]
    assert len(fallbacks) == 1, [str(w.message) for w in caught]
    assert "c++: command not found" in str(fallbacks[0].message)
    assert "command not found" in extension_loader.extension_error()
    assert torch.equal(out, F.grid_sample(x, grid, align_corners=False))
    assert "deepep" not in out.grad_fn.name()  # PyTorch's autograd, not the compiled op


def test_disable_env_uses_reference_without_warning(fresh_loader, monkeypatch):
    monkeypatch.setenv(extension_loader.DISABLE_ENV, "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert extension_available() is False
    assert fresh_loader == []  # never tried to build
    assert extension_loader.DISABLE_ENV in extension_loader.extension_error()


def test_concurrent_first_use_builds_once_and_runs_hooks_once(fresh_loader):
    hook_calls = []
    extension_loader.on_extension_loaded(lambda: hook_calls.append(1))
    results = []
    threads = [threading.Thread(target=lambda: results.append(extension_available())) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [True] * 4
    assert len(fresh_loader) == 1, "the extension was built more than once"
    assert hook_calls == [1]
    # A hook registered after the load runs at once.
    extension_loader.on_extension_loaded(lambda: hook_calls.append(2))
    assert hook_calls == [1, 2]


@pytest.mark.skipif(not (shutil.which("c++") or shutil.which("g++")), reason="no C++ compiler")
def test_real_extension_is_loaded_once_per_process():
    assert extension_available()
    loader = extension_loader.LOADER
    assert loader.attempted and loader.loaded and extension_loader.extension_error() is None


_CUDA_HOME_GUESS = "No CUDA runtime is found"


def _stderr_of(run_process, code: str) -> str:
    run = run_process([sys.executable, "-c", code], env=dict(os.environ))
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stderr


@pytest.mark.slow
@pytest.mark.skipif(not (shutil.which("c++") or shutil.which("g++")), reason="no C++ compiler")
def test_a_cached_load_prints_no_build_line_and_no_cuda_home_guess(run_process):
    load = "from deepep_lightning.ops import extension_available; assert extension_available()"
    stderr = _stderr_of(run_process, load)
    # the session's start built it, so this load compiles nothing and says nothing (test_build_cache.py
    # shows the lines of a load that compiles)
    assert "deepep_lightning: build" not in stderr
    # negative control: torch's own import logs the guess on this machine (a CUDA toolkit, no GPU)
    if _CUDA_HOME_GUESS not in _stderr_of(run_process, "import torch.utils.cpp_extension"):
        pytest.skip("torch logs no CUDA_HOME guess here (a visible GPU, or no CUDA toolkit)")
    assert _CUDA_HOME_GUESS not in stderr


def test_a_compiled_module_is_loaded_instead_of_building(tmp_path, monkeypatch):
    compiled = tmp_path / "_C.so"
    loaded: list[str] = []
    monkeypatch.setattr(extension_loader, "compiled_module_path", lambda: compiled)
    monkeypatch.setattr(torch.ops, "load_library", loaded.append)
    monkeypatch.setattr(
        extension_loader, "jit_build_and_load", lambda: pytest.fail("JIT-built despite a compiled module")
    )
    library, with_cuda = extension_loader.build_and_load()
    assert with_cuda is (torch.cuda.is_available() and extension_loader.cuda_kernels_available())
    assert loaded == [str(compiled)] and library == compiled


def test_a_compiled_module_that_does_not_load_falls_back_to_the_jit_build(tmp_path, monkeypatch):
    """Negative control: a module built against another torch warns once and the JIT build runs."""
    compiled = tmp_path / "_C.so"
    jit_builds: list[int] = []

    def broken(path):
        raise OSError(f"{path}: undefined symbol: _ZN3c104impl")

    monkeypatch.setattr(extension_loader, "compiled_module_path", lambda: compiled)
    monkeypatch.setattr(torch.ops, "load_library", broken)
    monkeypatch.setattr(extension_loader, "jit_build_and_load", lambda: jit_builds.append(1) or (Path("jit.so"), False))
    with pytest.warns(RuntimeWarning, match=r"does not load .*undefined symbol.*JIT-building"):
        assert extension_loader.build_and_load() == (Path("jit.so"), False)
    assert jit_builds == [1]


def test_a_compiled_module_older_than_the_checkout_sources_is_ignored(tmp_path):
    package, sources = tmp_path / "deepep_lightning", tmp_path / "csrc"
    package.mkdir(), sources.mkdir()
    assert extension_loader.compiled_module_in(package, sources) is None  # none built
    compiled = package / f"_C{importlib.machinery.EXTENSION_SUFFIXES[0]}"
    compiled.write_bytes(b"")
    (sources / "op.cpp").write_text("// older")
    os.utime(sources / "op.cpp", (0, 0))
    assert extension_loader.compiled_module_in(package, sources) == compiled
    (sources / "op.h").write_text("// edited after the build")
    os.utime(sources / "op.h", (compiled.stat().st_mtime + 10,) * 2)
    assert extension_loader.compiled_module_in(package, sources) is None  # the checkout's edit wins: JIT
    assert extension_loader.compiled_module_in(package, None) == compiled  # an installed package has no checkout
