"""Tests for ``deepep_lightning/determinism/rng.py``: capture/restore of every global RNG."""

from __future__ import annotations

import io
import random

import numpy as np
import pytest
import torch

from deepep_lightning.determinism.rng import (
    capture_rng_state,
    fork_global_rng,
    restore_rng_state,
    seed_everything_from,
)


def _draw() -> tuple[float, float, float]:
    return torch.rand(1).item(), float(np.random.rand()), random.random()


def test_restore_repeats_every_stream_after_a_weights_only_round_trip() -> None:
    seed_everything_from(3, "test")
    np.random.normal()  # leaves a cached gaussian in numpy's state
    generator = torch.Generator().manual_seed(5)
    state = capture_rng_state({"mine": generator})
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    expected = (_draw(), float(np.random.normal()), torch.rand(2, generator=generator))
    assert restore_rng_state(loaded, {"mine": generator}) == []
    again = (_draw(), float(np.random.normal()), torch.rand(2, generator=generator))
    assert expected[0] == again[0] and expected[1] == again[1] and torch.equal(expected[2], again[2])


def test_negative_control_without_restore_streams_move_on() -> None:
    seed_everything_from(3, "test")
    capture_rng_state()
    first = _draw()
    assert _draw() != first


def test_missing_or_extra_generators_are_reported() -> None:
    state = capture_rng_state({"old": torch.Generator()})
    skipped = restore_rng_state(state, {"new": torch.Generator()})
    assert any("'new'" in s for s in skipped) and any("'old'" in s for s in skipped)


def test_fork_global_rng_leaves_outer_stream_untouched() -> None:
    seed_everything_from(1, "fork")
    reference = _draw()
    seed_everything_from(1, "fork")
    with fork_global_rng():
        seed_everything_from(99, "inner")
        _draw()
    assert _draw() == reference


def test_seed_everything_from_depends_on_every_key() -> None:
    assert seed_everything_from(1, "a", 0) != seed_everything_from(1, "a", 1)
    with pytest.raises(TypeError, match="int or str"):
        seed_everything_from(1, 1.5)  # type: ignore[arg-type]
