"""An engine's process lifecycle: shutdown at interpreter exit and the ordered teardown.

Every live ``Engine`` is tracked weakly; at exit each is shut down (an engine nobody
references any more is reaped by its finalizer instead: ``loop_bridge.reap_engine``).
``teardown`` is what ``Engine.shutdown()`` does once: fail live requests on the loop,
stop the core client, close the loop, then the widgets (docs/lifecycle.md, "Shutdown").
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import threading
import warnings
import weakref
from typing import TYPE_CHECKING

from nbengine.core.client import CoreClient
from nbengine.frontend.loop_bridge import REAP_TIMEOUT_S, LoopBridge, wait_for_reapers
from nbengine.frontend.registry import RequestRegistry

if TYPE_CHECKING:
    from nbengine.dashboard.monitor import EngineMonitor
    from nbengine.frontend.engine import Engine

__all__ = ["forget", "teardown", "track", "wait_for_shutdown"]

logger = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 5.0  # a second shutdown() waits this much longer than the first may take

_live_engines: weakref.WeakSet[Engine] = weakref.WeakSet()


def _shutdown_all_engines() -> None:
    """At interpreter exit: every engine's threads stopped and its model freed before the
    interpreter finalizes (docs/lifecycle.md, "Shutdown"). Engines that only a reference
    cycle still holds (an ``LLM`` made inside a function that returned) are collected
    first, so their finalizers start reaping now rather than during finalization, and
    their reapers are waited for."""
    gc.collect()
    for engine in list(_live_engines):
        try:
            engine.shutdown(timeout=5.0)
        except Exception:
            logger.exception("engine shutdown at exit failed")
    if not wait_for_reapers(REAP_TIMEOUT_S + SHUTDOWN_GRACE_S):
        logger.warning("an unreferenced engine was still being freed at exit")


atexit.register(_shutdown_all_engines)


def track(engine: Engine) -> None:
    """Shut ``engine`` down at interpreter exit unless it was shut down before."""
    _live_engines.add(engine)


def forget(engine: Engine) -> None:
    """``engine`` is being shut down: nothing is left to do for it at exit."""
    _live_engines.discard(engine)


def wait_for_shutdown(done: threading.Event, timeout: float) -> None:
    """A second ``shutdown()``: wait for the first one to complete (TimeoutError after
    ``timeout`` plus a grace of ``SHUTDOWN_GRACE_S``)."""
    if not done.wait(timeout + SHUTDOWN_GRACE_S):
        raise TimeoutError(
            f"The engine's shutdown, started by another caller, did not complete "
            f"within {timeout + SHUTDOWN_GRACE_S:g} s."
        )


def teardown(
    bridge: LoopBridge,
    registry: RequestRegistry,
    client: CoreClient,
    exit_stack: contextlib.ExitStack,
    monitor: EngineMonitor | None,
    timeout: float,
) -> None:
    """Fail live requests, stop the core client (up to ``timeout``), close the loop and
    the widgets (``monitor``: None if none was ever asked for). Each stage runs even if
    an earlier one failed; a core still stuck in a model step is named in a
    ``RuntimeWarning`` (attributed to ``shutdown()``'s caller)."""
    reason = "The engine has been shut down."
    if bridge.thread.is_alive():
        try:
            bridge.portal.call(registry.shut_down, reason)
        except Exception:
            logger.exception("failing live requests at shutdown failed")
    left: str | None = None
    try:
        left = client.shutdown(timeout)
    except Exception:
        logger.exception("engine core shutdown failed")
    try:
        exit_stack.close()
    except Exception:
        logger.exception("closing the engine loop failed")
    if monitor is not None:  # widgets show their final states, the UI updater stops
        monitor.shutdown()
    if left is not None:
        warnings.warn(f"nbengine shutdown: {left}.", RuntimeWarning, stacklevel=3)
