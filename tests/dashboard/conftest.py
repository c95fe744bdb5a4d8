"""Fixtures for the widget tests: one tiny model per session, one engine per module."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import nbengine as nb
from nbengine.testing import TINY_LLAMA, make_tiny_model

TINY = {**TINY_LLAMA, "max_position_embeddings": 4096}
ENGINE_KW = dict(num_kv_blocks=1024, block_size=16, max_num_seqs=16, max_num_batched_tokens=256)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", arch="llama", **TINY)


@pytest.fixture(scope="module")
def engine(tiny_model: Path) -> Iterator[nb.Engine]:
    with nb.Engine(str(tiny_model), **ENGINE_KW) as eng:
        yield eng


@pytest.fixture
def fresh_engine(tiny_model: Path) -> Iterator[nb.Engine]:
    """An engine of the test's own (for shutdown tests and exact per-run counts)."""
    eng = nb.Engine(str(tiny_model), **ENGINE_KW)
    try:
        yield eng
    finally:
        eng.shutdown()
