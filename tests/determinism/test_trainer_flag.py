"""Trainer(deterministic=...) next to DeterminismCallback: the callback's settings win, and a conflict says so."""

import pytest

from deepep_lightning.determinism.trainer_flag import (
    trainer_deterministic_conflict,
    warn_if_trainer_deterministic_conflicts,
)


@pytest.mark.parametrize(
    ("trainer", "algorithms", "warn_only"),
    [("warn", True, False), (False, True, False), (True, False, False), (True, True, True)],
)
def test_disagreement_names_both_settings_and_who_wins(trainer, algorithms, warn_only):
    message = trainer_deterministic_conflict(trainer, algorithms, warn_only)
    assert message is not None
    assert f"Trainer(deterministic={trainer!r})" in message and "the callback" in message and "HINT" in message
    with pytest.warns(UserWarning, match="disagrees with DeterminismCallback"):
        assert warn_if_trainer_deterministic_conflicts(trainer, algorithms, warn_only)


@pytest.mark.parametrize(
    ("trainer", "algorithms", "warn_only"),
    [(None, True, False), (None, False, False), (True, True, False), ("warn", True, True), (False, False, True)],
)
def test_agreement_or_an_unset_trainer_flag_is_silent(trainer, algorithms, warn_only):
    assert trainer_deterministic_conflict(trainer, algorithms, warn_only) is None


def test_a_bad_trainer_value_is_named():
    with pytest.raises(ValueError, match=r"deterministic=.*'always'"):
        trainer_deterministic_conflict("always", True, False)


def test_a_trainer_flag_against_the_callback_warns_at_setup(boring_module, tmp_path):
    """Trainer(deterministic="warn") built after DeterminismCallback(): setup says the callback's settings win."""
    import lightning.pytorch as pl
    import torch

    from deepep_lightning import DeterminismCallback

    callback = DeterminismCallback(seed=0)
    trainer = pl.Trainer(
        deterministic="warn",
        max_steps=1,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        callbacks=[callback],
        default_root_dir=tmp_path,
    )
    with pytest.warns(UserWarning, match=r"Trainer\(deterministic='warn'\) disagrees"):
        trainer.fit(boring_module())
    assert torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled()


def test_no_trainer_flag_is_silent(boring_module, tmp_path, recwarn):
    """Negative control: the same fit without Trainer(deterministic=...) gives no such warning."""
    import lightning.pytorch as pl

    from deepep_lightning import DeterminismCallback

    trainer = pl.Trainer(
        max_steps=1,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        callbacks=[DeterminismCallback(seed=0)],
        default_root_dir=tmp_path,
    )
    trainer.fit(boring_module())
    assert not [w for w in recwarn if "disagrees with DeterminismCallback" in str(w.message)]
