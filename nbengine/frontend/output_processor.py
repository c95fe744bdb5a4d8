"""Turns the core's output batches into user-visible ``RequestOutput``s.

Runs on the ``nbengine-loop`` thread only; all state here is owned by that thread.

Registry invariant (docs/lifecycle.md, "The invariant"): ``requests`` maps a user id to
its live incarnation from registration until its final output has been delivered, and
``keys`` maps every internal key the core may still hold to its child state. So the
set the frontend considers live always contains the set the core holds. Outputs are
routed by key only: an output whose key is unknown (an earlier incarnation, a
released key) is dropped.

A completion (child) is final only once the core names its key in a batch's
``finished`` set. For stop strings (decided here) and user aborts the child goes
RELEASING, an ABORT for its key is sent, and its final output waits for that
confirmation. A request (parent) is final when all its children are.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field

from nbengine.core.messages import EngineCoreOutput, EngineCoreOutputs
from nbengine.frontend.detokenizer import IncrementalDetokenizer, TokenizerLike
from nbengine.frontend.events import LifecycleEvent
from nbengine.frontend.handles import RequestHandle
from nbengine.frontend.observer import EngineObserver, ObserverList
from nbengine.outputs import (
    CompletionOutput,
    PositionLogprobs,
    RequestMetrics,
    RequestOutput,
)
from nbengine.request import EngineDeadError, FinishReason, RequestStatus
from nbengine.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["ChildState", "LiveRequest", "OutputProcessor"]

logger = logging.getLogger(__name__)

_LIVE_CORE_STATUSES = (RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.PREEMPTED)
_FINISHED_SEVERITY = (
    RequestStatus.FINISHED_ERROR,
    RequestStatus.FINISHED_ABORTED,
    RequestStatus.FINISHED_IGNORED,
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH_CAPPED,
)
_PARENT_LIVE_ORDER = (
    RequestStatus.RUNNING,
    RequestStatus.PREEMPTED,
    RequestStatus.WAITING,
    RequestStatus.QUEUED,
)
_STATUS_OF_REASON = {
    FinishReason.STOP: RequestStatus.FINISHED_STOPPED,
    FinishReason.LENGTH: RequestStatus.FINISHED_LENGTH_CAPPED,
    FinishReason.ABORT: RequestStatus.FINISHED_ABORTED,
    FinishReason.ERROR: RequestStatus.FINISHED_ERROR,
}


@dataclass(slots=True, eq=False)
class ChildState:
    """One completion of a request: one internal key, one incarnation in the core."""

    key: str
    index: int
    params: SamplingParams
    detok: IncrementalDetokenizer
    status: RequestStatus = RequestStatus.QUEUED
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    sent_tokens: int = 0  # output ids already covered by the stream
    sent_chars: int = 0  # chars of detok.text already covered by the stream
    sent_logprobs: int = 0
    final_sent: bool = False
    released: bool = False  # the core confirmed it no longer holds `key`
    abort_sent: bool = False
    aborted: bool = False  # the user aborted it before its finish was decided
    finish_reason: FinishReason | None = None  # set when released
    stop_reason: int | str | None = None
    core_finish: EngineCoreOutput | None = None  # the core's own finish, if it decided
    error: str | None = None


@dataclass(slots=True, eq=False)
class LiveRequest:
    """One incarnation of a user request id, with its ``n`` children."""

    request_id: str
    incarnation: int
    handle: RequestHandle
    params: SamplingParams
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[ChildState]
    metrics: RequestMetrics
    stream_interval: int
    done_future: Future[RequestOutput] = field(default_factory=Future)
    abort_requested: bool = False
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    prompt_logprobs_sent: bool = False
    num_cached_tokens: int = 0
    status: RequestStatus = RequestStatus.QUEUED
    finalized: bool = False
    # How many children are in each status, and how many the core has released: the
    # parent's status and "all released" are O(1) per child event, whatever ``n`` is.
    status_counts: dict[RequestStatus, int] = field(default_factory=dict)
    num_released: int = 0

    @property
    def all_released(self) -> bool:
        return self.num_released == len(self.children)


class OutputProcessor:
    """Frontend request state: routing, detokenization, stop strings, n>1 fan-in."""

    def __init__(
        self,
        tokenizer: TokenizerLike,
        send_abort: Callable[[list[str]], None],
        observers: ObserverList | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self._send_abort = send_abort
        # Notified on this thread; ObserverList logs a failing hook and carries on.
        self._observers: EngineObserver = observers if observers is not None else ObserverList()
        self.requests: dict[str, LiveRequest] = {}
        self.keys: dict[str, ChildState] = {}
        self._parent_of: dict[str, LiveRequest] = {}
        self.last_step: int | None = None
        self._token_text_cache: dict[int, str] = {}

    # ---------------------------------------------------------------- registry

    def add(self, live: LiveRequest) -> None:
        """Register a new incarnation (its id must not be live)."""
        assert live.request_id not in self.requests
        self.requests[live.request_id] = live
        live.handle._live = live
        for child in live.children:
            self.keys[child.key] = child
            self._parent_of[child.key] = live
            self._observers.on_request(
                child.key, live.request_id, len(live.prompt_token_ids), live.metrics.arrival_time
            )
            self._transition(live, child, RequestStatus.QUEUED)

    def num_unfinished(self) -> int:
        return len(self.requests)

    def _emit_event(
        self, live: LiveRequest, child: ChildState, old: RequestStatus | None, new: RequestStatus
    ) -> None:
        self._observers.on_event(
            LifecycleEvent(
                request_id=live.request_id,
                key=child.key,
                from_status=old,
                to_status=new,
                time=time.monotonic(),
                wall_time=time.time(),
                num_output_tokens=len(child.detok.token_ids),
                step=self.last_step,
            )
        )
        if new is RequestStatus.RUNNING and live.metrics.first_scheduled_time is not None:
            # The core's own schedule time: earlier than this event's (docs/architecture.md).
            self._observers.on_scheduled(child.key, live.metrics.first_scheduled_time)

    def _transition(self, live: LiveRequest, child: ChildState, new: RequestStatus) -> None:
        old = None if new is RequestStatus.QUEUED else child.status
        if old is new:
            return
        old_parent = live.status
        counts = live.status_counts
        if old is not None:
            counts[old] -= 1
        counts[new] = counts.get(new, 0) + 1
        child.status = new
        self._emit_event(live, child, old, new)
        live.status = self._parent_status(live)
        if (
            live.status is not old_parent
            and not live.finalized
            and not RequestStatus.is_finished(live.status)
        ):
            # The handle's view shows the new status; a finished one comes with the
            # final output (_finalize), never ahead of its text.
            live.handle._deliver(None)

    @staticmethod
    def _parent_status(live: LiveRequest) -> RequestStatus:
        """The request's status from its children's: O(number of statuses), not O(n)."""
        if len(live.children) == 1:
            return live.children[0].status
        counts = live.status_counts
        if sum(counts.get(s, 0) for s in _FINISHED_SEVERITY) == len(live.children):
            # n > 1, all children done: the most severe outcome names the request.
            for s in _FINISHED_SEVERITY:
                if counts.get(s):
                    return s
        for s in _PARENT_LIVE_ORDER:
            if counts.get(s):
                return s
        return RequestStatus.RELEASING

    # ------------------------------------------------------------------- abort

    def request_abort(self, live: LiveRequest) -> Future[RequestOutput]:
        """Start aborting ``live``: RELEASING, ABORT its unreleased keys; return its future."""
        if live.finalized:
            return live.done_future
        live.abort_requested = True
        keys: list[str] = []
        for child in live.children:
            if child.released:
                continue
            if child.detok.stop_string is None:
                child.aborted = True  # a completion stopped by a stop string keeps "stop"
            if child.status is not RequestStatus.RELEASING:
                self._transition(live, child, RequestStatus.RELEASING)
            if not child.abort_sent:
                child.abort_sent = True
                keys.append(child.key)
        if keys:
            self._send_abort(keys)
        return live.done_future

    # ----------------------------------------------------------------- outputs

    def process(self, batch: EngineCoreOutputs) -> None:
        """Apply one core batch: events, new tokens, confirmations; deliver outputs."""
        if batch.step is not None:
            self.last_step = batch.step.step
            self._observers.on_step(batch.step)
        now = time.monotonic()
        # Per request: the children this batch changed (publishing is O(changed), not O(n)).
        touched: dict[str, tuple[LiveRequest, dict[int, ChildState]]] = {}
        for ev in batch.events:
            child = self.keys.get(ev.request_id)
            if child is None or ev.status not in _LIVE_CORE_STATUSES:
                continue  # FINISHED_* are applied from `finished`, below
            if child.status is RequestStatus.RELEASING or child.released:
                continue  # the finish is decided; never move back
            live = self._parent_of[child.key]
            if ev.status is RequestStatus.RUNNING and live.metrics.first_scheduled_time is None:
                live.metrics.first_scheduled_time = ev.time
            elif ev.status is RequestStatus.PREEMPTED:
                live.metrics.num_preemptions += 1
            self._transition(live, child, ev.status)
        for out in batch.outputs:
            child = self.keys.get(out.request_id)
            if child is None:
                continue  # stale key: an earlier incarnation, or already released
            live = self._parent_of[child.key]
            if out.num_cached_tokens:
                live.num_cached_tokens = max(live.num_cached_tokens, out.num_cached_tokens)
            if out.new_prompt_logprobs and child.index == 0:
                # One entry per prompt position: only completion 0 asks the core for them.
                self._add_prompt_logprobs(live, out.new_prompt_logprobs)
            if out.finished:
                child.core_finish = out
            if child.detok.finished:
                continue  # a stop string already ended it: later tokens are dropped
            if out.new_token_ids:
                self._add_tokens(live, child, out, now)
                touched.setdefault(live.request_id, (live, {}))[1][child.index] = child
        if batch.engine_error is not None:
            # The core is dead: every live request fails with EngineDeadError, below.
            for live, changed in touched.values():
                self._publish(live, changed, now)
            self.fail_all(f"The engine core failed: {batch.engine_error}")
            return
        for key in batch.finished:
            child = self.keys.pop(key, None)
            if child is None:
                continue
            live = self._parent_of.pop(key)
            self._release(live, child)
            touched.setdefault(live.request_id, (live, {}))[1][child.index] = child
        for live, changed in touched.values():
            self._publish(live, changed, now)

    def _add_prompt_logprobs(self, live: LiveRequest, new: list[PositionLogprobs | None]) -> None:
        for pos in new:
            if pos is not None:
                self._fill_decoded(pos)
        if live.prompt_logprobs is None:
            live.prompt_logprobs = []
        live.prompt_logprobs.extend(new)

    def _fill_decoded(self, pos: PositionLogprobs) -> None:
        for tid, lp in pos.items():
            if lp.decoded_token is None:
                text = self._token_text_cache.get(tid)
                if text is None:
                    text = self._tokenizer.decode([tid], skip_special_tokens=False)
                    if len(self._token_text_cache) < 200_000:
                        self._token_text_cache[tid] = text
                lp.decoded_token = text

    def _add_tokens(
        self, live: LiveRequest, child: ChildState, out: EngineCoreOutput, now: float
    ) -> None:
        ids = out.new_token_ids
        if live.metrics.first_token_time is None:
            live.metrics.first_token_time = now
        live.metrics.last_token_time = now
        if out.new_logprobs is not None:
            if child.logprobs is None:
                child.logprobs = []
                child.cumulative_logprob = 0.0
            for tid, pos in zip(ids, out.new_logprobs):
                if child.params.detokenize:  # detokenize=False: decoded_token stays None
                    self._fill_decoded(pos)
                child.logprobs.append(pos)
                chosen = pos.get(tid)
                if chosen is not None and child.cumulative_logprob is not None:
                    child.cumulative_logprob += chosen.logprob
        # EOS / a stop token ends the completion: its text is shown only if asked for.
        hide_last = (
            out.finish_reason is FinishReason.STOP
            and (out.stop_reason is None or isinstance(out.stop_reason, int))
            and not child.params.include_stop_str_in_output
            and not out.finished_by_grammar
        )
        stop = child.detok.update(ids, exclude_last_text=hide_last)
        self._observers.on_tokens(
            child.key, len(child.detok.token_ids), now, live.num_cached_tokens
        )
        if stop is not None and not out.finished and not child.released:
            # Decided here: the core still runs it. RELEASING until it confirms.
            self._transition(live, child, RequestStatus.RELEASING)
            if not child.abort_sent:
                child.abort_sent = True
                self._send_abort([child.key])

    def _release(self, live: LiveRequest, child: ChildState) -> None:
        """The core confirmed that it no longer holds ``child.key``: decide its finish."""
        child.released = True
        live.num_released += 1
        core = child.core_finish
        stop_reason: int | str | None
        # A finish the frontend had decided when the abort was asked for stands (as in
        # vLLM): `request_abort` marks only the completions still undecided. A finish the
        # core reports after that (a final token in the step the abort arrived in) loses.
        if child.aborted:
            reason, stop_reason, status = FinishReason.ABORT, None, RequestStatus.FINISHED_ABORTED
        elif child.detok.stop_string is not None:
            reason, stop_reason = FinishReason.STOP, child.detok.stop_string
            status = RequestStatus.FINISHED_STOPPED
        elif core is not None and core.finish_reason is not None:
            reason, stop_reason = core.finish_reason, core.stop_reason
            status = (
                core.status
                if RequestStatus.is_finished(core.status)
                else _STATUS_OF_REASON[core.finish_reason]
            )
            child.error = core.error
        else:
            reason, stop_reason = FinishReason.ABORT, None
            status = RequestStatus.FINISHED_ABORTED
        child.finish_reason = reason
        child.stop_reason = stop_reason
        child.detok.finish()
        self._transition(live, child, status)

    # --------------------------------------------------------------- publishing

    def _completion(self, child: ChildState, delta: bool) -> CompletionOutput:
        text = child.detok.text
        end = child.detok.streamable_len(child.released)
        ids = child.detok.token_ids
        if delta:
            c = CompletionOutput(
                index=child.index,
                text=text[child.sent_chars : end],
                token_ids=ids[child.sent_tokens :],
                cumulative_logprob=child.cumulative_logprob,
                logprobs=(
                    child.logprobs[child.sent_logprobs :] if child.logprobs is not None else None
                ),
            )
        else:
            c = CompletionOutput(
                index=child.index,
                text=text[:end],
                token_ids=list(ids),
                cumulative_logprob=child.cumulative_logprob,
                logprobs=list(child.logprobs) if child.logprobs is not None else None,
            )
        child.sent_chars = max(child.sent_chars, end)
        child.sent_tokens = len(ids)
        child.sent_logprobs = len(child.logprobs) if child.logprobs is not None else 0
        if child.released:
            c.finish_reason = str(child.finish_reason)
            c.stop_reason = child.stop_reason
            child.final_sent = True
        return c

    def _full_output(self, live: LiveRequest) -> RequestOutput:
        comps = []
        for child in live.children:
            comps.append(
                CompletionOutput(
                    index=child.index,
                    text=child.detok.text,
                    token_ids=list(child.detok.token_ids),
                    cumulative_logprob=child.cumulative_logprob,
                    logprobs=list(child.logprobs) if child.logprobs is not None else None,
                    finish_reason=str(child.finish_reason)
                    if child.finish_reason is not None
                    else None,
                    stop_reason=child.stop_reason,
                )
            )
        errors = [c.error for c in live.children if c.error]
        return _request_output(
            live, comps, True, live.prompt_logprobs, error=errors[0] if errors else None
        )

    def _publish(self, live: LiveRequest, changed: dict[int, ChildState], now: float) -> None:
        if live.finalized:
            return
        all_released = live.all_released
        kind = live.params.output_kind
        stream_out: RequestOutput | None = None
        if kind is not RequestOutputKind.FINAL_ONLY:
            delta = kind is RequestOutputKind.DELTA
            comps: list[CompletionOutput] = []
            for _, child in sorted(changed.items()):
                if child.final_sent:
                    continue
                if not child.released:
                    if child.detok.finished:
                        continue  # stop string: everything goes out with the final output
                    n = len(child.detok.token_ids)
                    first = child.sent_tokens == 0 and n > 0
                    if not first and n - child.sent_tokens < live.stream_interval:
                        continue
                comps.append(self._completion(child, delta))
            if comps:
                prompt_lp = live.prompt_logprobs
                if delta:
                    prompt_lp = None if live.prompt_logprobs_sent else live.prompt_logprobs
                if prompt_lp is not None:
                    live.prompt_logprobs_sent = True
                stream_out = _request_output(live, comps, all_released, prompt_lp)
        if not all_released:
            # Every update publishes the handle's view, also when the output kind
            # (FINAL_ONLY, stream_interval) gives the consumer nothing yet.
            live.handle._deliver(stream_out, changed=changed.values())
            return
        self._finalize(live, stream_out, now, error=None)

    def _finalize(
        self,
        live: LiveRequest,
        stream_out: RequestOutput | None,
        now: float,
        error: EngineDeadError | None,
    ) -> None:
        """Deliver the final output and free the id (the core holds none of its keys)."""
        live.finalized = True
        live.metrics.finished_time = now
        final = self._full_output(live)
        if live.params.output_kind is RequestOutputKind.FINAL_ONLY:
            stream_out = self._full_output(live)
        elif stream_out is None:
            # Every child's last completion went out earlier; close the stream anyway.
            stream_out = _request_output(live, [], True, None)
        stream_out.finished = True
        stream_out.status = final.status
        # Free the id first: a consumer that sees the final output may reuse it at once.
        if self.requests.get(live.request_id) is live:
            del self.requests[live.request_id]
        live.handle._deliver(None if error is not None else stream_out, final, error)
        if not live.done_future.done():
            live.done_future.set_result(final)

    # ----------------------------------------------------------------- failure

    def fail_all(self, message: str, reason: FinishReason = FinishReason.ERROR) -> None:
        """Finish every live request at once (the core is dead or shut down)."""
        now = time.monotonic()
        for live in list(self.requests.values()):
            self._fail(live, message, reason, now)
        self.requests.clear()
        self.keys.clear()
        self._parent_of.clear()

    def fail_requests(self, keys: Iterable[str], message: str) -> int:
        """Fail the live requests owning ``keys`` (finish_reason "error", EngineDeadError).

        Used when one replica of several is lost: only its requests end, each as a
        whole (all ``n`` children of a request live on one replica). Returns how many.
        """
        now = time.monotonic()
        lives: list[LiveRequest] = []
        for key in keys:
            live = self._parent_of.get(key)
            if live is not None and live not in lives and not live.finalized:
                lives.append(live)
        for live in lives:
            self._fail(live, message, FinishReason.ERROR, now)
        return len(lives)

    def _fail(self, live: LiveRequest, message: str, reason: FinishReason, now: float) -> None:
        status = _STATUS_OF_REASON[reason]
        for child in live.children:
            if child.released:
                continue
            child.released = True
            live.num_released += 1
            child.finish_reason = reason
            child.stop_reason = None
            child.error = message
            try:
                child.detok.finish()
            except Exception:  # a broken tokenizer must not stop the failing
                logger.exception("flushing the text of %s failed", child.key)
            self.keys.pop(child.key, None)
            self._parent_of.pop(child.key, None)
            self._transition(live, child, status)
        self._finalize(live, None, now, error=EngineDeadError(message))


def _request_output(
    live: LiveRequest,
    outputs: list[CompletionOutput],
    finished: bool,
    prompt_logprobs: list[PositionLogprobs | None] | None,
    error: str | None = None,
) -> RequestOutput:
    """A RequestOutput of ``live`` with its current status and metrics."""
    return RequestOutput(
        request_id=live.request_id,
        prompt=live.prompt,
        prompt_token_ids=live.prompt_token_ids,
        outputs=outputs,
        finished=finished,
        status=live.status,
        metrics=live.metrics,
        prompt_logprobs=prompt_logprobs,
        num_cached_tokens=live.num_cached_tokens,
        error=error,
    )
