"""deepep_lightning/_checks.py: validators accept what is allowed, else name owner, argument and value."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from deepep_lightning import _checks


def test_positive_int_refuses_bools_zero_and_values_past_the_bound():
    assert _checks.positive_int("Owner", "n", 3) == 3
    assert _checks.positive_int("Owner", "n", None, allow_none=True) is None
    assert _checks.positive_int("Owner", "n", 8, maximum=8) == 8
    with pytest.raises(MisconfigurationException, match=r"^`Owner\(n=\.\.\.\)` must be a positive int, got 0$"):
        _checks.positive_int("Owner", "n", 0)
    with pytest.raises(MisconfigurationException, match="got True"):
        _checks.positive_int("Owner", "n", True)
    with pytest.raises(MisconfigurationException, match=r"a positive int <= 8 or None, got 9"):
        _checks.positive_int("Owner", "n", 9, maximum=8, allow_none=True)


def test_int_validators_state_their_range():
    assert _checks.non_negative_int(None, "seed", 0) == 0
    with pytest.raises(MisconfigurationException, match=r"^`seed` must be a non-negative int or None, got -1$"):
        _checks.non_negative_int(None, "seed", -1, allow_none=True)
    assert _checks.int_at_least(None, "window", 2, 2) == 2
    with pytest.raises(MisconfigurationException, match=r"`window` must be an int >= 2, got 1"):
        _checks.int_at_least(None, "window", 1, 2)
    assert _checks.int_in_range(None, "rank", 2, 0, 3, high_inclusive=False) == 2
    with pytest.raises(ValueError, match=r"^`rank` must be an int in \[0, 3\), got 3$"):
        _checks.int_in_range(None, "rank", 3, 0, 3, high_inclusive=False, error=ValueError)
    with pytest.raises(MisconfigurationException, match=r"an int in \[0, 3\], got 2.5"):
        _checks.int_in_range(None, "rank", 2.5, 0, 3)


@pytest.mark.parametrize(
    ("bounds", "value", "allowed"),
    [
        ({"minimum": 0.0, "maximum": 1.0}, 1.5, "a number in [0.0, 1.0]"),
        ({"minimum": 0, "maximum": 1, "exclusive_minimum": True, "exclusive_maximum": True}, 1, "a number in (0, 1)"),
        ({"minimum": 0, "exclusive_minimum": True}, 0, "a number > 0"),
        ({"minimum": 0, "finite": True}, math.inf, "a finite number >= 0"),
        ({"maximum": 10}, float("nan"), "a number <= 10"),
        ({}, "1", "a number"),
        ({}, False, "a number"),
    ],
)
def test_number_names_its_bounds(bounds, value, allowed):
    with pytest.raises(MisconfigurationException) as error:
        _checks.number("Owner", "x", value, **bounds)
    assert str(error.value) == f"`Owner(x=...)` must be {allowed}, got {value!r}"


def test_number_accepts_ints_floats_and_the_bounds_themselves():
    assert _checks.number(None, "x", 0, minimum=0) == 0
    assert _checks.number(None, "x", 1.0, minimum=0.0, maximum=1.0) == 1.0
    assert _checks.number(None, "x", None, allow_none=True) is None


def test_strict_bool_refuses_truthy_values():
    assert _checks.strict_bool(None, "flag", False) is False
    for value in (0, 1, "yes", None):
        with pytest.raises(TypeError, match=rf"`flag` must be a bool, got {value!r}"):
            _checks.strict_bool(None, "flag", value, error=TypeError)


def test_choice_lists_the_choices_and_the_hint():
    assert _checks.choice("S", "algo", "Ring", ("Ring", "Tree")) == "Ring"
    assert _checks.choice("S", "algo", None, ("Ring",), allow_none=True) is None
    with pytest.raises(MisconfigurationException) as error:
        _checks.choice("S", "algo", "NVLS", ("Ring", "Tree"), hint="why")
    assert str(error.value) == "`S(algo=...)` must be one of ('Ring', 'Tree'), got 'NVLS' (HINT: why)"


def test_str_sequence_refuses_a_bare_string_and_returns_a_tuple():
    assert _checks.str_sequence(None, "keys", ["a", "b"]) == ("a", "b")
    for value in ("callbacks", ["a", 1], 3):
        with pytest.raises(MisconfigurationException, match=r"`keys` must be a sequence of str"):
            _checks.str_sequence(None, "keys", value)


def test_path_with_a_writable_parent(tmp_path):
    assert _checks.path(None, "out", str(tmp_path / "new" / "file.json"), writable_parent=True) == (
        tmp_path / "new" / "file.json"
    )
    assert _checks.path(None, "out", None, allow_none=True) is None
    with pytest.raises(MisconfigurationException, match=r"`out` must be a path, got 3"):
        _checks.path(None, "out", 3)


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere: needs an ordinary user")
def test_path_in_a_read_only_directory_is_refused(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(MisconfigurationException, match="is not writable"):
        _checks.path(None, "out", Path(locked) / "file.json", writable_parent=True)


def test_non_empty_str_refuses_blank_and_non_str():
    assert _checks.non_empty_str("RegressionTrigger", "monitor", "train/return") == "train/return"
    for value in ("", "   ", None, 3):
        with pytest.raises(MisconfigurationException, match=r"`RegressionTrigger\(monitor=...\)` must be a non-empty"):
            _checks.non_empty_str("RegressionTrigger", "monitor", value)
