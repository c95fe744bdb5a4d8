"""Fixtures for the structured-outputs and sampling-field tests: one tiny float32 engine."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import nbengine as nb
from nbengine.testing import TINY_LLAMA, make_tiny_model

ENGINE_KW = dict(num_kv_blocks=1024, block_size=16, max_num_seqs=64, max_num_batched_tokens=512)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-so") / "llama", arch="llama",
                           **{**TINY_LLAMA, "max_position_embeddings": 4096})


@pytest.fixture(scope="module")
def engine(tiny_model: Path) -> Iterator[nb.Engine]:
    with nb.Engine(str(tiny_model), dtype="float32", **ENGINE_KW) as eng:
        yield eng


@pytest.fixture(autouse=True)
def _no_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every test that used the shared engine leaves no live request behind."""
    yield
    if "engine" in request.fixturenames:
        eng: nb.Engine = request.getfixturevalue("engine")
        if eng.is_alive:
            assert eng.num_unfinished_requests() == 0
