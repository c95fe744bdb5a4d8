"""What crosses between the frontend and the engine core.

Frontend -> core: one FIFO queue of ``EngineCoreMessage`` (ADD, ABORT, UTILITY).
Core -> frontend: one ``EngineCoreOutputs`` batch per step (or per processed input
that removed requests). Requests are always named by their internal key.

The protocol invariant: every request the core removes, for any reason (finished,
aborted, ignored, errored), appears in exactly one batch's ``finished`` set, and no
output for that key ever follows.
"""

from __future__ import annotations

import enum
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from nbengine.outputs import PositionLogprobs
from nbengine.request import FinishReason, RequestStatus
from nbengine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from nbengine.structured_outputs import GrammarMatcher


@dataclass(slots=True)
class EngineCoreRequest:
    """An ADD: everything the core needs to run one incarnation of a request."""

    request_id: str  # internal key, unique per incarnation
    prompt_token_ids: list[int]
    sampling_params: SamplingParams  # n == 1 here; the frontend fans out n > 1
    arrival_time: float
    priority: int = 0
    eos_token_ids: frozenset[int] = frozenset()
    # Built by the frontend for ``sampling_params.structured_outputs`` (never compiled on
    # the core's thread); None there makes the core build one (a backend that pickles).
    grammar: GrammarMatcher | None = None
    cache_salt: str | None = None  # vLLM's prefix-cache isolation between tenants
    lora_int_id: int = 0  # its LoRA adapter (0: none), loaded in the runner before the ADD
    lora_key: str | None = None  # unique per load of that adapter (the prefix-cache key)


class MessageType(enum.Enum):
    ADD = "add"
    ABORT = "abort"
    UTILITY = "utility"
    SHUTDOWN = "shutdown"


@dataclass(slots=True)
class EngineCoreMessage:
    """One item of the core's FIFO input queue.

    ADD carries an ``EngineCoreRequest``; ABORT a list of internal keys; UTILITY a
    callable run on the core thread between steps, its result set on ``future``.
    """

    type: MessageType
    payload: Any = None
    future: Future[Any] | None = None


@dataclass(slots=True)
class EngineCoreOutput:
    """New results of one request in one step."""

    request_id: str  # internal key
    new_token_ids: list[int]
    new_logprobs: list[PositionLogprobs] | None = None
    new_prompt_logprobs: list[PositionLogprobs | None] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    status: RequestStatus = RequestStatus.RUNNING
    num_cached_tokens: int = 0
    error: str | None = None  # why, for FINISHED_IGNORED / FINISHED_ERROR
    # Finished (STOP, stop_reason None) because its structured-output grammar matched and
    # allows nothing more: the last token is content, not an EOS to hide.
    finished_by_grammar: bool = False
    num_spec_accepted: int = 0  # speculative drafts accepted among new_token_ids

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class StatusEvent:
    """A core-side lifecycle transition (WAITING, RUNNING, PREEMPTED, FINISHED_*)."""

    request_id: str  # internal key
    status: RequestStatus
    time: float  # time.monotonic()
    num_output_tokens: int = 0


@dataclass(slots=True)
class StepStats:
    """One engine step, for metrics."""

    step: int
    start_time: float  # time.monotonic()
    duration_s: float
    num_requests: int  # scheduled in this step
    num_prefill_tokens: int
    num_decode_tokens: int
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    prefix_cache_queries: int  # cumulative, in tokens
    prefix_cache_hits: int  # cumulative, in tokens
    num_preemptions: int  # in this step
    replica: int = 0  # the engine core that ran it (data-parallel replica; 0 in-process)
    spec_draft_tokens: int = 0  # speculative drafts verified in this step
    spec_accepted_tokens: int = 0  # of those, accepted (docs/speculative-decoding.md)


@dataclass(slots=True)
class EngineCoreOutputs:
    """One batch from the core to the frontend."""

    outputs: list[EngineCoreOutput] = field(default_factory=list)
    finished: set[str] = field(default_factory=set)  # every key removed by the core
    events: list[StatusEvent] = field(default_factory=list)
    step: StepStats | None = None
    # Set once, when the core dies: every live request must fail with this message.
    engine_error: str | None = None
