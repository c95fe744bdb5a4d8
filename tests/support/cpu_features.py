"""Tests of a CPU feature that CI's machine may lack, such as AMX tiles.

The required-test plugin (tests/support/required_tests.py) fails any skip of a required
test under ``NBENGINE_REQUIRE_ALL=1``: CI must provide what those tests need (chromium, a C
compiler, a CPU with AVX-512 BF16). A CPU feature beyond that is not CI's to provide, so a
test that needs one is decorated with ``amx_only``: it skips where the CPU lacks the tiles,
and that skip (with exactly ``NO_AMX`` as its reason) stays an ordinary skip even inside a
required suite.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import pytest

from nbengine.ops import native

NO_AMX = "no AMX tiles on this CPU"
HAS_AMX = bool(getattr(native.kernels(), "amx", False))

_Test = TypeVar("_Test", bound=Callable[..., object])

amx_marks = [pytest.mark.cpu_feature(NO_AMX), pytest.mark.skipif(not HAS_AMX, reason=NO_AMX)]
"""The marks ``amx_only`` applies, for ``pytest.param(..., marks=amx_marks)``."""


def amx_only(test: _Test) -> _Test:
    """Skip ``test`` where the CPU has no AMX tiles, and let that skip be ordinary."""
    for mark in amx_marks:
        test = mark(test)
    return test
