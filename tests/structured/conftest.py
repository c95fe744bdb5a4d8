"""The structured-outputs and sampling-field suites' engine: one float32 engine per module
on the shared tiny model (tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import nbengine as nb

from support.models import ENGINE_KW


@pytest.fixture(scope="module")
def engine(tiny_model: Path) -> Iterator[nb.Engine]:
    with nb.Engine(str(tiny_model), dtype="float32", **ENGINE_KW) as eng:
        yield eng


@pytest.fixture(autouse=True)
def _no_leaks(no_leaked_requests: None) -> None:
    """Every test that used the shared engine leaves no live request behind."""
