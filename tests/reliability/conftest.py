"""Shared fixtures and helpers of the reliability tests.

One tiny random Llama is written per session; every test builds its own small
``nb.Engine`` on it (engine creation takes about a second) so that a test that
breaks an engine on purpose cannot disturb another one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

import pytest

import nbengine as nb
from nbengine.core.messages import EngineCoreMessage, MessageType
from nbengine.testing import TINY_LLAMA, make_tiny_model

T = TypeVar("T")

TINY = {**TINY_LLAMA, "max_position_embeddings": 1024}
ENGINE_KW: dict[str, Any] = dict(
    num_kv_blocks=256, block_size=8, max_num_seqs=32, max_num_batched_tokens=256
)
WAIT_S = 60.0  # every wait in these tests is bounded by this (the machine is noisy)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("rel") / "llama", arch="llama", **TINY)


@pytest.fixture(params=["float32", "bfloat16"])
def engine(tiny_model: Path, request: pytest.FixtureRequest) -> Iterator[nb.Engine]:
    """A fresh engine per test, in float32 and in bfloat16 (the native kernels' path)."""
    eng = nb.Engine(str(tiny_model), dtype=request.param, **ENGINE_KW)
    try:
        yield eng
    finally:
        eng.shutdown()


def engine_threads() -> list[threading.Thread]:
    """The live threads an engine started (its loop and core threads)."""
    return [t for t in threading.enumerate() if t.name.startswith("nbengine")]


@pytest.fixture(autouse=True)
def _no_engine_threads_left() -> Iterator[None]:
    """Every test shuts its engines down: no engine thread outlives it."""
    yield
    deadline = time.monotonic() + 10
    while engine_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine_threads() == [], f"engine threads leaked: {engine_threads()}"


def run_on_core(engine: nb.Engine, fn: Callable[[Any], T], timeout: float = WAIT_S) -> T:
    """Run ``fn(core)`` on the engine's core thread between steps (a UTILITY message)."""
    fut: Future[T] = Future()
    engine._core_queue.put(EngineCoreMessage(MessageType.UTILITY, fn, fut))
    return fut.result(timeout)


def core_snapshot(engine: nb.Engine) -> dict[str, Any]:
    """An atomic view of what the core holds and what the frontend considers live.

    Taken on the core thread while it is paused between steps: the core's state is
    frozen, and the frontend's key map is copied in one GIL-atomic ``dict.copy()``.
    A key enters the frontend map before its ADD is queued and leaves only after
    the core reported it finished, so ``core_keys <= frontend_keys`` must hold.
    """
    processor = engine._processor

    def snap(core: Any) -> dict[str, Any]:
        sched = core.scheduler
        core_keys = set(sched.requests)
        frontend_keys = set(processor.keys.copy())
        return {
            "core_keys": core_keys,
            "frontend_keys": frontend_keys,
            "frontend_ids": set(processor.requests.copy()),
            "waiting": len(sched.waiting),
            "running": len(sched.running),
            "kv_free": sched.kv.num_free_blocks,
            "kv_total": sched.kv.num_blocks,
        }

    return run_on_core(engine, snap)


def assert_core_within_frontend(engine: nb.Engine) -> dict[str, Any]:
    snap = core_snapshot(engine)
    orphans = snap["core_keys"] - snap["frontend_keys"]
    assert not orphans, f"the core holds requests the frontend forgot: {sorted(orphans)}"
    return snap


def assert_quiescent(engine: nb.Engine) -> None:
    """Nothing live anywhere: empty registry, empty core, every KV block free."""
    deadline = time.monotonic() + WAIT_S
    while True:
        snap = core_snapshot(engine)
        idle = not (snap["core_keys"] or snap["frontend_keys"] or snap["frontend_ids"])
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert snap["frontend_ids"] == set(), f"registry not empty: {snap['frontend_ids']}"
    assert snap["frontend_keys"] == set()
    assert snap["core_keys"] == set(), f"core still holds {snap['core_keys']}"
    assert snap["waiting"] == snap["running"] == 0
    assert snap["kv_free"] == snap["kv_total"], (
        f"KV blocks leaked: {snap['kv_total'] - snap['kv_free']} of {snap['kv_total']} held"
    )
    assert engine.num_unfinished_requests() == 0


def call_with_timeout(fn: Callable[[], T], timeout: float = WAIT_S) -> T:
    """Run ``fn`` on a helper thread; fail the test (not hang) if it does not return."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # re-raised on the caller's thread
            box["error"] = exc

    t = threading.Thread(target=target, name="rel-timeout-helper", daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"call did not return within {timeout} s (a hang)"
    if "error" in box:
        raise box["error"]
    return box["value"]
