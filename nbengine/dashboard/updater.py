"""The one coalescing UI updater: the only background code that touches widget traits.

Widgets are created on the caller's thread; afterwards a single daemon thread,
``nbengine-ui``, wakes about every 0.1 s and asks every registered view to ``refresh()``:
each view reads the engine state it shows and writes the traits that changed. So
however many tokens arrive between two ticks, each trait is written at most once per
tick. The thread runs independently of the kernel's io_loop, so views keep updating
while the kernel is idle and while a cell is busy.

Invariants:
- Every trait write of a registered widget happens under ``updater.lock`` (the tick
  holds it; widget callbacks on other threads take it for their own writes).
- A view whose ``refresh()`` returns True has shown its final state and is dropped.
- ``stop()`` runs one last tick (final states of requests failed at shutdown) and ends
  the thread; a stopped updater accepts no new views (they are refreshed once, at once).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Protocol

__all__ = ["UIUpdater", "View"]

logger = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 0.1


class View(Protocol):
    """Something the updater keeps up to date."""

    def refresh(self) -> bool:
        """Write changed traits (caller holds the updater lock); True when final."""
        ...


class UIUpdater:
    """A daemon thread that refreshes registered views about every ``interval`` seconds."""

    def __init__(
        self,
        interval: float = DEFAULT_INTERVAL_S,
        name: str = "nbengine-ui",
        alive: Callable[[], bool] | None = None,
    ) -> None:
        """``alive``: polled every tick; once it returns False (the engine's threads have
        ended, or it was collected) the updater runs a last tick and stops by itself."""
        if interval <= 0:
            raise ValueError(f"interval must be positive, got {interval}.")
        self.interval = interval
        self.name = name
        self._alive = alive
        # Reentrant: a refresh may call helpers that take it again on the same thread.
        self.lock = threading.RLock()
        self._views: dict[int, View] = {}
        self._stop = threading.Event()
        self._stopped = False
        self._final_done = threading.Event()
        self._thread: threading.Thread | None = None
        self.ticks = 0  # completed ticks (for tests and diagnostics)

    # ------------------------------------------------------------------ control

    def add(self, view: View) -> None:
        """Register ``view``; starts the thread on first use. Thread-safe."""
        with self.lock:
            if self._stopped:
                self._refresh_one(view)
                return
            self._views[id(view)] = view
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()

    def discard(self, view: View) -> None:
        """Stop refreshing ``view`` (no-op if it is not registered)."""
        with self.lock:
            self._views.pop(id(view), None)

    def __contains__(self, view: object) -> bool:
        with self.lock:
            return self._views.get(id(view)) is view

    @property
    def num_views(self) -> int:
        with self.lock:
            return len(self._views)

    @property
    def running(self) -> bool:
        """True while the updater thread is alive."""
        t = self._thread
        return t is not None and t.is_alive()

    @property
    def stopped(self) -> bool:
        return self._stopped

    def tick(self) -> None:
        """Refresh every view once, now, on the calling thread (under the lock)."""
        with self.lock:
            for key, view in list(self._views.items()):
                if self._refresh_one(view):
                    self._views.pop(key, None)
            self.ticks += 1

    def stop(self, timeout: float = 5.0) -> None:
        """Run one last tick, then end the thread. Idempotent; callable from any thread.

        A second caller waits (up to ``timeout``) until the first one's last tick is done.
        """
        with self.lock:
            first = not self._stopped
            self._stopped = True
        if not first:
            if threading.current_thread() is not self._thread:
                self._final_done.wait(timeout)
            return
        self._stop.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout)
        try:
            self.tick()
        finally:
            with self.lock:
                self._views.clear()
            self._final_done.set()

    # ---------------------------------------------------------------- internals

    def _refresh_one(self, view: View) -> bool:
        try:
            return bool(view.refresh())
        except Exception:  # one broken view must not stop the others
            logger.exception("widget refresh failed; dropping the view")
            return True

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                if self._alive is not None and not self._alive():
                    self.stop()  # a last tick shows the final states
                    return
                self.tick()
            except Exception:
                logger.exception("UI updater tick failed")
