"""What users receive: ``RequestOutput`` with one ``CompletionOutput`` per sample."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from nbengine.request import RequestStatus

if TYPE_CHECKING:
    from nbengine.tool_parsers import ToolCall


@dataclass(slots=True)
class Logprob:
    """The log-probability of one token at one position, and its rank (1 = most likely)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per position: token id -> Logprob (the top-k plus the chosen token).
PositionLogprobs = dict[int, Logprob]


@dataclass(slots=True)
class CompletionOutput:
    """One completion of a request (``index`` distinguishes the n>1 samples).

    ``tool_calls`` and ``content`` are set on the final output of a chat with tools
    (``Engine.chat(..., tools=...)``, docs/api.md): the calls parsed from ``text`` and
    ``text`` without them (None when nothing else is left); ``text`` stays the model's
    whole reply. Both are None otherwise.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None
    stop_reason: int | str | None = None
    tool_calls: list[ToolCall] | None = None
    content: str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestTimings:
    """The durations derived from a request's clock readings, in seconds (None until
    both readings are known): one derivation for ``RequestMetrics`` (what a user's output
    carries) and the metrics log's per-request summary (``nbengine.metrics``)."""

    __slots__ = ()
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None

    @property
    def queue_time(self) -> float | None:
        """Arrival to first scheduled."""
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def time_to_first_token(self) -> float | None:
        """Arrival to first output token."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    ttft = time_to_first_token

    @property
    def e2e_time(self) -> float | None:
        """Arrival to the final status."""
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


@dataclass(slots=True)
class RequestMetrics(RequestTimings):
    """Clock readings of one request, in seconds on the monotonic clock (None until
    known); the durations (``time_to_first_token``, ...) come from ``RequestTimings``."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0


@dataclass(slots=True)
class RequestOutput:
    """The state of a request as seen by the user, shaped by ``output_kind``."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    status: RequestStatus = RequestStatus.QUEUED
    metrics: RequestMetrics | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    error: str | None = field(default=None, repr=False)
