"""The frontend suites' engine: one per module, on the shared tiny model (tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import nbengine as nb

from support.models import ENGINE_KW


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def engine(tiny_model: Path, request: pytest.FixtureRequest) -> Iterator[nb.Engine]:
    """The shared engine, in float32 and in bfloat16 (where the native kernels run: the
    default path for bfloat16 checkpoints such as the shipped model, docs/models.md)."""
    with nb.Engine(str(tiny_model), dtype=request.param, **ENGINE_KW) as eng:
        yield eng
    assert not eng.is_alive


@pytest.fixture(autouse=True)
def _no_leaks(no_leaked_requests: None) -> None:
    """Every test that used the shared engine leaves no live request behind."""
