"""Fixtures every suite shares, and tests that must not be skipped quietly.

Fixtures (helpers without fixtures live in the ``support`` package, tests/support/):

- ``tiny_model_factory(arch="llama", **config)``: a tiny random Hugging Face model
  directory, written once per session for each distinct configuration;
- ``tiny_model``: the suites' default tiny Llama (``support.models.TINY``); a suite that
  needs another shape overrides this fixture with the factory;
- ``make_engine(model=None, **kw)``: an ``nb.Engine`` on ``tiny_model`` (or ``model``)
  that is shut down when the test ends, whatever happened;
- ``no_leaked_requests``: after the test, the shared ``engine`` holds no live request
  (suites with a module-scoped engine make it autouse);
- ``one_torch_thread``: torch on one thread for the test (tiny ops are faster and steadier
  on one thread of a shared 2-core machine).

Required tests (``@pytest.mark.required``, or ``browser``): a skip is loud, and a failure
on CI; the plugin is tests/support/required_tests.py.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

# Quantized and bfloat16 loads in tests write their load cache (model/load_cache.py:
# quantized or packed weights) here, never into the user's cache; the worker processes
# of the bench and server tests inherit it.
os.environ.setdefault("NBENGINE_LOAD_CACHE", tempfile.mkdtemp(prefix="nbengine-load-cache-"))

import nbengine as nb
from nbengine.testing import make_tiny_model

from support.models import TINY

# tests/test_required_skips.py runs pytest on pytest; required tests are loud when skipped.
pytest_plugins = ["pytester", "support.required_tests"]

# --- shared fixtures -------------------------------------------------------------------


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``factory(arch="llama", **config) -> Path``, one directory per distinct call."""
    made: dict[str, Path] = {}

    def factory(arch: str = "llama", **config: Any) -> Path:
        key = json.dumps([arch, config], sort_keys=True, default=str)
        if key not in made:
            made[key] = make_tiny_model(tmp_path_factory.mktemp(arch) / arch, arch=arch, **config)
        return made[key]

    return factory


@pytest.fixture(scope="session")
def tiny_model(tiny_model_factory: Callable[..., Path]) -> Path:
    """The default tiny random Llama of the engine-level suites."""
    return tiny_model_factory("llama", **TINY)


@pytest.fixture
def make_engine(tiny_model: Path) -> Iterator[Callable[..., nb.Engine]]:
    """``make_engine(model=None, **kw)``: engines of this test, all shut down after it."""
    engines: list[nb.Engine] = []

    def make(model: str | Path | None = None, **kw: Any) -> nb.Engine:
        engines.append(nb.Engine(str(model or tiny_model), **kw))
        return engines[-1]

    try:
        yield make
    finally:
        for eng in engines:
            eng.shutdown()


@pytest.fixture
def no_leaked_requests(request: pytest.FixtureRequest) -> Iterator[None]:
    """After the test: the shared ``engine`` it used (if alive) holds no live request."""
    yield
    if "engine" in request.fixturenames:
        eng: nb.Engine = request.getfixturevalue("engine")
        if eng.is_alive:
            assert eng.num_unfinished_requests() == 0


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """torch on one thread for the test: OpenMP barriers between two threads cost
    milliseconds when the other core of a shared 2-core machine is busy."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)
