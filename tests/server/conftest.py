"""Shared fixtures: a tiny Qwen2 model with a chat template, one engine and one server
per module (the server on a free port, loopback, no key)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import nbengine as nb
from nbengine.testing import QWEN_CHAT_TEMPLATE, TINY_LLAMA, make_tiny_model

pytest.importorskip("uvicorn")
pytest.importorskip("starlette")

ENGINE_KW = dict(num_kv_blocks=1024, block_size=16, max_num_seqs=64, max_num_batched_tokens=512,
)


@pytest.fixture(scope="session")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("qwen") / "chat", "qwen2",
                           chat_template=QWEN_CHAT_TEMPLATE, **TINY_LLAMA,
                           max_position_embeddings=8192)


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
            from server_util import wait_until

            wait_until(lambda: eng.num_unfinished_requests() == 0, "requests finish")


sys.path.insert(0, str(Path(__file__).parent))
