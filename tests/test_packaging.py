"""Tests of the packaging (pyproject.toml, setup.py, MANIFEST.in): what a built wheel ships and uses.

Wheels are built from a copy of the checkout (offline: ``--no-build-isolation`` with the installed
setuptools and torch) and installed into fresh venvs that see the packages of the environment running
the tests: a virtualenv, a conda env or the base interpreter alike (a ``.pth`` file lists its
site-packages; ``--system-site-packages`` would show the *base* interpreter's, which in a virtualenv
lack Lightning). Two tests compile the C++ kernels, each for several CPU-minutes, too long for the
suite's 12 minutes on 2 cores, so they run only with
``DEEPEP_LIGHTNING_TEST_WHEEL_BUILD=1``: the ahead-of-time wheel (``DEEPEP_LIGHTNING_BUILD_EXTENSION=cpu``),
which then runs an op with no compiler on ``PATH``, and the JIT build of the plain wheel's installed
sources. Without it the suite checks that the loader would build from the installed copy.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
SOURCE_PATTERNS = ("*.cpp", "*.h", "*.cu", "*.cuh")
BUILD_ENV = "DEEPEP_LIGHTNING_TEST_WHEEL_BUILD"
AOT_ENV = "DEEPEP_LIGHTNING_BUILD_EXTENSION"
# What a source tree holds besides what the build reads: kept out of the copy to build from.
_NOT_COPIED = shutil.ignore_patterns(
    ".git", ".mypy_cache", ".pytest_cache", "__pycache__", "build", "dist", "*.egg-info", "lightning_logs",
    "runs", "logs", ".torch_extensions", ".whl", ".snap", "benchmarks", "tests", "examples", "*.so",
)  # fmt: skip


def _expected_package_data() -> set[str]:
    """The wheel paths of the checkout's extension sources, configs and typing marker."""
    csrc = REPO / "extensions" / "csrc"
    sources = {
        f"deepep_lightning/_csrc/{path.relative_to(csrc).as_posix()}"
        for pattern in SOURCE_PATTERNS
        for path in csrc.rglob(pattern)
    }
    configs = {f"deepep_lightning/configs/{path.name}" for path in (REPO / "configs").glob("*.yaml")}
    return sources | configs | {"deepep_lightning/py.typed"}


def _missing_from_wheel(names: set[str]) -> set[str]:
    return _expected_package_data() - names


@pytest.fixture(scope="module")
def source_tree(tmp_path_factory) -> Path:
    source = tmp_path_factory.mktemp("packaging") / "src"
    shutil.copytree(REPO, source, ignore=_NOT_COPIED)
    return source


def _build_wheel(run_process, source: Path, out: Path, **env: str) -> Path:
    command = [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation", "--no-index"]
    built = run_process([*command, "-w", str(out)], env={**os.environ, **env})
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    (wheel,) = out.glob("deepep_lightning-*.whl")
    return wheel


@pytest.fixture(scope="module")
def wheel(source_tree, run_process, tmp_path_factory) -> Path:
    return _build_wheel(run_process, source_tree, tmp_path_factory.mktemp("wheel"), **{AOT_ENV: "0"})


@pytest.fixture(scope="module")
def venv_python(wheel, run_process, tmp_path_factory) -> Path:
    return _venv_with(run_process, wheel, tmp_path_factory.mktemp("venv"))


def _venv_with(run_process, wheel: Path, venv: Path) -> Path:
    """A venv that sees this environment's packages, with ``wheel`` installed into it; its python."""
    created = run_process([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    assert created.returncode == 0, created.stderr[-3000:]
    python = venv / "bin" / "python"
    (purelib,) = venv.glob("lib/python*/site-packages")
    # this environment's site-packages (a venv's own, a conda env's, the base's, the user's), after the venv's
    visible = [path for path in sys.path if Path(path).name in ("site-packages", "dist-packages")]
    (purelib / "_tests_environment.pth").write_text("\n".join(visible) + "\n")
    # --ignore-installed: the environment it sees may hold this package already (an editable install)
    install = [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q"]
    install += ["--ignore-installed"]
    installed = run_process([*install, str(wheel)])
    assert installed.returncode == 0, installed.stdout[-3000:] + installed.stderr[-3000:]
    return python


def _run_installed(run_process, python: Path, code: str, cwd: Path, **env: str) -> dict:
    """Runs ``code`` with the venv's python outside the checkout; returns the JSON it prints last."""
    environment = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    environment.update(env)
    result = run_process([str(python), "-c", code], cwd=cwd, env=environment)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


_LOCATE = """
import json
import deepep_lightning
from deepep_lightning.ops import extension_loader
try:
    sources, error, hint = extension_loader.sources(with_cuda=True), None, None
except FileNotFoundError as err:
    sources, error, hint = [], str(err), extension_loader.build_hint(err)
print(json.dumps({"package": deepep_lightning.__file__, "csrc": str(extension_loader.csrc_dir()),
                  "sources": sources, "error": error, "hint": hint}))
"""


def test_wheel_ships_sources_configs_typing_license_and_metadata(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        dist_info = next(name.split("/")[0] for name in names if name.endswith(".dist-info/METADATA"))
        metadata = archive.read(f"{dist_info}/METADATA").decode()
        entry_points = archive.read(f"{dist_info}/entry_points.txt").decode()
    assert _missing_from_wheel(names) == set()
    assert any(name.endswith("_csrc/refused_ops.cpp") for name in names)
    assert any(name.endswith("_csrc/cuda/grid_sample_backward.cu") for name in names)
    assert any(name.endswith("_csrc/deepep/all_action_q.cpp") for name in names)  # the workload's kernels
    assert any(name.endswith("_csrc/deepep/cuda/all_action_q_cuda.cu") for name in names)
    assert f"{dist_info}/licenses/LICENSE" in names
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert "Name: deepep_lightning" in metadata
    assert "License-Expression: Apache-2.0" in metadata
    assert f"Requires-Python: {project['requires-python']}" in metadata
    for requirement in project["dependencies"]:
        assert f"Requires-Dist: {requirement}" in metadata
    assert "deepep-audit = deepep_lightning.audit.cli:main" in entry_points
    assert "deepep-compare = deepep_lightning.compare.cli:main" in entry_points


def test_missing_package_data_is_reported():
    """Negative control: the file-list check names a source the wheel lacks."""
    names = _expected_package_data()
    dropped = "deepep_lightning/_csrc/deepep/cuda/all_action_q_cuda.cu"
    assert _missing_from_wheel(names - {dropped}) == {dropped}


def test_installed_wheel_builds_from_its_own_sources(venv_python, run_process, tmp_path):
    found = _run_installed(run_process, venv_python, _LOCATE, tmp_path, DEEPEP_LIGHTNING_DISABLE_EXTENSION="1")
    site_packages = Path(found["package"]).parents[1]
    assert site_packages.name == "site-packages" and venv_python.parents[1] in site_packages.parents
    assert found["csrc"] == str(site_packages / "deepep_lightning" / "_csrc")
    assert found["error"] is None
    installed = {Path(path).relative_to(found["csrc"]).as_posix() for path in found["sources"]}
    in_checkout = {
        path.relative_to(REPO / "extensions" / "csrc").as_posix()
        for pattern in ("*.cpp", "cuda/*.cu", "deepep/*.cpp", "deepep/cuda/*.cu")
        for path in (REPO / "extensions" / "csrc").glob(pattern)
    }
    assert installed == in_checkout


def test_installed_wheel_without_sources_says_reinstall(venv_python, run_process, tmp_path):
    """Negative control: with the shipped sources removed, the loader names both places and the fix."""
    (shipped,) = venv_python.parents[1].glob("lib/python*/site-packages/deepep_lightning/_csrc")
    shutil.move(shipped, tmp_path / "_csrc")
    try:
        missing = _run_installed(run_process, venv_python, _LOCATE, tmp_path, DEEPEP_LIGHTNING_DISABLE_EXTENSION="1")
    finally:
        shutil.move(tmp_path / "_csrc", shipped)
    assert missing["sources"] == []
    assert str(shipped) in missing["error"]
    assert "reinstall deepep_lightning" in missing["hint"] and "compiler" not in missing["hint"]


@pytest.mark.skipif(os.environ.get(BUILD_ENV) != "1", reason=f"the JIT build takes minutes; {BUILD_ENV}=1 runs it")
def test_installed_wheel_jit_builds_the_cpu_op(wheel, run_process, tmp_path_factory, tmp_path):
    python = _venv_with(run_process, wheel, tmp_path_factory.mktemp("venv_build"))
    code = (
        "import json; from deepep_lightning.ops import extension_available, extension_error; "
        "print(json.dumps({'available': extension_available(), 'error': extension_error()}))"
    )
    built = _run_installed(run_process, python, code, tmp_path, TORCH_EXTENSIONS_DIR=str(tmp_path / "extensions"))
    assert built == {"available": True, "error": None}


_RUN_OP = """
import json, shutil, torch
from deepep_lightning.deepep.kernels import all_action_q, all_action_q_reference
from deepep_lightning.ops import extension_loader, extension_available
z, e, w, b = (torch.randn(*shape, dtype=torch.float64) for shape in ((5, 4), (3, 4), (4,), (1,)))
available = extension_available()
q = all_action_q(z, e, w, b)
print(json.dumps({"available": available, "error": extension_loader.extension_error(),
                  "library": str(extension_loader.extension_library()), "compiler": shutil.which("c++"),
                  "matches": torch.allclose(q, all_action_q_reference(z, e, w, b), rtol=1e-12, atol=1e-12)}))
"""


@pytest.mark.skipif(os.environ.get(BUILD_ENV) != "1", reason=f"the build takes minutes; {BUILD_ENV}=1 runs it")
def test_ahead_of_time_wheel_runs_the_op_without_a_compiler(source_tree, wheel, venv_python, run_process, tmp_path):
    """``DEEPEP_LIGHTNING_BUILD_EXTENSION=cpu pip wheel``: the wheel holds ``_C*.so``; with no compiler, ninja or
    cache the op runs from it. Negative control: the plain wheel's JIT build fails there and falls back."""
    aot_wheel = _build_wheel(run_process, source_tree, tmp_path / "aot_wheel", **{AOT_ENV: "cpu"})
    with zipfile.ZipFile(aot_wheel) as archive:
        compiled = [name for name in archive.namelist() if name.startswith("deepep_lightning/_C.")]
    assert len(compiled) == 1 and compiled[0].endswith(".so"), compiled
    assert "-py3-none-any" not in aot_wheel.name  # a platform wheel, tied to this Python and torch
    python = _venv_with(run_process, aot_wheel, tmp_path / "venv_aot")
    no_compiler = tmp_path / "bin"  # PATH without c++, g++, ninja or nvcc
    no_compiler.mkdir()
    cache = tmp_path / "extensions"
    env = {"PATH": str(no_compiler), "TORCH_EXTENSIONS_DIR": str(cache), "DEEPEP_LIGHTNING_DISABLE_EXTENSION": "0"}
    ran = _run_installed(run_process, python, _RUN_OP, tmp_path, **env)
    assert ran["compiler"] is None
    assert ran["available"] is True and ran["error"] is None and ran["matches"] is True
    (site_packages,) = python.parents[1].glob("lib/python*/site-packages")
    assert ran["library"] == str(site_packages / compiled[0])
    assert not any(cache.rglob("*.so"))  # nothing was JIT-built
    plain = _run_installed(run_process, venv_python, _RUN_OP, tmp_path, **env)
    assert plain["available"] is False and plain["matches"] is True  # the reference ran instead
    assert plain["library"] == "None" and plain["error"]
