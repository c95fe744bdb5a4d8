"""Fixtures for the widget tests: one engine per module on the shared tiny model."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import nbengine as nb

ENGINE_KW = dict(num_kv_blocks=1024, block_size=16, max_num_seqs=16, max_num_batched_tokens=256)


@pytest.fixture(scope="module")
def engine(tiny_model: Path) -> Iterator[nb.Engine]:
    with nb.Engine(str(tiny_model), **ENGINE_KW) as eng:
        yield eng


@pytest.fixture
def fresh_engine(make_engine: Callable[..., nb.Engine]) -> nb.Engine:
    """An engine of the test's own (for shutdown tests and exact per-run counts)."""
    return make_engine(**ENGINE_KW)
