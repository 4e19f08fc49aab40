"""Tests of the packaging (pyproject.toml, setup.py, MANIFEST.in): what a built wheel ships and uses.

A wheel is built from a copy of the checkout (offline: ``--no-build-isolation`` with the installed
setuptools) and installed into a fresh venv that sees this environment's packages. The JIT build of
the op from the installed sources takes minutes on 2 CPU cores, so it runs only with
``DEEPEP_LIGHTNING_TEST_WHEEL_BUILD=1``; CI checks that the loader would build from the installed copy.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
SOURCE_PATTERNS = ("*.cpp", "*.h", "*.cu", "*.cuh")
BUILD_ENV = "DEEPEP_LIGHTNING_TEST_WHEEL_BUILD"
# What a source tree holds besides what the build reads: kept out of the copy to build from.
_NOT_COPIED = shutil.ignore_patterns(
    ".git", ".mypy_cache", ".pytest_cache", "__pycache__", "build", "dist", "*.egg-info", "lightning_logs",
    "runs", "logs", ".torch_extensions", ".whl", ".snap", "benchmarks", "tests", "examples",
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
def wheel(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("packaging")
    source = root / "src"
    shutil.copytree(REPO, source, ignore=_NOT_COPIED)
    command = [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation"]
    subprocess.run([*command, "--no-index", "-q", "-w", str(root / "wheel")], check=True, timeout=300)
    (built,) = (root / "wheel").glob("deepep_lightning-*.whl")
    return built


@pytest.fixture(scope="module")
def venv_python(wheel, tmp_path_factory) -> Path:
    return _venv_with(wheel, tmp_path_factory.mktemp("venv"))


def _venv_with(wheel: Path, venv: Path) -> Path:
    """A venv that sees this environment's packages, with ``wheel`` installed into it; its python."""
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    install = [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q"]
    subprocess.run([*install, str(wheel)], check=True, timeout=300)
    return python


def _run_installed(python: Path, code: str, cwd: Path, **env: str) -> dict:
    """Runs ``code`` with the venv's python outside the checkout; returns the JSON it prints last."""
    environment = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    environment.update(env)
    result = subprocess.run(
        [str(python), "-c", code], cwd=cwd, env=environment, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


_LOCATE = """
import json
import deepep_lightning
from deepep_lightning.ops import _loader
try:
    sources, error, hint = _loader._sources(with_cuda=True), None, None
except FileNotFoundError as err:
    sources, error, hint = [], str(err), _loader._build_hint(err)
print(json.dumps({"package": deepep_lightning.__file__, "csrc": str(_loader.csrc_dir()),
                  "sources": sources, "error": error, "hint": hint}))
"""


def test_wheel_ships_sources_configs_typing_license_and_metadata(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        dist_info = next(name.split("/")[0] for name in names if name.endswith(".dist-info/METADATA"))
        metadata = archive.read(f"{dist_info}/METADATA").decode()
        entry_points = archive.read(f"{dist_info}/entry_points.txt").decode()
    assert _missing_from_wheel(names) == set()
    assert any(name.endswith("_csrc/all_action_q.cpp") for name in names)
    assert any(name.endswith("_csrc/cuda/all_action_q_cuda.cu") for name in names)
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
    dropped = "deepep_lightning/_csrc/cuda/all_action_q_cuda.cu"
    assert _missing_from_wheel(names - {dropped}) == {dropped}


def test_installed_wheel_builds_from_its_own_sources(venv_python, tmp_path):
    found = _run_installed(venv_python, _LOCATE, tmp_path, DEEPEP_LIGHTNING_DISABLE_EXTENSION="1")
    site_packages = Path(found["package"]).parents[1]
    assert site_packages.name == "site-packages" and venv_python.parents[1] in site_packages.parents
    assert found["csrc"] == str(site_packages / "deepep_lightning" / "_csrc")
    assert found["error"] is None
    installed = {Path(path).relative_to(found["csrc"]).as_posix() for path in found["sources"]}
    in_checkout = {
        path.relative_to(REPO / "extensions" / "csrc").as_posix()
        for pattern in ("*.cpp", "cuda/*.cu")
        for path in (REPO / "extensions" / "csrc").glob(pattern)
    }
    assert installed == in_checkout


def test_installed_wheel_without_sources_says_reinstall(venv_python, tmp_path):
    """Negative control: with the shipped sources removed, the loader names both places and the fix."""
    (shipped,) = venv_python.parents[1].glob("lib/python*/site-packages/deepep_lightning/_csrc")
    shutil.rmtree(shipped)
    missing = _run_installed(venv_python, _LOCATE, tmp_path, DEEPEP_LIGHTNING_DISABLE_EXTENSION="1")
    assert missing["sources"] == []
    assert str(shipped) in missing["error"]
    assert "reinstall deepep_lightning" in missing["hint"] and "compiler" not in missing["hint"]


@pytest.mark.skipif(os.environ.get(BUILD_ENV) != "1", reason=f"the JIT build takes minutes; {BUILD_ENV}=1 runs it")
def test_installed_wheel_jit_builds_the_cpu_op(wheel, tmp_path_factory, tmp_path):
    python = _venv_with(wheel, tmp_path_factory.mktemp("venv_build"))
    code = (
        "import json; from deepep_lightning.ops import extension_available, extension_error; "
        "print(json.dumps({'available': extension_available(), 'error': extension_error()}))"
    )
    built = _run_installed(python, code, tmp_path, TORCH_EXTENSIONS_DIR=str(tmp_path / "extensions"))
    assert built == {"available": True, "error": None}
