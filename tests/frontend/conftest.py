"""Shared fixtures: one tiny random model per session, one engine per module."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import nbengine as nb
from nbengine.testing import make_tiny_model

TINY = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=8192,
)
ENGINE_KW = dict(num_kv_blocks=1024, block_size=16, max_num_seqs=64, max_num_batched_tokens=512)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", arch="llama", **TINY)


@pytest.fixture(scope="module")
def engine(tiny_model: Path) -> Iterator[nb.Engine]:
    with nb.Engine(str(tiny_model), **ENGINE_KW) as eng:
        yield eng
    assert not eng.is_alive


@pytest.fixture(autouse=True)
def _no_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every test that used the shared engine leaves no live request behind."""
    yield
    if "engine" in request.fixturenames:
        eng: nb.Engine = request.getfixturevalue("engine")
        if eng.is_alive:
            assert eng.num_unfinished_requests() == 0


def long_params(**kw: object) -> nb.SamplingParams:
    """A request that runs until aborted."""
    return nb.SamplingParams(max_tokens=100_000, ignore_eos=True, **kw)  # type: ignore[arg-type]
