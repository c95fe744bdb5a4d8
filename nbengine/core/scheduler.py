"""Continuous batching with chunked prefill and recompute preemption (vLLM v1 style).

Each step the scheduler hands out a token budget (``max_num_batched_tokens``):
running requests first, in admission order, each asking for all its not yet
computed tokens (1 for a decode, the rest of the prompt for a chunked prefill),
then waiting requests in policy order while ``max_num_seqs`` allows. When the KV
pool cannot give a running request its blocks, a victim is preempted (its blocks
are freed and it is recomputed later): FCFS takes the most recently admitted
running request, the priority policy the one with the largest ``(priority, arrival)``.

After the runner has computed the step, ``update_from_output`` advances every
scheduled request, appends sampled tokens, applies vLLM's stop checks and frees
finished requests. Every removal (finish, abort, ignore, error) is queued once for
the next ``EngineCoreOutputs`` (see ``take_removals``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from nbengine.config import EngineConfig
from nbengine.core.kv_cache import KVCacheManager
from nbengine.core.messages import EngineCoreOutput, StatusEvent
from nbengine.core.request import Request
from nbengine.core.scheduler_output import (
    ModelRunnerOutput,
    SampledToken,
    ScheduledChunk,
    SchedulerOutput,
)
from nbengine.core.spec_decode import DraftPolicy, DraftProposer, NgramProposer, may_speculate
from nbengine.outputs import PositionLogprobs
from nbengine.request import RequestStatus

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Removals:
    """Removals (and events) accumulated since the last batch was collected."""

    outputs: list[EngineCoreOutput] = field(default_factory=list)
    finished: set[str] = field(default_factory=set)
    events: list[StatusEvent] = field(default_factory=list)


class Scheduler:
    """Owns the waiting and running queues and the KV cache manager."""

    def __init__(
        self,
        config: EngineConfig,
        num_kv_blocks: int,
        block_size: int,
        max_model_len: int,
        sliding_window: int | None = None,
    ) -> None:
        """``sliding_window``: set when every attention layer of the model is windowed (the
        largest window); blocks that fall out of it are freed (core/kv_cache.py)."""
        self.config = config
        sc = config.scheduler
        self.policy = sc.policy
        self.max_num_seqs = sc.max_num_seqs
        self.max_num_batched_tokens = sc.max_num_batched_tokens
        self.enable_chunked_prefill = sc.enable_chunked_prefill
        # The most distinct LoRA adapters among running requests (docs/lora.md).
        self.max_loras = config.lora.max_loras
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.kv = KVCacheManager(
            num_kv_blocks,
            block_size,
            enable_prefix_caching=config.cache.enable_prefix_caching,
            sliding_window=sliding_window,
        )
        # A single request can never hold more tokens than the whole pool.
        self.pool_tokens = num_kv_blocks * block_size
        self.requests: dict[str, Request] = {}  # every held request, by internal key
        self.waiting: list[Request] = []  # head = index 0 (policy order)
        self.running: list[Request] = []  # admission order; the last is the FCFS victim
        self._pending = _Removals()
        self._prompt_lp_sent: dict[str, int] = {}  # prompt-logprob positions already forwarded
        self._admit_seq: dict[str, int] = {}  # admission counter, breaks priority ties
        self._next_seq = 0
        self.step_num_preemptions = 0  # preemptions in the latest schedule()
        self.total_preemptions = 0
        # Speculative decoding (docs/speculative-decoding.md): None when off.
        spec = config.speculative
        # "draft_model": the engine core installs the runner's proposer (model/draft.py).
        self.proposer: DraftProposer | None = (
            NgramProposer(spec) if spec.method == "ngram" else None
        )
        self.step_spec_accepted = 0  # drafts accepted in the latest update_from_output()
        # How many drafts each request gets per step: the expected tokens per second.
        self.spec_policy = DraftPolicy(spec.num_speculative_tokens)
        self._spec_rows = 0  # this step's decode rows so far (drafts included)
        self._spec_tokens = 0.0  # and the tokens they are expected to make
        # Set by the engine core: the most rows a decode step keeps its arithmetic at (the
        # runner's decode plan; None: any). Drafts never take a step past it.
        self.spec_max_rows: int | None = None

    # ---- queries --------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def has_finished_requests(self) -> bool:
        """True while some removal has not yet been collected by ``take_removals``."""
        return bool(self._pending.finished)

    # ---- events and removals --------------------------------------------------------
    def _event(self, request: Request, status: RequestStatus) -> None:
        self._pending.events.append(
            StatusEvent(request.request_id, status, time.monotonic(), request.num_output_tokens)
        )

    def _set_status(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self._event(request, status)

    def take_removals(self) -> tuple[list[EngineCoreOutput], set[str], list[StatusEvent]]:
        """Hand over the removal outputs, finished keys and events gathered so far."""
        p = self._pending
        self._pending = _Removals()
        return p.outputs, p.finished, p.events

    def _remove(
        self,
        request: Request,
        status: RequestStatus,
        error: str | None = None,
        output: EngineCoreOutput | None = None,
    ) -> None:
        """Finish ``request`` with ``status``: free it and queue its one removal report."""
        rid = request.request_id
        if request in self.running:
            self.running.remove(request)
        if request in self.waiting:
            self.waiting.remove(request)
        self.requests.pop(rid, None)
        self._prompt_lp_sent.pop(rid, None)
        self._admit_seq.pop(rid, None)
        self.spec_policy.forget(rid)
        if self.proposer is not None:
            self.proposer.forget(rid)
        self._set_status(request, status)
        self.kv.free(request, forget=True)
        if output is None:
            output = EngineCoreOutput(rid, [])
        output.finish_reason = RequestStatus.get_finish_reason(status)
        output.stop_reason = request.stop_reason
        output.finished_by_grammar = request.finished_by_grammar
        output.status = status
        output.num_cached_tokens = max(request.num_cached_tokens, 0)
        output.error = error
        self._pending.outputs.append(output)
        self._pending.finished.add(rid)

    # ---- adding and removing --------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a new request (WAITING), or finish it IGNORED if it can never fit."""
        if request.request_id in self.requests:
            raise ValueError(
                f"Request id {request.request_id!r} is already held by the engine core."
            )
        self.requests[request.request_id] = request
        self._set_status(request, RequestStatus.WAITING)
        reason = self._why_never_fits(request)
        if reason is not None:
            logger.info("request %s ignored: %s", request.request_id, reason)
            self._remove(request, RequestStatus.FINISHED_IGNORED, error=reason)
            return
        self.waiting.append(request)

    def _why_never_fits(self, request: Request) -> str | None:
        n = request.num_prompt_tokens
        if n > self.max_model_len:
            return (
                f"prompt is {n} tokens long, longer than the maximum model length "
                f"max_model_len={self.max_model_len}"
            )
        need = self.kv.blocks_needed(n)
        if need > self.kv.num_blocks:
            return (
                f"prompt of {n} tokens needs {need} KV blocks but the cache has only "
                f"{self.kv.num_blocks} blocks of {self.block_size} tokens"
            )
        if not self.enable_chunked_prefill and n > self.max_num_batched_tokens:
            return (
                f"prompt of {n} tokens exceeds max_num_batched_tokens="
                f"{self.max_num_batched_tokens} and chunked prefill is disabled"
            )
        return None

    def finish_requests(
        self,
        request_ids: str | Iterable[str],
        status: RequestStatus = RequestStatus.FINISHED_ABORTED,
    ) -> int:
        """Remove held requests with a terminal ``status``; unknown keys are ignored.

        Returns how many requests were removed.
        """
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        n = 0
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None:
                continue
            self._remove(request, status)
            n += 1
        return n

    def report_rejected(self, request_id: str, error: str) -> None:
        """Report an ADD that was refused (never held) as FINISHED_ERROR."""
        self._pending.outputs.append(
            EngineCoreOutput(
                request_id,
                [],
                finish_reason=RequestStatus.get_finish_reason(RequestStatus.FINISHED_ERROR),
                status=RequestStatus.FINISHED_ERROR,
                error=error,
            )
        )
        self._pending.finished.add(request_id)

    def fail_all(self, error: str) -> None:
        """Finish every held request with FINISHED_ERROR (the core is dying)."""
        for request in list(self.requests.values()):
            self._remove(request, RequestStatus.FINISHED_ERROR, error=error)

    # ---- scheduling -----------------------------------------------------------------
    def _priority_key(self, request: Request) -> tuple[int, float, int]:
        return (request.priority, request.arrival_time, self._admit_seq.get(request.request_id, 0))

    def _preempt(self, request: Request) -> None:
        """Recompute preemption: free the blocks, forget computed tokens, wait at the head."""
        self.kv.free(request, forget=False)
        if self.proposer is not None:
            self.proposer.forget(request.request_id)  # a draft model's K/V goes too
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.step_num_preemptions += 1
        self.total_preemptions += 1
        self._set_status(request, RequestStatus.PREEMPTED)
        self.waiting.insert(0, request)

    def _pick_victim(self) -> Request:
        if self.policy == "priority":
            return max(self.running, key=self._priority_key)
        return self.running[-1]

    def schedule(self) -> SchedulerOutput:
        """Choose this step's chunks under the token budget, KV pool and ``max_num_seqs``."""
        self.step_num_preemptions = 0
        budget = self.max_num_batched_tokens
        scheduled: dict[str, int] = {}  # request key -> tokens this step (insertion = order)
        drafts: dict[str, list[int]] = {}  # request key -> its drafts (in the budget too)
        # The step's decode rows and expected tokens so far, for the draft policy: every
        # decoding request's own row counts from the start, drafts as they are granted.
        if self.proposer is not None:
            n = sum(1 for r in self.running if r.num_tokens - r.num_computed_tokens == 1)
            self._spec_rows, self._spec_tokens = n, float(n)

        # 1. Running requests: each gets all its remaining tokens (decode = 1) if it fits.
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new <= 0:
                i += 1
                continue
            proposed = self._propose(request, num_new, budget)
            if proposed and not self.kv.allocate_slots(request, num_new + len(proposed)):
                proposed = []  # no room for the drafts: a plain decode (or a preemption)
            while not self.kv.allocate_slots(request, num_new):
                victim = self._pick_victim()
                vi = self.running.index(victim)
                self.running.pop(vi)
                if victim.request_id in scheduled:
                    budget += scheduled.pop(victim.request_id)
                    budget += len(drafts.pop(victim.request_id, ()))
                self._preempt(victim)
                if victim is request:
                    break
                if vi < i:
                    i -= 1
            else:
                scheduled[request.request_id] = num_new
                budget -= num_new
                if proposed:
                    drafts[request.request_id] = proposed
                    budget -= len(proposed)
                i += 1
                continue
            # ``request`` preempted itself: nothing below it can fit either.
            break

        # 2. Waiting requests, in policy order; none if anything was preempted this step.
        if self.step_num_preemptions == 0:
            if self.policy == "priority":
                self.waiting.sort(key=lambda r: (r.priority, r.arrival_time))
            # Requests whose adapter would exceed max_loras wait, keeping their places.
            lora_skipped: list[Request] = []
            loras = {r.lora_int_id for r in self.running if r.lora_int_id}
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                request = self.waiting[0]
                lora = request.lora_int_id
                if lora and lora not in loras and len(loras) >= self.max_loras:
                    lora_skipped.append(self.waiting.pop(0))
                    continue
                hit_blocks, num_hit = self.kv.get_computed_blocks(request)
                num_new = request.num_tokens - num_hit
                if (
                    not self.enable_chunked_prefill
                    and num_new > budget
                    and num_new <= self.max_num_batched_tokens
                ):
                    break  # admitted only whole (a longer recompute is chunked anyway)
                num_new = min(num_new, budget)
                if not self.kv.allocate_slots(request, num_new, hit_blocks):
                    break
                self.waiting.pop(0)
                self.kv.record_prefix_query(request, num_hit)
                request.num_computed_tokens = num_hit
                if request.num_cached_tokens < 0:
                    request.num_cached_tokens = num_hit
                self._admit_seq[request.request_id] = self._next_seq
                self._next_seq += 1
                self.running.append(request)
                self._set_status(request, RequestStatus.RUNNING)
                scheduled[request.request_id] = num_new
                budget -= num_new
                if lora:
                    loras.add(lora)
            self.waiting[:0] = lora_skipped

        # 3. The batch: decodes first, then prefills.
        out = SchedulerOutput()
        decodes: list[ScheduledChunk] = []
        prefills: list[ScheduledChunk] = []
        for rid, num_new in scheduled.items():
            request = self.requests[rid]
            start = request.num_computed_tokens
            chunk = ScheduledChunk(
                request=request,
                start_pos=start,
                num_tokens=num_new,
                block_table=self.kv.get_block_ids(rid),
                sample=start + num_new == request.num_tokens,
                draft_token_ids=drafts.get(rid, []),
            )
            if chunk.is_prefill:
                prefills.append(chunk)
                out.num_prefill_tokens += num_new
            else:
                decodes.append(chunk)
                out.num_decode_tokens += num_new + len(chunk.draft_token_ids)
                out.num_draft_tokens += len(chunk.draft_token_ids)
        out.chunks = decodes + prefills
        return out

    def _propose(self, request: Request, num_new: int, budget: int) -> list[int]:
        """Drafts for a decoding ``request`` (none when speculation is off, for a prefill
        chunk, or where ``may_speculate`` says no), as many as the token budget, the
        model length, the pool and ``max_tokens`` leave room for: every draft may become
        an output token, and one more token follows them. Asked only when a draft's slot
        fits in the KV pool now (without preempting), so no drafting is wasted."""
        if self.proposer is None or num_new != 1:
            return []
        if (
            request.num_tokens - request.num_computed_tokens != 1
            or request.num_computed_tokens < request.num_prompt_tokens  # a prefill's end
            or not may_speculate(request)
        ):
            return []
        room = min(budget - 1, min(self.max_model_len, self.pool_tokens) - request.num_tokens - 1)
        room = min(room, self.kv.num_fitting_tokens(request) - num_new)  # free slots now
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - request.num_output_tokens - 1)
        limit = self.spec_max_rows
        if limit is not None and self._spec_rows <= limit:
            # Past the limit the step would take another path, whose rounding differs:
            # the greedy tokens would no longer be those of the plain step.
            room = min(room, limit - self._spec_rows)
        if room <= 0:
            return []
        policy = self.spec_policy
        rid = request.request_id
        k = policy.choose(rid, max(1, self._spec_rows), max(1.0, self._spec_tokens), room)
        if k <= 0:
            return []
        proposed = self.proposer.draft(rid, request.all_token_ids, k)
        self._spec_rows += len(proposed)
        self._spec_tokens += policy.expected_tokens(rid, len(proposed)) - 1.0
        return proposed

    def observe_step(self, batch: SchedulerOutput, seconds: float) -> None:
        """The draft policy's cost sample: ``batch`` (scheduled by ``schedule()``) took
        ``seconds`` from scheduling to the end of its update. Only decode-only steps
        count, keyed by their rows (drafts included)."""
        if self.proposer is not None and batch.num_prefill_tokens == 0 and batch.chunks:
            self.spec_policy.observe_step(batch.num_decode_tokens, seconds)

    # ---- after the runner -------------------------------------------------------------
    def update_from_output(
        self, batch: SchedulerOutput, result: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Advance the scheduled requests with the runner's results.

        Requests removed since ``schedule()`` (an abort that arrived mid-step) are
        skipped: their sampled token is dropped. Finished requests are freed and
        their final output goes into the pending removals.
        """
        outputs: list[EngineCoreOutput] = []
        self.step_spec_accepted = 0
        for chunk in batch.chunks:
            request = chunk.request
            rid = request.request_id
            if self.requests.get(rid) is not request or request.status != RequestStatus.RUNNING:
                continue
            if chunk.draft_token_ids:
                out = self._update_verified(chunk, result)
                if out is not None:
                    outputs.append(out)
                continue
            request.num_computed_tokens = chunk.start_pos + chunk.num_tokens
            self.kv.cache_computed_blocks(request)
            self.kv.free_outside_window(request)
            out = EngineCoreOutput(rid, [], num_cached_tokens=max(request.num_cached_tokens, 0))
            prompt_lps = result.prompt_logprobs.get(rid)
            if prompt_lps:
                out.new_prompt_logprobs = self._new_prompt_logprobs(chunk, prompt_lps)
            if chunk.sample:
                sampled = result.sampled.get(rid)
                if sampled is None:
                    raise RuntimeError(f"model runner returned no token for request {rid!r}")
                self._append_sampled(request, sampled, out)
                status = self._check_stop(request)
                if request.error is not None:  # its own logits processor failed
                    status = RequestStatus.FINISHED_ERROR
                if status is not None:
                    self._remove(request, status, error=request.error, output=out)
                    continue
            if out.new_token_ids or out.new_prompt_logprobs:
                outputs.append(out)
        return outputs

    def _update_verified(
        self, chunk: ScheduledChunk, result: ModelRunnerOutput
    ) -> EngineCoreOutput | None:
        """Advance a request whose chunk carried drafts: append the tokens verification
        kept, one at a time through the stop checks (a stop truncates there), then roll
        the KV back to the kept positions. Returns its output, or None when it finished
        (its output then went into the removals)."""
        request = chunk.request
        rid = request.request_id
        kept = result.spec_sampled.get(rid)
        if not kept:
            raise RuntimeError(f"model runner returned no verified tokens for request {rid!r}")
        out = EngineCoreOutput(rid, [], num_cached_tokens=max(request.num_cached_tokens, 0))
        status: RequestStatus | None = None
        appended = 0
        for sampled in kept:
            self._append_sampled(request, sampled, out)
            appended += 1
            status = self._check_stop(request)
            if request.error is not None:
                status = RequestStatus.FINISHED_ERROR
            if status is not None:
                break
        accepted = min(appended, len(kept) - 1)  # drafts kept (the last may be the bonus)
        out.num_spec_accepted = accepted
        self.spec_policy.record(rid, len(chunk.draft_token_ids), len(kept) - 1)
        self.step_spec_accepted += accepted
        # K/V is kept for the decoded token and the accepted drafts; the newest token has
        # none yet. The blocks beyond those positions (rejected drafts' slots) are freed,
        # and only full blocks of kept tokens reach the prefix cache.
        request.num_computed_tokens = request.num_tokens - 1
        self.kv.cache_computed_blocks(request)
        self.kv.free_beyond(request, request.num_computed_tokens)
        self.kv.free_outside_window(request)
        if status is not None:
            self._remove(request, status, error=request.error, output=out)
            return None
        return out

    @staticmethod
    def _append_sampled(request: Request, sampled: SampledToken, out: EngineCoreOutput) -> None:
        """Append one sampled token to ``request`` and its output (and feed its grammar)."""
        request.append_output_token(sampled.token_id)
        if request.grammar is not None:
            # The grammar engine failed (a step over its limits), or a logits processor
            # unmasked a token the grammar rejects: the request fails.
            failure = request.grammar.consume(sampled.token_id)
            if failure is not None:
                request.error = f"structured outputs: {failure}"
        out.new_token_ids.append(sampled.token_id)
        if sampled.logprobs is not None:
            if out.new_logprobs is None:
                out.new_logprobs = []
            out.new_logprobs.append(sampled.logprobs)

    def _new_prompt_logprobs(
        self, chunk: ScheduledChunk, lps: list[PositionLogprobs | None]
    ) -> list[PositionLogprobs | None] | None:
        """The runner's prompt logprobs for positions not forwarded before (once each)."""
        request = chunk.request
        # The list ends at the last prompt position whose predecessor was computed here.
        last = min(chunk.start_pos + chunk.num_tokens, request.num_prompt_tokens - 1)
        first = last - len(lps) + 1
        sent = self._prompt_lp_sent.get(request.request_id, 0)
        if last < sent:
            return None
        new = lps[max(0, sent - first) :]
        self._prompt_lp_sent[request.request_id] = last + 1
        return new or None

    def _check_stop(self, request: Request) -> RequestStatus | None:
        """vLLM's stop order: min_tokens gate, EOS, stop_token_ids, then length."""
        params = request.sampling_params
        last = request.output_token_ids[-1]
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and last in request.eos_token_ids:
                request.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if params.stop_token_ids and last in params.stop_token_ids:
                request.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if request.grammar is not None and request.grammar.is_terminated():
            # Structured outputs: the grammar has matched and allows nothing more.
            request.stop_reason = None
            request.finished_by_grammar = True
            return RequestStatus.FINISHED_STOPPED
        if request.num_tokens >= min(self.max_model_len, self.pool_tokens):
            return RequestStatus.FINISHED_LENGTH_CAPPED
        if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None
