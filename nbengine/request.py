"""Request state and the user-visible lifecycle.

``RequestStatus`` is the lifecycle every request walks through (docs/lifecycle.md)::

    QUEUED -> WAITING -> RUNNING <-> PREEMPTED -> RELEASING -> FINISHED_*

``QUEUED`` and ``RELEASING`` exist only in the frontend: QUEUED is "accepted, not yet
in the core", RELEASING is "the finish is decided, the core has not yet confirmed
that it freed the request". The core itself only ever holds WAITING, RUNNING and
PREEMPTED requests and moves them to a FINISHED_* status when it removes them.

The engine core's record of one incarnation, ``Request``, is in nbengine/core/request.py.
"""

from __future__ import annotations

import enum


class RequestStatus(enum.IntEnum):
    """Lifecycle status of a request; ordered, finished states come last."""

    QUEUED = 0
    WAITING = 1
    RUNNING = 2
    PREEMPTED = 3
    RELEASING = 4
    FINISHED_STOPPED = 5
    FINISHED_LENGTH_CAPPED = 6
    FINISHED_ABORTED = 7
    FINISHED_IGNORED = 8
    FINISHED_ERROR = 9

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        """True for the terminal FINISHED_* statuses."""
        return status >= RequestStatus.FINISHED_STOPPED

    @staticmethod
    def get_finish_reason(status: RequestStatus) -> FinishReason | None:
        """The FinishReason a terminal status maps to (None if not finished)."""
        return _FINISH_REASONS.get(status)

    def __str__(self) -> str:
        return self.name


class FinishReason(enum.IntEnum):
    """Why a completion ended; ``str()`` gives vLLM's external strings."""

    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3

    def __str__(self) -> str:
        return self.name.lower()


_FINISH_REASONS: dict[RequestStatus, FinishReason] = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    # As in vLLM: a prompt that cannot fit is reported as a length finish.
    RequestStatus.FINISHED_IGNORED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


class RequestIdInUseError(ValueError):
    """``generate()`` was given a request id whose previous incarnation is still live."""

    def __init__(self, request_id: str, status: RequestStatus) -> None:
        super().__init__(
            f"Request id {request_id!r} is already in use (status {status.name}); "
            "it can be reused once its final output has been delivered or "
            "engine.abort() has returned."
        )
        self.request_id = request_id
        self.status = status


class EngineDeadError(RuntimeError):
    """The engine core or its loop failed or was shut down; no further requests are served."""
