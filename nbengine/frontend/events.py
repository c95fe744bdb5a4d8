"""Lifecycle events: one record per status transition of one request incarnation.

The output processor hands every ``LifecycleEvent`` and every core ``StepStats`` to the
engine's observers (nbengine/frontend/observer.py), always on the ``nbengine-loop``
thread. The metrics log and the dashboard are such an observer.
"""

from __future__ import annotations

from dataclasses import dataclass

from nbengine.request import RequestStatus

__all__ = ["LifecycleEvent"]


@dataclass(slots=True, frozen=True)
class LifecycleEvent:
    """One transition ``from_status -> to_status`` of the incarnation ``key``.

    ``request_id`` is the user's id; ``key`` is the internal key of one incarnation
    (for ``n > 1`` each child has its own key). ``from_status`` is None for the first
    event (QUEUED). ``time`` is ``time.monotonic()``, ``wall_time`` is ``time.time()``.
    ``step`` is the number of the latest engine step the frontend had seen (None before
    the first one).
    """

    request_id: str
    key: str
    from_status: RequestStatus | None
    to_status: RequestStatus
    time: float
    wall_time: float
    num_output_tokens: int
    step: int | None
