"""Registration of "ddp_deterministic": immediate when Lightning is loaded, else when it loads."""

from __future__ import annotations

import sys

from lightning.pytorch.strategies import StrategyRegistry

from deepep_lightning.strategies import _registration


def test_registers_now_when_lightning_is_loaded():
    from deepep_lightning.strategies import DeterministicDDPStrategy

    StrategyRegistry.pop("ddp_deterministic", None)
    try:
        _registration.register_when_lightning_loads()
        factory = StrategyRegistry["ddp_deterministic"]["strategy"]
        assert isinstance(factory(), DeterministicDDPStrategy)  # a lazy factory: no import at registration
        _registration.register_when_lightning_loads()  # idempotent
    finally:
        DeterministicDDPStrategy.register_strategies(StrategyRegistry)
    _registration.register()
    assert StrategyRegistry["ddp_deterministic"]["strategy"] is DeterministicDDPStrategy  # the class is kept


def test_finder_registers_after_the_target_module_ran(tmp_path, monkeypatch):
    # stand-in for lightning.pytorch: a fresh module whose import must trigger the registration
    (tmp_path / "fake_lightning_target.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(_registration, "_TARGET", "fake_lightning_target")
    calls = []
    monkeypatch.setattr(_registration, "register", lambda: calls.append(sys.modules["fake_lightning_target"].VALUE))
    monkeypatch.delitem(sys.modules, "fake_lightning_target", raising=False)
    _registration.register_when_lightning_loads()
    try:
        assert calls == []  # nothing imported yet: only a finder was installed
        import fake_lightning_target  # noqa: F401

        assert calls == [1]  # after the module body ran
        assert not any(isinstance(f, _registration._LightningFinder) for f in sys.meta_path)
    finally:
        _registration._remove_finder()
        sys.modules.pop("fake_lightning_target", None)


def test_import_deepep_lightning_registers_without_loading_lightning():
    import subprocess
    from pathlib import Path

    import pytest

    import deepep_lightning

    if "deepep_lightning.strategies" not in Path(deepep_lightning.__file__).read_text():
        pytest.skip("deepep_lightning/__init__.py does not import deepep_lightning.strategies yet (lead's hook)")
    code = (
        "import sys, deepep_lightning\n"
        "assert 'lightning.pytorch' not in sys.modules, 'import deepep_lightning loaded Lightning'\n"
        "from lightning.pytorch.strategies import StrategyRegistry\n"
        "assert 'ddp_deterministic' in StrategyRegistry\n"
    )
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
