"""Fixtures of the reliability tests.

Every test builds its own small ``nb.Engine`` (engine creation takes about a second) so
that a test that breaks an engine on purpose cannot disturb another one. The white-box
helpers these suites share are in tests/support/engine_state.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import nbengine as nb

from .sizes import ENGINE_KW, TINY
from support.threads import engine_threads


@pytest.fixture(scope="session")
def tiny_model(tiny_model_factory: Callable[..., Path]) -> Path:
    """A shorter context than the other suites' model: max_model_len is reached sooner."""
    return tiny_model_factory("llama", **TINY)


@pytest.fixture(params=["float32", "bfloat16"])
def engine(make_engine: Callable[..., nb.Engine], request: pytest.FixtureRequest) -> nb.Engine:
    """A fresh engine per test, in float32 and in bfloat16 (the native kernels' path)."""
    return make_engine(dtype=request.param, **ENGINE_KW)


@pytest.fixture(autouse=True)
def _no_engine_threads_left() -> Iterator[None]:
    """Every test shuts its engines down: no engine thread outlives it."""
    yield
    deadline = time.monotonic() + 10
    while engine_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine_threads() == [], f"engine threads leaked: {engine_threads()}"
