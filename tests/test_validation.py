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


def _float_fields(cls: type) -> list[str]:
    """The fields of dataclass ``cls`` annotated as floats (``float`` or ``float | None``)."""
    import dataclasses

    return [f.name for f in dataclasses.fields(cls) if str(f.type) in ("float", "float | None")]


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_every_float_option_refuses_nan_and_inf_naming_the_field(value: float) -> None:
    """Each float of the engine's configs and of SamplingParams: a ValueError naming the
    field at construction, never a late 'cannot convert float NaN to integer'."""
    from nbengine.config import CacheConfig, ModelConfig, SchedulerConfig

    checked = 0
    for cls in (ModelConfig, CacheConfig, SchedulerConfig, nb.SamplingParams):
        for name in _float_fields(cls):
            with pytest.raises(ValueError, match=f"{name} must be finite"):
                cls(**{name: value})
            checked += 1
    assert checked >= 8  # the two cache options and SamplingParams' six
