"""The engine core: requests in, one schedule -> execute -> update step at a time.

``EngineCore`` is driven either directly (``add_request`` / ``abort_requests`` /
``step``, as the tests do) or by ``run_busy_loop`` on the ``nbengine-core`` thread,
which reads the frontend's FIFO queue of ``EngineCoreMessage`` and emits one
``EngineCoreOutputs`` batch per step and per processed input that removed requests.

Protocol invariant: every request the core removes (finished, aborted, ignored,
errored) is reported in exactly one batch's ``finished`` set, and no output for
that key follows.
"""

from __future__ import annotations

import logging
import queue
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future, InvalidStateError
from typing import Any, Protocol, cast

import torch

from nbengine.config import EngineConfig
from nbengine.core.messages import (
    EngineCoreMessage,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    MessageType,
    StepStats,
)
from nbengine.core.request import Request
from nbengine.core.scheduler import Scheduler
from nbengine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from nbengine.lora.layers import LoRALayers
from nbengine.request import FinishReason, RequestStatus
from nbengine.sampling_params import SamplingParams
from nbengine.structured_outputs import GrammarCompiler
from nbengine.validation import is_int

logger = logging.getLogger(__name__)


class RunnerLike(Protocol):
    """What the core needs from a model runner (``nbengine.model.runner.ModelRunner``)."""

    num_kv_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: frozenset[int]

    def execute(self, batch: SchedulerOutput) -> ModelRunnerOutput: ...

    def shutdown(self) -> None: ...


def _runner_loras(runner: RunnerLike) -> LoRALayers | None:
    """The runner's LoRA adapters (a runner built with ``enable_lora``; docs/lora.md)."""
    layers = getattr(runner, "lora", None)
    return layers if isinstance(layers, LoRALayers) else None


RunnerClass = Callable[[EngineConfig], RunnerLike]
"""A runner class (e.g. ``nbengine.model.runner.ModelRunner``), built with the config."""


class EngineCore:
    """Scheduler + KV cache + model runner, stepped one batch at a time.

    Not thread-safe: every method is called from one thread at a time (the
    ``nbengine-core`` thread once ``run_busy_loop`` runs; other threads talk to it
    only through the input queue).
    """

    def __init__(self, config: EngineConfig, runner: RunnerLike | RunnerClass) -> None:
        # The runner is injected from above, as vLLM's EngineCore takes its executor
        # class: the model package builds on the core, never the other way round
        # (docs/architecture.md, "Layers").
        built = runner(config) if isinstance(runner, type) else runner
        self.config = config
        self.runner: RunnerLike = cast(RunnerLike, built)
        max_model_len = self.runner.max_model_len
        if config.model.max_model_len is not None:
            max_model_len = min(max_model_len, config.model.max_model_len)
        self.max_model_len = max_model_len
        # Runners of models whose every layer is windowed name the window (model/runner.py).
        window = getattr(self.runner, "kv_sliding_window", None)
        self.scheduler = Scheduler(
            config,
            self.runner.num_kv_blocks,
            self.runner.block_size,
            max_model_len,
            sliding_window=window,
        )
        # The most rows a decode step may have and keep its arithmetic (model/runner.py):
        # drafts never push a step past it (docs/speculative-decoding.md, "Exactness").
        self.scheduler.spec_max_rows = getattr(self.runner, "decode_plan_max_rows", None)
        if config.speculative.method == "draft_model":
            # The draft model is the runner's (it loads models); the core only asks it.
            draft = getattr(self.runner, "draft_proposer", None)
            assert draft is not None, "a draft_model config needs a runner with a draft model"
            self.scheduler.proposer = draft
        self.step_count = 0
        self._pending_msgs: deque[EngineCoreMessage] = deque()
        self._mid_step_queue: queue.Queue[EngineCoreMessage] | None = None
        self._closed = False
        self._grammars: GrammarCompiler | None = None

    # ---- requests -------------------------------------------------------------------
    def add_request(self, request: EngineCoreRequest) -> None:
        """Hold a new request (WAITING), or finish it IGNORED if it can never fit.

        Raises TypeError for a non-str id and ValueError for a key already held or an
        invalid prompt; nothing is held in that case.
        """
        rid = request.request_id
        if not isinstance(rid, str):
            raise TypeError(f"request_id must be a string, got {type(rid).__name__} {rid!r}.")
        if rid in self.scheduler.requests:
            raise ValueError(f"Request id {rid!r} is already held by the engine core.")
        prompt = list(request.prompt_token_ids)
        if not prompt:
            raise ValueError(f"Request {rid!r} has an empty prompt; at least one token is needed.")
        vocab = self.runner.vocab_size
        for t in prompt:
            if not is_int(t) or not 0 <= t < vocab:
                raise ValueError(
                    f"Request {rid!r}: prompt token id {t!r} is out of range for the "
                    f"model's vocabulary of {vocab} tokens."
                )
        params = request.sampling_params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"Request {rid!r}: sampling_params must be a SamplingParams.")
        # Validated again here (every field, on a copy of our own): a request must never
        # reach the sampler with values it cannot handle, whatever happened to it on the
        # way. A bad request is refused as FINISHED_ERROR; the core lives on.
        params = params.clone()
        if params.n != 1:
            raise ValueError(f"Request {rid!r}: the engine core takes n=1 (got n={params.n}).")
        for k in (params.logprobs, params.prompt_logprobs):
            if k is not None and k > vocab:
                raise ValueError(
                    f"Request {rid!r}: {k} log-probabilities asked for, but the model's "
                    f"vocabulary has {vocab} tokens."
                )
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise ValueError(
                f"Request {rid!r}: logit_bias names token ids outside the model's vocabulary "
                f"of {vocab} tokens."
            )
        for name in ("allowed_token_ids", "bad_words_token_ids"):
            ids = getattr(params, name) or []
            flat = [t for x in ids for t in (x if isinstance(x, list) else [x])]
            if flat and max(flat) >= vocab:
                raise ValueError(
                    f"Request {rid!r}: {name} names token ids outside the model's "
                    f"vocabulary of {vocab} tokens."
                )
        if request.lora_int_id:
            layers = _runner_loras(self.runner)
            if layers is None or request.lora_int_id not in layers.adapters:
                raise ValueError(
                    f"Request {rid!r}: LoRA adapter id {request.lora_int_id} is not loaded "
                    "(it was removed, or the engine has enable_lora=False)."
                )
        generator = None
        if params.seed is not None:
            generator = torch.Generator().manual_seed(params.seed)
        eos = request.eos_token_ids or self.runner.eos_token_ids
        grammar = request.grammar
        if params.structured_outputs is not None and grammar is None:
            grammar = self._grammar_compiler(eos).matcher(params.structured_outputs)
        req = Request(
            request_id=rid,
            prompt_token_ids=prompt,
            sampling_params=params,
            eos_token_ids=frozenset(eos),
            arrival_time=request.arrival_time,
            priority=request.priority,
            generator=generator,
            grammar=grammar if params.structured_outputs is not None else None,
            cache_salt=request.cache_salt,
            lora_int_id=request.lora_int_id,
            lora_key=request.lora_key,
        )
        self.scheduler.add_request(req)

    # ---- LoRA adapters (docs/lora.md) --------------------------------------------------
    def lora_layers(self) -> LoRALayers:
        """The runner's adapters; ValueError if the engine was built without enable_lora."""
        layers = _runner_loras(self.runner)
        if layers is None:
            raise ValueError("This engine has no LoRA support: create it with enable_lora=True.")
        return layers

    def lora_users(self, lora_int_id: int) -> list[str]:
        """Keys of the held (waiting, running or preempted) requests under that adapter."""
        return [k for k, r in self.scheduler.requests.items() if r.lora_int_id == lora_int_id]

    def reset_prefix_cache(self) -> bool:
        """Forget every prefix-cache entry; False (nothing forgotten) while any request
        holds KV blocks, as vLLM."""
        return self.scheduler.kv.pool.reset_prefix_cache()

    def _grammar_compiler(self, eos: Iterable[int]) -> GrammarCompiler:
        """A core-side compiler, for requests that arrive without a matcher (a backend
        that pickled the request); the in-process frontend always sends one."""
        if self._grammars is None:
            tokenizer = getattr(self.runner, "tokenizer", None)
            if tokenizer is None:
                raise ValueError("structured_outputs: this model runner has no tokenizer.")
            self._grammars = GrammarCompiler(tokenizer, self.runner.vocab_size, list(eos))
        return self._grammars

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Remove held requests as FINISHED_ABORTED; unknown or finished keys are a no-op."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        self.scheduler.finish_requests(list(request_ids), RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_requests()

    # ---- stepping -------------------------------------------------------------------
    def step(self) -> EngineCoreOutputs:
        """One schedule -> execute -> update step.

        The batch also carries every removal since the previous batch (aborts,
        ignored prompts) in ``finished``. With nothing to run it returns just those.
        """
        start = time.monotonic()
        sched = self.scheduler
        batch = sched.schedule()
        outputs: list[EngineCoreOutput] = []
        if not batch.is_empty:
            result = self.runner.execute(batch)
            # Inputs that arrived while the model ran (an abort of a request in this
            # batch wins over its final token) are applied before the update.
            self._process_mid_step()
            outputs = sched.update_from_output(batch, result)
            sched.observe_step(batch, time.monotonic() - start)  # the draft policy's costs
        self.step_count += 1
        removed_outputs, finished, events = sched.take_removals()
        kv = sched.kv
        stats = StepStats(
            step=self.step_count,
            start_time=start,
            duration_s=time.monotonic() - start,
            num_requests=len(batch.chunks),
            num_prefill_tokens=batch.num_prefill_tokens,
            num_decode_tokens=batch.num_decode_tokens,
            num_running=sched.num_running,
            num_waiting=sched.num_waiting,
            kv_blocks_used=kv.num_used_blocks,
            kv_blocks_total=kv.num_blocks,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=sched.step_num_preemptions,
            spec_draft_tokens=batch.num_draft_tokens,
            spec_accepted_tokens=sched.step_spec_accepted if not batch.is_empty else 0,
        )
        return EngineCoreOutputs(
            outputs=outputs + removed_outputs, finished=finished, events=events, step=stats
        )

    def collect_removals(self) -> EngineCoreOutputs | None:
        """The removals (and events) since the last batch, or None if there are none."""
        if not self.scheduler.has_finished_requests():
            return None
        outputs, finished, events = self.scheduler.take_removals()
        return EngineCoreOutputs(outputs=outputs, finished=finished, events=events)

    # ---- the busy loop ----------------------------------------------------------------
    def run_busy_loop(
        self,
        input_queue: queue.Queue[EngineCoreMessage],
        emit: Callable[[EngineCoreOutputs], None],
    ) -> None:
        """Body of the ``nbengine-core`` thread; returns on SHUTDOWN or when the core dies.

        Idle: blocks on the queue. Busy: drains the queue (FIFO) between steps, emits
        removals at once, then emits one batch per step. An exception in a step emits
        one final batch with ``engine_error`` failing every held request, then returns.
        """
        self._mid_step_queue = input_queue
        try:
            while True:
                if not self.has_unfinished_requests() and not self._pending_msgs:
                    self._pending_msgs.append(input_queue.get())
                self._drain(input_queue)
                stop = self._process_pending(stop_at_utility=False)
                removals = self.collect_removals()
                if removals is not None:
                    emit(removals)
                if stop:
                    return
                if self.has_unfinished_requests():
                    emit(self.step())
        except Exception as exc:  # the core is dead: fail everything it holds
            logger.exception("engine core step failed")
            self._die(exc, emit)
        finally:
            self._mid_step_queue = None

    def _die(self, exc: BaseException, emit: Callable[[EngineCoreOutputs], None]) -> None:
        message = f"{type(exc).__name__}: {exc}"
        self.scheduler.fail_all(message)
        outputs, finished, events = self.scheduler.take_removals()
        for out in outputs:
            out.finish_reason = FinishReason.ERROR
            out.status = RequestStatus.FINISHED_ERROR
        try:
            emit(
                EngineCoreOutputs(
                    outputs=outputs, finished=finished, events=events, engine_error=message
                )
            )
        except Exception:
            logger.exception("could not report the engine core failure")

    def _drain(self, input_queue: queue.Queue[EngineCoreMessage]) -> None:
        while True:
            try:
                self._pending_msgs.append(input_queue.get_nowait())
            except queue.Empty:
                return

    def _process_mid_step(self) -> None:
        """Apply queued ADD/ABORT messages between execute and update (busy loop only)."""
        if self._mid_step_queue is None:
            return
        self._drain(self._mid_step_queue)
        self._process_pending(stop_at_utility=True)

    def _process_pending(self, stop_at_utility: bool) -> bool:
        """Handle queued messages in FIFO order; True if SHUTDOWN was reached.

        With ``stop_at_utility`` (mid-step) only ADD/ABORT are handled and processing
        stops at the first UTILITY or SHUTDOWN, which stays queued for after the step.
        """
        while self._pending_msgs:
            msg = self._pending_msgs[0]
            if stop_at_utility and msg.type in (MessageType.UTILITY, MessageType.SHUTDOWN):
                return False
            self._pending_msgs.popleft()
            if msg.type == MessageType.SHUTDOWN:
                return True
            if msg.type == MessageType.ADD:
                self._handle_add(msg.payload)
            elif msg.type == MessageType.ABORT:
                ids = msg.payload
                self.abort_requests([ids] if isinstance(ids, str) else list(ids or ()))
            elif msg.type == MessageType.UTILITY:
                self._handle_utility(msg)
            else:
                logger.error("unknown engine core message %r", msg)
        return False

    def _handle_add(self, request: EngineCoreRequest) -> None:
        try:
            self.add_request(request)
        except Exception as exc:  # one bad request fails alone, never the core
            key = getattr(request, "request_id", None)
            key = key if isinstance(key, str) else str(key)
            logger.warning("rejected request %s: %s", key, exc)
            self.scheduler.report_rejected(key, str(exc))

    def _handle_utility(self, msg: EngineCoreMessage) -> None:
        fut: Future[Any] | None = msg.future
        try:
            result = msg.payload(self)
        except Exception as exc:
            if fut is not None:
                try:
                    fut.set_exception(exc)
                except InvalidStateError:
                    pass
            else:
                logger.exception("utility call failed")
            return
        if fut is not None:
            try:
                fut.set_result(result)
            except InvalidStateError:
                pass

    def shutdown(self) -> None:
        """Release the model and KV tensors; idempotent."""
        if self._closed:
            return
        self._closed = True
        self.runner.shutdown()
