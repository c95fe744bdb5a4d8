"""What the core holds against what the frontend holds, read between steps.

White-box checks for the reliability suites (docs/lifecycle.md): the core's requests must
always be a subset of the frontend's, and an idle engine holds nothing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

import nbengine as nb
from nbengine.core.messages import EngineCoreMessage, MessageType

from support.requests import WAIT_S

T = TypeVar("T")


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
