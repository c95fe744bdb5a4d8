"""``EngineObserver``: what the frontend tells the metrics log, the dashboard and tools.

The output processor notifies every registered observer, always on the
``nbengine-loop`` thread (docs/architecture.md, "Threads"): when an incarnation (each
``n > 1`` child) is registered, on every lifecycle transition, when the core's schedule
time of a running request is known, when a request has new tokens, when a request
runs under a structured-output constraint, for every engine step,
and when a multi-replica backend places a request. Register one with
``engine.add_observer(obs)``; the engine's own ``EngineMonitor`` (nbengine/dashboard) is
one. Hooks must be quick and must not block: they run between the model's output batches.
A hook that raises is logged and the others still run.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from nbengine.core.messages import StepStats
    from nbengine.frontend.events import LifecycleEvent

__all__ = ["EngineObserver", "ObserverList"]

logger = logging.getLogger(__name__)


class EngineObserver(Protocol):
    """The hooks of an engine observer. Subclass it to inherit no-op defaults."""

    def on_request(
        self, key: str, request_id: str, num_prompt_tokens: int, arrival_time: float
    ) -> None:
        """The incarnation ``key`` of ``request_id`` was registered (each n>1 child)."""
        return None

    def on_constraint(self, key: str, request_id: str, constraint: str) -> None:
        """``key`` runs under a structured-output constraint (its short description)."""
        return None

    def on_event(self, ev: LifecycleEvent) -> None:
        """A lifecycle transition of one incarnation."""
        return None

    def on_scheduled(self, key: str, when: float) -> None:
        """``key`` went RUNNING; ``when`` is the core's first schedule time of its request."""
        return None

    def on_tokens(
        self, key: str, num_output_tokens: int, now: float, num_cached_tokens: int | None
    ) -> None:
        """``key`` has ``num_output_tokens`` output tokens in all (cumulative) as of ``now``."""
        return None

    def on_step(self, stats: StepStats) -> None:
        """One engine step's statistics."""
        return None

    def on_routed(self, key: str, replica: int) -> None:
        """A multi-replica backend placed ``key`` on engine core ``replica``."""
        return None


class ObserverList(EngineObserver):
    """The observers of one engine: each hook is forwarded to every one of them.

    ``add``/``remove`` may be called from any thread (the list is replaced, never mutated
    in place, so the loop thread iterates a consistent tuple without a lock).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._observers: tuple[EngineObserver, ...] = ()

    def add(self, observer: EngineObserver) -> None:
        """Register ``observer`` (once; adding it again does nothing)."""
        with self._lock:
            if not any(o is observer for o in self._observers):
                self._observers = (*self._observers, observer)

    def remove(self, observer: EngineObserver) -> None:
        """Unregister ``observer``; ValueError if it was not registered."""
        with self._lock:
            kept = tuple(o for o in self._observers if o is not observer)
            if len(kept) == len(self._observers):
                raise ValueError("That observer is not registered with this engine.")
            self._observers = kept

    def _notify(self, hook: str, *args: Any) -> None:
        for observer in self._observers:
            fn = getattr(observer, hook, None)
            if fn is None:
                continue
            try:
                fn(*args)
            except Exception:  # an observer must not break output processing
                logger.exception("%s hook of %r failed", hook, observer)

    def on_request(
        self, key: str, request_id: str, num_prompt_tokens: int, arrival_time: float
    ) -> None:
        self._notify("on_request", key, request_id, num_prompt_tokens, arrival_time)

    def on_constraint(self, key: str, request_id: str, constraint: str) -> None:
        self._notify("on_constraint", key, request_id, constraint)

    def on_event(self, ev: LifecycleEvent) -> None:
        self._notify("on_event", ev)

    def on_scheduled(self, key: str, when: float) -> None:
        self._notify("on_scheduled", key, when)

    def on_tokens(
        self, key: str, num_output_tokens: int, now: float, num_cached_tokens: int | None
    ) -> None:
        self._notify("on_tokens", key, num_output_tokens, now, num_cached_tokens)

    def on_step(self, stats: StepStats) -> None:
        self._notify("on_step", stats)

    def on_routed(self, key: str, replica: int) -> None:
        self._notify("on_routed", key, replica)
