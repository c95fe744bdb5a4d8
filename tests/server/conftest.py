"""Shared fixtures: a tiny Qwen2 model with a chat template, one engine and one server
per module (the server on a free port, loopback, no key)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import nbengine as nb
from nbengine.testing import QWEN_CHAT_TEMPLATE, TINY_LLAMA

from support.requests import wait_until

pytest.importorskip("uvicorn")
pytest.importorskip("starlette")

ENGINE_KW = dict(
    num_kv_blocks=1024,
    block_size=16,
    max_num_seqs=64,
    max_num_batched_tokens=512,
)


@pytest.fixture(scope="session")
def chat_model(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory(
        "qwen2", chat_template=QWEN_CHAT_TEMPLATE, **TINY_LLAMA, max_position_embeddings=8192
    )


@pytest.fixture(scope="module")
def engine(chat_model: Path) -> Iterator[nb.Engine]:
    with nb.Engine(str(chat_model), **ENGINE_KW) as eng:
        yield eng


@pytest.fixture(scope="module")
def server(engine: nb.Engine) -> Iterator[object]:
    with engine.serve(port=0, model_name="tiny") as srv:
        yield srv
    assert not srv.running


@pytest.fixture(autouse=True)
def _no_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every test that used the shared engine leaves no live request behind."""
    yield
    if "engine" in request.fixturenames:
        eng: nb.Engine = request.getfixturevalue("engine")
        if eng.is_alive:
            wait_until(lambda: eng.num_unfinished_requests() == 0, what="requests finish")
