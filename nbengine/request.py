"""Request state and the user-visible lifecycle.

``RequestStatus`` is the lifecycle every request walks through (docs/lifecycle.md)::

    QUEUED -> WAITING -> RUNNING <-> PREEMPTED -> RELEASING -> FINISHED_*

``QUEUED`` and ``RELEASING`` exist only in the frontend: QUEUED is "accepted, not yet
in the core", RELEASING is "the finish is decided, the core has not yet confirmed
that it freed the request". The core itself only ever holds WAITING, RUNNING and
PREEMPTED requests and moves them to a FINISHED_* status when it removes them.

``Request`` is the engine core's record of one incarnation of a request. It is keyed
by the internal request key (unique per incarnation), never by the user's id.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from nbengine.sampling_params import SamplingParams
    from nbengine.structured_outputs import GrammarMatcher


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


@dataclass(slots=True, eq=False)
class Request:
    """The engine core's state for one incarnation of a request.

    Invariants:
    - ``all_token_ids == prompt_token_ids + output_token_ids`` at all times.
    - ``num_computed_tokens <= len(all_token_ids)``; KV entries exist for exactly the
      first ``num_computed_tokens`` positions while the request holds blocks.
    - A PREEMPTED request holds no KV blocks and has ``num_computed_tokens == 0``.
    """

    request_id: str  # internal key: unique per incarnation
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    arrival_time: float
    priority: int = 0
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit tokens on first admission; -1 = not yet
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    generator: torch.Generator | None = None  # per-request RNG when params.seed is set
    grammar: GrammarMatcher | None = None  # structured outputs: the request's grammar state
    finished_by_grammar: bool = False  # its grammar matched and allows nothing more
    error: str | None = None  # set when its own logits processor failed: it ends in error
    cache_salt: str | None = None  # prefix-cache isolation: blocks shared only within a salt

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
