"""``EngineObserver``: what the frontend tells the metrics log, the dashboard and tools.

The output processor notifies every registered observer, always on the
``nbengine-loop`` thread (docs/architecture.md, "Threads"): when an incarnation (each
``n > 1`` child) is registered, on every lifecycle transition, when the core's schedule
time of a running request is known, when a request has new tokens, when a request
runs under a structured-output constraint, for every engine step,
and when a multi-replica backend places a request. Register one with
``engine.add_observer(obs)``; the engine's own ``MetricsLog`` (nbengine/metrics.py) is the
first, and the dashboard's monitor reads that log. Hooks must be quick and must not
block: they run between the model's output batches. A hook that raises is logged and
the others still run.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
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

    def on_adapter(self, key: str, request_id: str, lora_name: str) -> None:
        """``key`` runs under the LoRA adapter ``lora_name`` (docs/lora.md)."""
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

    def on_spec_accepted(self, key: str, num_accepted: int) -> None:
        """``num_accepted`` more speculative drafts of ``key`` were accepted
        (docs/speculative-decoding.md)."""
        return None

    def on_routed(self, key: str, replica: int) -> None:
        """A multi-replica backend placed ``key`` on engine core ``replica``."""
        return None


_HOOKS = (
    "on_request",
    "on_constraint",
    "on_adapter",
    "on_event",
    "on_scheduled",
    "on_tokens",
    "on_step",
    "on_routed",
    "on_spec_accepted",
)

# (observer, its bound hook): the observer is named when its hook raises.
_Bound = tuple[tuple[object, Callable[..., Any]], ...]


def _bound_hooks(observers: tuple[EngineObserver, ...]) -> dict[str, _Bound]:
    """Each hook's bound methods, resolved once; an inherited no-op default is left out."""
    hooks: dict[str, _Bound] = {}
    for hook in _HOOKS:
        default = getattr(EngineObserver, hook)
        bound = []
        for obs in observers:
            own = hook in getattr(obs, "__dict__", {})
            if not own and getattr(type(obs), hook, None) is default:
                continue  # EngineObserver's no-op: calling it changes nothing
            fn = getattr(obs, hook, None)
            if fn is not None:
                bound.append((obs, fn))
        hooks[hook] = tuple(bound)
    return hooks


class ObserverList(EngineObserver):
    """The observers of one engine: each hook calls every observer's hook.

    ``add``/``remove`` may be called from any thread: they rebuild the bound hooks
    (resolved once per change, not per call) and replace them, never mutating in place,
    so the loop thread iterates a consistent tuple without a lock. Each hook calls the
    observers' hooks itself (no by-name dispatcher between: this runs per token).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._observers: tuple[EngineObserver, ...] = ()
        self._hooks = _bound_hooks(())

    def add(self, observer: EngineObserver) -> None:
        """Register ``observer`` (once; adding it again does nothing)."""
        with self._lock:
            if not any(o is observer for o in self._observers):
                self._observers = (*self._observers, observer)
                self._hooks = _bound_hooks(self._observers)

    def remove(self, observer: EngineObserver) -> None:
        """Unregister ``observer``; ValueError if it was not registered."""
        with self._lock:
            kept = tuple(o for o in self._observers if o is not observer)
            if len(kept) == len(self._observers):
                raise ValueError("That observer is not registered with this engine.")
            self._observers = kept
            self._hooks = _bound_hooks(kept)

    # Each hook: call every bound hook; one that raises is logged, the others still run
    # (an observer must not break output processing).

    def on_request(
        self, key: str, request_id: str, num_prompt_tokens: int, arrival_time: float
    ) -> None:
        for obs, fn in self._hooks["on_request"]:
            try:
                fn(key, request_id, num_prompt_tokens, arrival_time)
            except Exception:
                logger.exception("on_request hook of %r failed", obs)

    def on_constraint(self, key: str, request_id: str, constraint: str) -> None:
        for obs, fn in self._hooks["on_constraint"]:
            try:
                fn(key, request_id, constraint)
            except Exception:
                logger.exception("on_constraint hook of %r failed", obs)

    def on_adapter(self, key: str, request_id: str, lora_name: str) -> None:
        for obs, fn in self._hooks["on_adapter"]:
            try:
                fn(key, request_id, lora_name)
            except Exception:
                logger.exception("on_adapter hook of %r failed", obs)

    def on_event(self, ev: LifecycleEvent) -> None:
        for obs, fn in self._hooks["on_event"]:
            try:
                fn(ev)
            except Exception:
                logger.exception("on_event hook of %r failed", obs)

    def on_scheduled(self, key: str, when: float) -> None:
        for obs, fn in self._hooks["on_scheduled"]:
            try:
                fn(key, when)
            except Exception:
                logger.exception("on_scheduled hook of %r failed", obs)

    def on_tokens(
        self, key: str, num_output_tokens: int, now: float, num_cached_tokens: int | None
    ) -> None:
        for obs, fn in self._hooks["on_tokens"]:
            try:
                fn(key, num_output_tokens, now, num_cached_tokens)
            except Exception:
                logger.exception("on_tokens hook of %r failed", obs)

    def on_step(self, stats: StepStats) -> None:
        for obs, fn in self._hooks["on_step"]:
            try:
                fn(stats)
            except Exception:
                logger.exception("on_step hook of %r failed", obs)

    def on_spec_accepted(self, key: str, num_accepted: int) -> None:
        for obs, fn in self._hooks["on_spec_accepted"]:
            try:
                fn(key, num_accepted)
            except Exception:
                logger.exception("on_spec_accepted hook of %r failed", obs)

    def on_routed(self, key: str, replica: int) -> None:
        for obs, fn in self._hooks["on_routed"]:
            try:
                fn(key, replica)
            except Exception:
                logger.exception("on_routed hook of %r failed", obs)
