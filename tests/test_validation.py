"""The shared "int but not bool" checks (nbengine/validation.py)."""

from __future__ import annotations

import pytest

import nbengine as nb
from nbengine.validation import is_int, is_number


def test_bools_are_neither_ints_nor_numbers() -> None:
    assert [is_int(v) for v in (3, -1, True, False, 3.0, "3", None)] == [
        True,
        True,
        False,
        False,
        False,
        False,
        False,
    ]
    assert [is_number(v) for v in (3, 2.5, True, "2.5", None)] == [True, True, False, False, False]


def test_a_bool_for_an_int_field_is_a_type_error_naming_the_field() -> None:
    with pytest.raises(TypeError, match="max_tokens"):
        nb.SamplingParams(max_tokens=True)
    with pytest.raises(TypeError, match="temperature"):
        nb.SamplingParams(temperature=False)
