"""The engine's lifecycle event log and its pandas views.

``MetricsLog`` records, in bounded memory:

- every lifecycle transition of every request (a ring buffer of the frontend's
  ``LifecycleEvent``s, nbengine/frontend/events.py),
- one ``RequestSummary`` per request incarnation (bounded too: when full, the oldest
  *finished* summaries are dropped first; live requests are always kept),
- every engine step's ``StepStats`` (a ring buffer).

Threading: the engine mutates the log only on its loop thread (``on_event``,
``on_step``, ``on_request``, ``on_tokens``). Readers on any thread (the notebook,
the UI updater) call ``events()``, ``request_stats()``, ``step_stats()`` or
``snapshot_requests()``; every mutation and every read holds ``self._lock`` for
a short, non-blocking critical section, so a reader always sees a consistent state
(never a half-applied transition) and never blocks the loop for long.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from nbengine.outputs import RequestTimings
from nbengine.request import RequestStatus

if TYPE_CHECKING:
    import pandas as pd

    from nbengine.core.messages import StepStats
    from nbengine.frontend.events import LifecycleEvent

__all__ = [
    "EVENT_COLUMNS",
    "REQUEST_COLUMNS",
    "STEP_COLUMNS",
    "MetricsLog",
    "RequestSummary",
]

EVENT_COLUMNS: tuple[str, ...] = (
    "request_id",
    "key",
    "from_status",
    "to_status",
    "time",
    "elapsed",
    "wall_time",
    "num_output_tokens",
    "step",
)
REQUEST_COLUMNS: tuple[str, ...] = (
    "request_id",
    "key",
    "status",
    "finish_reason",
    "prompt_tokens",
    "output_tokens",
    "queue_time",
    "ttft",
    "itl_mean",
    "itl_p99",
    "e2e_time",
    "preemptions",
    "num_cached_tokens",
    "arrival_time",
    "finished_time",
    "replica",
    "spec_accepted_tokens",
    "lora",
)
STEP_COLUMNS: tuple[str, ...] = (
    "step",
    "time",
    "elapsed",
    "batch_size",
    "prefill_tokens",
    "decode_tokens",
    "kv_blocks_used",
    "kv_blocks_total",
    "kv_usage",
    "step_time",
    "running",
    "waiting",
    "preemptions",
    "prefix_cache_hit_rate",
    "replica",
    "spec_draft_tokens",
    "spec_accepted_tokens",
)


@dataclass(slots=True)
class RequestSummary(RequestTimings):
    """Running totals for one incarnation of a request (keyed by its internal key).

    Invariants: ``itl_count``/``itl_sum`` cover every inter-token gap seen;
    ``itl_recent`` holds at most ``max_itl_samples`` of the most recent gaps (used for p99).
    """

    request_id: str
    key: str
    status: RequestStatus
    arrival_time: float
    prompt_tokens: int | None = None
    output_tokens: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    preemptions: int = 0
    num_cached_tokens: int | None = None
    timed_tokens: int = 0  # output tokens whose arrival time has been recorded
    itl_count: int = 0
    itl_sum: float = 0.0
    itl_recent: deque[float] = field(default_factory=deque)
    replica: int | None = None  # the engine core that served it (backend="ray"); None in-process
    constraint: str | None = None  # structured outputs: "json: {...}", "regex: ...", ...
    spec_accepted_tokens: int = 0  # speculative drafts accepted (docs/speculative-decoding.md)
    lora: str | None = None  # the LoRA adapter's name (docs/lora.md); None: the base model

    @property
    def finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    @property
    def finish_reason(self) -> str | None:
        reason = RequestStatus.get_finish_reason(self.status)
        return None if reason is None else str(reason)

    @property
    def itl_mean(self) -> float | None:
        return self.itl_sum / self.itl_count if self.itl_count else None

    @property
    def itl_p99(self) -> float | None:
        if not self.itl_recent:
            return None
        ordered = sorted(self.itl_recent)
        # Nearest-rank percentile: the smallest gap >= 99% of all gaps.
        rank = max(1, math.ceil(0.99 * len(ordered)))
        return ordered[rank - 1]


@dataclass(slots=True, frozen=True)
class RequestRow:
    """An immutable snapshot of a ``RequestSummary`` for readers (dashboard, DataFrames)."""

    request_id: str
    key: str
    status: RequestStatus
    finish_reason: str | None
    prompt_tokens: int | None
    output_tokens: int
    queue_time: float | None
    ttft: float | None
    itl_mean: float | None
    itl_p99: float | None
    e2e_time: float | None
    preemptions: int
    num_cached_tokens: int | None
    arrival_time: float
    finished_time: float | None
    replica: int | None = None
    constraint: str | None = None  # structured outputs: "json: {...}", "regex: ...", ...
    spec_accepted_tokens: int = 0
    lora: str | None = None  # the LoRA adapter's name (docs/lora.md); None: the base model


def _row(s: RequestSummary) -> RequestRow:
    return RequestRow(
        request_id=s.request_id,
        key=s.key,
        status=s.status,
        finish_reason=s.finish_reason,
        prompt_tokens=s.prompt_tokens,
        output_tokens=s.output_tokens,
        queue_time=s.queue_time,
        ttft=s.ttft,
        itl_mean=s.itl_mean,
        itl_p99=s.itl_p99,
        e2e_time=s.e2e_time,
        preemptions=s.preemptions,
        num_cached_tokens=s.num_cached_tokens,
        arrival_time=s.arrival_time,
        finished_time=s.finished_time,
        replica=s.replica,
        constraint=s.constraint,
        spec_accepted_tokens=s.spec_accepted_tokens,
        lora=s.lora,
    )


class MetricsLog:
    """Bounded, thread-safe log of lifecycle events, per-request summaries and steps.

    ``max_events`` / ``max_steps`` bound the ring buffers (oldest entries drop first);
    ``max_requests`` bounds the summaries (oldest finished ones drop first);
    ``max_itl_samples`` bounds the gaps kept per request for the p99.
    """

    def __init__(
        self,
        max_events: int = 100_000,
        max_requests: int = 10_000,
        max_steps: int = 100_000,
        max_itl_samples: int = 4096,
    ) -> None:
        for name, value in (
            ("max_events", max_events),
            ("max_requests", max_requests),
            ("max_steps", max_steps),
            ("max_itl_samples", max_itl_samples),
        ):
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}.")
        self._lock = threading.Lock()
        self._events: deque[LifecycleEvent] = deque(maxlen=max_events)
        self._steps: deque[StepStats] = deque(maxlen=max_steps)
        self._latest_by_replica: dict[int, StepStats] = {}
        self._requests: OrderedDict[str, RequestSummary] = OrderedDict()
        self._max_requests = max_requests
        self._max_itl = max_itl_samples
        self._num_finished = 0  # finished summaries currently held (for eviction)
        self._version = 0  # bumped on every mutation; readers use it to skip work
        self.start_time = time.monotonic()
        self.total_events = 0  # ever recorded, including dropped ones
        self.total_output_tokens = 0
        # Speculative decoding, over every step seen (docs/speculative-decoding.md).
        self.total_spec_draft_tokens = 0
        self.total_spec_accepted_tokens = 0

    # ------------------------------------------------------------------ writers
    # Called on the engine loop thread only.

    def on_request(
        self,
        key: str,
        request_id: str,
        num_prompt_tokens: int,
        arrival_time: float,
    ) -> None:
        """Record a new incarnation's prompt length and arrival time (before or after QUEUED)."""
        with self._lock:
            s = self._summary(key, request_id, arrival_time)
            s.prompt_tokens = num_prompt_tokens
            s.arrival_time = arrival_time
            self._version += 1

    def on_event(self, ev: LifecycleEvent) -> None:
        """Record one lifecycle transition and fold it into the request's summary."""
        rec = ev
        if type(ev.to_status) is not RequestStatus:  # stored as the enum, whatever was given
            rec = dataclasses.replace(ev, to_status=RequestStatus(ev.to_status))
        with self._lock:
            self._events.append(rec)
            self.total_events += 1
            s = self._summary(rec.key, rec.request_id, rec.time)
            was_finished = s.finished
            s.status = rec.to_status
            if rec.num_output_tokens > s.output_tokens:
                self.total_output_tokens += rec.num_output_tokens - s.output_tokens
                s.output_tokens = rec.num_output_tokens
            if RequestStatus.is_finished(rec.to_status):
                # The frontend's count is final (tokens after a stop string are dropped).
                s.output_tokens = rec.num_output_tokens
            if rec.to_status == RequestStatus.RUNNING and s.first_scheduled_time is None:
                s.first_scheduled_time = rec.time
            elif rec.to_status == RequestStatus.PREEMPTED:
                s.preemptions += 1
            elif RequestStatus.is_finished(rec.to_status):
                s.finished_time = rec.time
                if not was_finished:
                    self._num_finished += 1
                    self._evict()
            self._version += 1

    def on_tokens(
        self,
        key: str,
        num_output_tokens: int,
        now: float,
        num_cached_tokens: int | None = None,
    ) -> None:
        """Record that ``key`` has ``num_output_tokens`` output tokens in all, as of ``now``.

        The count is cumulative, so a repeated or late call never double counts. Several
        new tokens in one delivery count as gaps of zero after the first one, which is
        what a user streaming the output sees. Unknown and finished keys are ignored.
        """
        with self._lock:
            self._tokens_locked(key, num_output_tokens, now, num_cached_tokens)

    def _tokens_locked(
        self, key: str, num_output_tokens: int, now: float, num_cached_tokens: int | None
    ) -> None:
        s = self._requests.get(key)
        if s is None or s.finished:
            return
        if num_cached_tokens is not None and num_cached_tokens >= 0:
            # Reported with the first outputs; later outputs may carry 0.
            s.num_cached_tokens = max(s.num_cached_tokens or 0, num_cached_tokens)
        new = num_output_tokens - s.timed_tokens
        if new > 0:
            gap = 0.0 if s.last_token_time is None else now - s.last_token_time
            if s.first_token_time is None:
                s.first_token_time = now
                gaps = [0.0] * (new - 1)
            else:
                gaps = [gap] + [0.0] * (new - 1)
            for g in gaps:
                s.itl_count += 1
                s.itl_sum += g
                if len(s.itl_recent) >= self._max_itl:
                    s.itl_recent.popleft()
                s.itl_recent.append(g)
            s.last_token_time = now
            s.timed_tokens = num_output_tokens
            if num_output_tokens > s.output_tokens:
                self.total_output_tokens += num_output_tokens - s.output_tokens
                s.output_tokens = num_output_tokens
        self._version += 1

    def on_spec_accepted(self, key: str, num_accepted: int) -> None:
        """``num_accepted`` more speculative drafts of ``key`` were accepted."""
        with self._lock:
            s = self._requests.get(key)
            if s is not None:
                s.spec_accepted_tokens += num_accepted
                self._version += 1

    def on_constraint(self, key: str, request_id: str, constraint: str) -> None:
        """``key`` runs under a structured-output constraint (its short description)."""
        with self._lock:
            s = self._summary(key, request_id, time.monotonic())
            s.constraint = constraint
            self._version += 1

    def on_adapter(self, key: str, request_id: str, lora_name: str) -> None:
        """``key`` runs under the LoRA adapter ``lora_name``."""
        with self._lock:
            s = self._summary(key, request_id, time.monotonic())
            s.lora = lora_name
            self._version += 1

    def on_replica(self, key: str, replica: int) -> None:
        """``key`` was placed on engine core ``replica`` (multi-replica backends)."""
        with self._lock:
            s = self._requests.get(key)
            if s is not None:
                s.replica = replica
                self._version += 1

    def on_routed(self, key: str, replica: int) -> None:
        """The observer hook (frontend/observer.py) for ``on_replica``."""
        self.on_replica(key, replica)

    def on_scheduled(self, key: str, when: float) -> None:
        """The core scheduled ``key`` at ``when`` (its own clock reading, before the forward).

        More precise than the frontend's RUNNING event, which is stamped when the batch
        reaches the loop; the earliest reading wins. Unknown keys are ignored.
        """
        with self._lock:
            s = self._requests.get(key)
            if s is not None and (s.first_scheduled_time is None or when < s.first_scheduled_time):
                s.first_scheduled_time = when
                self._version += 1

    def on_step(self, stats: StepStats) -> None:
        """Record one engine step."""
        with self._lock:
            self._steps.append(stats)
            self._latest_by_replica[stats.replica] = stats
            self.total_spec_draft_tokens += stats.spec_draft_tokens
            self.total_spec_accepted_tokens += stats.spec_accepted_tokens
            self._version += 1

    # ------------------------------------------------------------------ readers

    @property
    def version(self) -> int:
        """A counter bumped by every mutation (cheap change detection for the UI)."""
        return self._version

    def snapshot_requests(self) -> list[RequestRow]:
        """Every held request summary, in arrival order, as immutable rows."""
        with self._lock:
            return [_row(s) for s in self._requests.values()]

    def overview(self, limit: int) -> tuple[list[RequestRow], dict[RequestStatus, int]]:
        """Up to ``limit`` rows for a live table, and the count of held requests per status.

        Live requests come first (arrival order), then the most recently arrived finished
        ones. Cheap enough to call at 10 Hz: only the returned rows are copied.
        """
        with self._lock:
            counts: dict[RequestStatus, int] = {}
            live: list[RequestSummary] = []
            for s in self._requests.values():
                counts[s.status] = counts.get(s.status, 0) + 1
                if not s.finished and len(live) < limit:
                    live.append(s)
            chosen = live
            if len(chosen) < limit:
                recent: list[RequestSummary] = []
                for s in reversed(self._requests.values()):
                    if len(chosen) + len(recent) >= limit:
                        break
                    if s.finished:
                        recent.append(s)
                chosen = live + recent
            return [_row(s) for s in chosen], counts

    def recent_steps(self, n: int | None = None) -> list[StepStats]:
        """The last ``n`` steps (all held steps if None), oldest first."""
        with self._lock:
            steps = list(self._steps)
        return steps if n is None else steps[-n:]

    def steps_since(self, since: float) -> list[StepStats]:
        """Held steps that started at or after ``since`` (monotonic), oldest first."""
        with self._lock:
            out: list[StepStats] = []
            for st in reversed(self._steps):
                if st.start_time < since:
                    break
                out.append(st)
        out.reverse()
        return out

    def latest_steps(self) -> dict[int, StepStats]:
        """Each engine core's (replica's) most recent step: with several replicas, their
        KV caches are separate and together make the engine's."""
        with self._lock:
            return dict(self._latest_by_replica)

    def event_records(self) -> list[LifecycleEvent]:
        """Every held event, oldest first."""
        with self._lock:
            return list(self._events)

    def events(self) -> pd.DataFrame:
        """One row per lifecycle transition (see ``EVENT_COLUMNS``); statuses as names."""
        import pandas as pd

        records = self.event_records()
        data: dict[str, list[Any]] = {c: [] for c in EVENT_COLUMNS}
        for r in records:
            data["request_id"].append(r.request_id)
            data["key"].append(r.key)
            data["from_status"].append(None if r.from_status is None else r.from_status.name)
            data["to_status"].append(r.to_status.name)
            data["time"].append(r.time)
            data["elapsed"].append(r.time - self.start_time)
            data["wall_time"].append(r.wall_time)
            data["num_output_tokens"].append(r.num_output_tokens)
            data["step"].append(r.step)
        df = pd.DataFrame(data, columns=list(EVENT_COLUMNS))
        df["num_output_tokens"] = df["num_output_tokens"].astype("int64")
        df["step"] = df["step"].astype("Int64")
        return df

    def request_stats(self) -> pd.DataFrame:
        """One row per request incarnation, in arrival order (see ``REQUEST_COLUMNS``).

        Times are seconds; ``queue_time`` is arrival -> first scheduled, ``ttft`` arrival ->
        first token, ``itl_*`` the gaps between output tokens, ``e2e_time`` arrival ->
        final status. Unknown values are NaN (``<NA>`` for integer columns).
        """
        import pandas as pd

        rows = self.snapshot_requests()
        data: dict[str, list[Any]] = {c: [] for c in REQUEST_COLUMNS}
        for r in rows:
            for c in REQUEST_COLUMNS:
                value = getattr(r, c)
                if c == "status":
                    value = value.name
                data[c].append(value)
        df = pd.DataFrame(data, columns=list(REQUEST_COLUMNS))
        for c in (
            "queue_time",
            "ttft",
            "itl_mean",
            "itl_p99",
            "e2e_time",
            "arrival_time",
            "finished_time",
        ):
            df[c] = df[c].astype("float64")
        for c in ("prompt_tokens", "num_cached_tokens", "replica"):
            df[c] = df[c].astype("Int64")
        for c in ("output_tokens", "preemptions", "spec_accepted_tokens"):
            df[c] = df[c].astype("int64")
        return df

    def step_stats(self) -> pd.DataFrame:
        """One row per engine step (see ``STEP_COLUMNS``); ``step_time`` in seconds."""
        import pandas as pd

        steps = self.recent_steps()
        data: dict[str, list[Any]] = {c: [] for c in STEP_COLUMNS}
        for s in steps:
            data["step"].append(s.step)
            data["time"].append(s.start_time)
            data["elapsed"].append(s.start_time - self.start_time)
            data["batch_size"].append(s.num_requests)
            data["prefill_tokens"].append(s.num_prefill_tokens)
            data["decode_tokens"].append(s.num_decode_tokens)
            data["kv_blocks_used"].append(s.kv_blocks_used)
            data["kv_blocks_total"].append(s.kv_blocks_total)
            data["kv_usage"].append(
                s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0
            )
            data["step_time"].append(s.duration_s)
            data["running"].append(s.num_running)
            data["waiting"].append(s.num_waiting)
            data["preemptions"].append(s.num_preemptions)
            data["prefix_cache_hit_rate"].append(
                s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0
            )
            data["replica"].append(s.replica)
            data["spec_draft_tokens"].append(s.spec_draft_tokens)
            data["spec_accepted_tokens"].append(s.spec_accepted_tokens)
        df = pd.DataFrame(data, columns=list(STEP_COLUMNS))
        int_cols = (
            "step",
            "batch_size",
            "prefill_tokens",
            "decode_tokens",
            "kv_blocks_used",
            "kv_blocks_total",
            "running",
            "waiting",
            "preemptions",
            "replica",
            "spec_draft_tokens",
            "spec_accepted_tokens",
        )
        for c in int_cols:
            df[c] = df[c].astype("int64")
        for c in ("time", "elapsed", "kv_usage", "step_time", "prefix_cache_hit_rate"):
            df[c] = df[c].astype("float64")
        return df

    # ------------------------------------------------------------------ internals

    def _summary(self, key: str, request_id: str, now: float) -> RequestSummary:
        """The summary for ``key``, created on first sight. Caller holds the lock."""
        s = self._requests.get(key)
        if s is None:
            s = RequestSummary(
                request_id=request_id, key=key, status=RequestStatus.QUEUED, arrival_time=now
            )
            self._requests[key] = s
            self._evict()
        return s

    def _evict(self) -> None:
        """Drop the oldest finished summaries while over capacity. Caller holds the lock."""
        excess = len(self._requests) - self._max_requests
        if excess <= 0 or self._num_finished == 0:
            return
        for key in [k for k, s in self._requests.items() if s.finished][:excess]:
            del self._requests[key]
            self._num_finished -= 1
