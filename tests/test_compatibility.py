"""Lightning features next to the plugin, as docs/compatibility.md states them: what works and what is refused.

Each "works" test runs the feature with the plugin and compares weights bitwise against a run that must
equal it, next to a negative control that must differ (another seed, a fault without the rollback, a
resume without the seek); each "refused" test checks the error. The ``load_from_checkpoint`` test runs
the snippet printed in docs/compatibility.md in a fresh process where ``deepep_lightning`` cannot be
imported.
"""

from __future__ import annotations

import os
import re
import sys
import textwrap
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from torch.utils.data import DataLoader, IterableDataset

import deepep_lightning as dl

REPO = Path(__file__).resolve().parents[1]
COMPATIBILITY_MD = REPO / "docs" / "compatibility.md"


def _weights(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.fixture(autouse=True)
def _run_in_tmp_path(tmp_path, monkeypatch):
    """Trainers without a logger write their health event logs into the working directory: make it the test's."""
    monkeypatch.chdir(tmp_path)


def _fit(quiet_trainer, model: pl.LightningModule, callbacks: list, **trainer_kwargs) -> pl.Trainer:
    trainer = quiet_trainer(callbacks=callbacks, **{"max_steps": 8, **trainer_kwargs})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model)
    return trainer


def _health(fault_at: int | None = None, seed: int = 3, **determinism) -> list[pl.Callback]:
    """The three callbacks (per-step checks, a snapshot every 2 steps), plus a one-off NaN loss at ``fault_at``."""
    callbacks: list[pl.Callback] = [
        dl.DeterminismCallback(seed, log_fingerprint=False, **determinism),
        dl.NumericalHealthCallback(check_every_n_steps=1),
        dl.NaNRollbackCallback(snapshot_every_n_steps=2),
    ]
    if fault_at is not None:
        callbacks.append(dl.FaultInjectionCallback("loss", steps=[fault_at], mode="once"))
    return callbacks


# ---------------------------------------------------------------- Trainer(deterministic=...)
@pytest.mark.parametrize(
    ("flag", "configure_first", "warns"),
    [(True, False, False), (False, False, False), (False, True, True)],
    ids=["true_agrees", "false_leaves_the_flags_alone", "false_turns_configured_flags_off"],
)
def test_trainer_deterministic_next_to_the_callback(
    flag, configure_first, warns, boring_module, quiet_trainer, recwarn
):
    """The callback's settings hold after setup whatever the Trainer flag; a warning when the flag changed
    torch's flags against them (False after ``configure()`` turned them on); ``True`` agrees silently."""
    if configure_first:
        dl.configure(0)
    callback = dl.DeterminismCallback(0)
    quiet_trainer(deterministic=flag, max_steps=1, callbacks=[callback]).fit(boring_module())
    conflicts = [w for w in recwarn if "disagrees with DeterminismCallback" in str(w.message)]
    assert bool(conflicts) is warns
    assert torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled()


# ---------------------------------------------------------------- iterable datasets
class _Stream(IterableDataset):
    """32 fixed points, always in the same order (a stream has no index to seek to)."""

    def __iter__(self):
        yield from torch.randn(32, 4, generator=torch.Generator().manual_seed(0))


@pytest.fixture
def streaming_module(boring_module):
    class Streaming(boring_module):
        def train_dataloader(self):
            return DataLoader(_Stream(), batch_size=4)

    return Streaming


def test_an_iterable_dataset_is_refused_under_strict(streaming_module, quiet_trainer):
    trainer = quiet_trainer(max_steps=2, callbacks=[dl.DeterminismCallback(0)])
    with pytest.raises(MisconfigurationException, match=r"cannot be made seekable because its dataset is an Iterable"):
        trainer.fit(streaming_module())


def test_an_iterable_dataset_runs_bitwise_and_rolls_back_with_strict_false(streaming_module, quiet_trainer):
    """strict=False: a warning, then run-to-run bitwise and a transient fault rolled back to the clean run's bits."""
    torch.manual_seed(1)
    with pytest.warns(UserWarning, match="IterableDataset"):
        quiet_trainer(max_steps=1, callbacks=[dl.DeterminismCallback(3, strict=False)]).fit(streaming_module())

    def run(fault_at: int | None, seed: int = 3, rollback: bool = True) -> list[torch.Tensor]:
        torch.manual_seed(1)
        model = streaming_module(dropout=0.5)
        callbacks = _health(fault_at, seed, strict=False)
        if not rollback:
            callbacks = [c for c in callbacks if not isinstance(c, dl.NaNRollbackCallback)]
            callbacks[1] = dl.NumericalHealthCallback(check_every_n_steps=1, on_nonfinite="warn")
        _fit(quiet_trainer, model, callbacks)
        return _weights(model)

    clean = run(None)
    assert _equal(clean, run(None))
    assert _equal(clean, run(fault_at=5))
    assert not _equal(clean, run(None, seed=4)), "negative control: dropout draws from the seeded stream"
    assert not _equal(clean, run(fault_at=5, rollback=False)), "negative control: the fault reaches the weights"


# ---------------------------------------------------------------- gradient accumulation
def test_rollback_refuses_gradient_accumulation(boring_module, quiet_trainer):
    trainer = quiet_trainer(max_steps=2, accumulate_grad_batches=3, callbacks=_health())
    with pytest.raises(MisconfigurationException, match=r"needs `accumulate_grad_batches=1`, got 3\."):
        trainer.fit(boring_module())
    _fit(quiet_trainer, boring_module(), _health(), max_steps=2)  # negative control: 1 is accepted


# ---------------------------------------------------------------- precision
@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_bf16_runs_bitwise_and_rolls_back(precision, boring_module, quiet_trainer):
    def run(fault_at: int | None, seed: int = 3) -> tuple[list[torch.Tensor], list[float]]:
        torch.manual_seed(1)
        model = boring_module(dropout=0.5)
        _fit(quiet_trainer, model, _health(fault_at, seed), precision=precision)
        return _weights(model), model.losses

    clean, losses = run(None)
    # the step really ran in bfloat16: every loss it returned is a bfloat16 value
    assert all(torch.tensor(loss).to(torch.bfloat16).float().item() == loss for loss in losses if loss == loss)
    assert _equal(clean, run(None)[0])
    assert _equal(clean, run(fault_at=5)[0])
    assert not _equal(clean, run(None, seed=4)[0]), "negative control: another seed, other dropout masks"


_SIXTEEN_MIXED_GPU = textwrap.dedent(
    """
    import deepep_lightning as dl
    dl.configure(0)  # before CUDA starts
    import sys, torch
    sys.path.insert(0, sys.argv[1])
    from conftest import BoringModule
    import lightning.pytorch as pl

    def run(fault_at, init=1):
        torch.manual_seed(init)
        model = BoringModule(dropout=0.5)
        callbacks = [dl.DeterminismCallback(3, log_fingerprint=False),
                     dl.NumericalHealthCallback(check_every_n_steps=1),
                     dl.NaNRollbackCallback(snapshot_every_n_steps=2)]
        if fault_at is not None:
            callbacks.append(dl.FaultInjectionCallback("loss", steps=[fault_at], mode="once"))
        trainer = pl.Trainer(accelerator="gpu", devices=1, precision="16-mixed", max_steps=8, logger=False,
                             enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
                             callbacks=callbacks)
        trainer.fit(model)
        assert trainer.precision_plugin.scaler is not None
        return [p.detach().cpu().clone() for p in model.parameters()]

    equal = lambda a, b: all(torch.equal(x, y) for x, y in zip(a, b))
    clean = run(None)
    print("RUN_TO_RUN", equal(clean, run(None)))
    print("ROLLBACK", equal(clean, run(5)))
    # another seed in the same process would re-configure after CUDA started (strict refuses): other weights instead
    print("OTHER_INIT", equal(clean, run(None, init=2)))
    """
)


@pytest.mark.gpu
def test_sixteen_mixed_with_a_grad_scaler_runs_bitwise_and_rolls_back_on_gpu(tmp_path, run_process):
    """16-mixed on CUDA (GradScaler): two runs and a rolled-back transient fault equal; other initial weights differ."""
    script = tmp_path / "sixteen_mixed.py"
    script.write_text(_SIXTEEN_MIXED_GPU)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    result = run_process([sys.executable, str(script), str(REPO / "tests")], cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "RUN_TO_RUN True" in result.stdout and "ROLLBACK True" in result.stdout
    assert "OTHER_INIT False" in result.stdout


# ---------------------------------------------------------------- torch.compile
def test_torch_compile_runs_bitwise_and_rolls_back(boring_module, quiet_trainer):
    """A compiled network (inductor, CPU) under the three callbacks: bitwise run to run, fault rolled back."""

    def run(fault_at: int | None, seed: int = 3) -> list[torch.Tensor]:
        torch.manual_seed(1)
        model = boring_module(dropout=0.5)
        model.net = torch.compile(model.net)
        _fit(quiet_trainer, model, _health(fault_at, seed))
        return _weights(model)

    try:
        clean = run(None)
        assert _equal(clean, run(None))
        assert _equal(clean, run(fault_at=5))
        assert not _equal(clean, run(None, seed=4)), "negative control: the compiled dropout follows the seed"
    finally:
        torch._dynamo.reset()  # each run compiled a new module: leave no cached graphs to the next test


# ---------------------------------------------------------------- Lightning's SpikeDetection
def test_lightning_spike_detection_loses_the_run_where_the_rollback_recovers(boring_module, quiet_trainer):
    """Lightning's ``SpikeDetection`` ends the run at a non-finite loss and cannot restore its own state; the
    plugin's rollback finishes the same run bitwise as the clean one, and its trigger's state round-trips."""
    from lightning.fabric.utilities.spike import TrainingSpikeException
    from lightning.pytorch.callbacks import SpikeDetection

    def run(callbacks: list[pl.Callback]) -> list[torch.Tensor]:
        torch.manual_seed(1)
        model = boring_module(dropout=0.5)
        _fit(quiet_trainer, model, callbacks)
        return _weights(model)

    fault = dl.FaultInjectionCallback("loss", steps=[5], mode="once")
    with pytest.raises(TrainingSpikeException):
        run([dl.DeterminismCallback(3, log_fingerprint=False), fault, SpikeDetection(warmup=2)])
    with pytest.raises(AttributeError, match="running"):  # its load_state_dict reads an attribute it never sets
        SpikeDetection().load_state_dict(SpikeDetection().state_dict())

    assert _equal(run(_health(fault_at=5)), run(_health()))
    trigger = dl.RegressionTrigger("train/loss", mode="min", patience=2)
    for step, value in enumerate([3.0, 2.0, 9.0]):
        trigger.update(value, step)
    restored = dl.RegressionTrigger("train/loss", mode="min", patience=2)
    restored.load_state_dict(trigger.state_dict())
    assert restored.state_dict() == trigger.state_dict() and restored.update(9.0, 3)  # resumes mid-collapse


# ---------------------------------------------------------------- Lightning Fabric
def _fabric_run(seed: int, checkpoint: Path, *, stop_at: int | None = None, resume: bool = False, seek: bool = True):
    """16 SGD steps (2 epochs of 8 batches) in a Fabric loop built from the plugin's pieces; returns the weights."""
    from lightning.fabric import Fabric

    dl.configure(seed)
    fabric = Fabric(accelerator="cpu", devices=1)
    torch.manual_seed(dl.derive_seed(seed, "init"))
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    data = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
    sampler = dl.SeekableSampler(data, seed=seed)  # order of epoch e: a pure function of (seed, e)
    loader = fabric.setup_dataloaders(DataLoader(data, batch_size=4, sampler=sampler), use_distributed_sampler=False)
    step = 0
    if resume:
        state = {"model": model, "optimizer": optimizer}
        rest = fabric.load(checkpoint, state)
        step = rest["step"]
        dl.restore_rng_state(rest["rng"])
    while step < 16:
        sampler.set_epoch(step // 8)
        if seek:
            sampler.seek((step % 8) * 4)  # samples of this epoch already consumed
        for batch in loader:
            torch.manual_seed(dl.derive_seed(seed, "step", step))  # the step's randomness: a function of its position
            loss = model(batch).pow(2).mean()
            optimizer.zero_grad()
            fabric.backward(loss)
            optimizer.step()
            step += 1
            if step == stop_at:
                fabric.save(
                    checkpoint, {"model": model, "optimizer": optimizer, "step": step, "rng": dl.capture_rng_state()}
                )
                return None
            if step % 8 == 0:
                break
    return _weights(model)


def test_fabric_loop_with_the_plugins_pieces_resumes_mid_epoch_bitwise(tmp_path):
    """Fabric has no Trainer callbacks; configure, SeekableSampler, derive_seed and the RNG snapshot do the work."""
    checkpoint = tmp_path / "fabric.ckpt"
    uninterrupted = _fabric_run(3, checkpoint)
    assert _equal(uninterrupted, _fabric_run(3, checkpoint))
    assert _fabric_run(3, checkpoint, stop_at=5) is None  # stopped mid-epoch 0 after 5 batches
    assert _equal(uninterrupted, _fabric_run(3, checkpoint, resume=True))
    assert not _equal(uninterrupted, _fabric_run(3, checkpoint, resume=True, seek=False)), (
        "negative control: without the seek the resumed epoch starts over"
    )
    assert not _equal(uninterrupted, _fabric_run(4, checkpoint)), "negative control: another seed"


# ---------------------------------------------------------------- load_from_checkpoint without the plugin
_MY_PROJECT = textwrap.dedent(
    """
    import lightning.pytorch as pl
    import torch
    from torch.nn import functional as F


    class Classifier(pl.LightningModule):
        def __init__(self, lr: float = 3e-3) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                           torch.nn.Linear(32, 2))

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)

        def train_dataloader(self):
            generator = torch.Generator().manual_seed(0)
            x = torch.randn(64, 8, generator=generator)
            data = torch.utils.data.TensorDataset(x, (x[:, :4].sum(1) > 0).long())
            return torch.utils.data.DataLoader(data, batch_size=8, shuffle=True)
    """
)

_WITHOUT_THE_PLUGIN = textwrap.dedent(
    """
    import importlib.abc, sys

    class NoPlugin(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "deepep_lightning":
                raise ImportError(f"{name} is not importable in this test")

    sys.meta_path.insert(0, NoPlugin())
    import torch
    blocks = __BLOCKS__
    namespace = {}
    exec(blocks[0], namespace)
    expected = torch.load("expected_weights.pt", weights_only=True)
    loaded = namespace["model"].state_dict()
    same = loaded.keys() == expected.keys() and all(torch.equal(loaded[k], expected[k]) for k in expected)
    print("WEIGHTS_EQUAL", same)
    exec(blocks[1], namespace)
    print("FINE_TUNED_STEPS", namespace["trainer"].global_step)
    print("PLUGIN_IMPORTED", any(name.startswith("deepep_lightning") for name in sys.modules))
    try:  # the blocker works: the plugin could not have been used
        import deepep_lightning
        print("IMPORTABLE True")
    except ImportError:
        print("IMPORTABLE False")
    """
)


def _snippets(name: str) -> list[str]:
    """The python blocks that follow ``<!-- snippet: name -->`` in docs/compatibility.md, in order."""
    text = COMPATIBILITY_MD.read_text()
    blocks = re.findall(rf"<!-- snippet: {re.escape(name)} -->\s*```python\n(.*?)```", text, flags=re.S)
    assert blocks, f"docs/compatibility.md has no `<!-- snippet: {name} -->` python block"
    return blocks


@pytest.mark.slow
def test_the_documented_load_from_checkpoint_snippet_runs_without_the_plugin(tmp_path, quiet_trainer, run_process):
    """A checkpoint written with the three callbacks loads (inference) and fine-tunes where the plugin is absent."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    (tmp_path / "my_project.py").write_text(_MY_PROJECT)
    sys.path.insert(0, str(tmp_path))
    try:
        from my_project import Classifier  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(tmp_path))
    torch.manual_seed(1)
    model = Classifier()
    callbacks = [*_health(), ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0, every_n_train_steps=4)]
    _fit(quiet_trainer, model, callbacks, max_steps=8, enable_checkpointing=True)
    assert (tmp_path / "last.ckpt").exists()
    torch.save(model.state_dict(), tmp_path / "expected_weights.pt")
    torch.manual_seed(2)
    fresh = Classifier().state_dict()  # negative control: the comparison can tell other weights apart
    assert not all(torch.equal(fresh[k], v) for k, v in model.state_dict().items())

    blocks = _snippets("load_from_checkpoint")
    assert len(blocks) == 2, "the snippet is two blocks: inference, then fine-tuning"
    script = tmp_path / "without_the_plugin.py"
    script.write_text(_WITHOUT_THE_PLUGIN.replace("__BLOCKS__", repr(blocks)))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PL_GLOBAL_SEED")}
    env["PYTHONPATH"] = str(tmp_path)
    result = run_process([sys.executable, str(script)], cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "WEIGHTS_EQUAL True" in result.stdout
    assert "FINE_TUNED_STEPS 5" in result.stdout
    assert "PLUGIN_IMPORTED False" in result.stdout and "IMPORTABLE False" in result.stdout
