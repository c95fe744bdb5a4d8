"""``Engine``: the in-process LLM engine (docs/architecture.md: threads, queues, the step loop).

Threads:

- the caller's thread(s): ``generate()`` validates there (``InputProcessor``), then
  registers the request on the loop with one short ``portal.call``;
- ``nbengine-loop``: an anyio blocking portal (asyncio backend) that owns all frontend
  state (the ``OutputProcessor`` registry, event hooks). Only this thread mutates it and
  only this thread puts ADD/ABORT messages on the core queue, so the queue order always
  matches the registry;
- ``nbengine-core``: ``EngineCore.run_busy_loop``. Its ``emit`` hands each batch to the
  loop with ``loop.call_soon_threadsafe`` and never blocks.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import itertools
import logging
import queue
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import anyio.from_thread

from nbengine.config import EngineConfig
from nbengine.core.client import CoreClient, make_core_client
from nbengine.core.messages import (
    EngineCoreMessage,
    EngineCoreOutputs,
    EngineCoreRequest,
    MessageType,
    StepStats,
)
from nbengine.dashboard.monitor import EngineMonitor
from nbengine.frontend.detokenizer import IncrementalDetokenizer
from nbengine.frontend.events import LifecycleEvent
from nbengine.frontend.handles import RequestHandle
from nbengine.frontend.waiter import make_async_waiter
from nbengine.frontend.input_processor import InputProcessor, PreparedRequest
from nbengine.frontend.output_processor import ChildState, LiveRequest, OutputProcessor
from nbengine.outputs import RequestMetrics, RequestOutput
from nbengine.request import EngineDeadError, FinishReason, RequestIdInUseError
from nbengine.sampling_params import SEED_MAX, SamplingParams

if TYPE_CHECKING:
    import pandas as pd
    import plotly.graph_objects as go

    from nbengine.core.engine_core import EngineCore, RunnerLike
    from nbengine.dashboard.dashboard import Dashboard

__all__ = ["Engine"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

_WAKE_S = 0.1
_CORE_DEATH_GRACE_S = 2.0  # a dead core thread whose failure the loop has not delivered
_SHUTDOWN_GRACE_S = 5.0  # a second shutdown() waits this much longer than the first may take

_live_engines: weakref.WeakSet[Engine] = weakref.WeakSet()


def _shutdown_all_engines() -> None:
    for engine in list(_live_engines):
        try:
            engine.shutdown(timeout=5.0)
        except Exception:
            logger.exception("engine shutdown at exit failed")


atexit.register(_shutdown_all_engines)


def _client_callbacks(
    engine_ref: weakref.ref[Engine],
) -> tuple[Callable[[EngineCoreOutputs], None], Callable[[str | None], None],
           Callable[[set[str], str], None], Callable[[str, int], None]]:
    """``emit``, ``on_exit``, ``fail_keys`` and ``on_routed`` for the core client.

    They hold the Engine only weakly: an engine that nobody references any more (its
    notebook cell was re-executed) can be garbage-collected, and its finalizer
    (``_reap_engine``) then stops the client's threads and frees the model.
    """

    def emit(outputs: EngineCoreOutputs) -> None:
        engine = engine_ref()
        if engine is not None:
            engine._emit(outputs)

    def on_exit(error: str | None) -> None:
        engine = engine_ref()
        if engine is not None:
            engine._call_soon(engine._on_core_exit, error)

    def fail(keys: set[str], message: str) -> None:
        engine = engine_ref()
        if engine is not None:
            engine._call_soon(engine._fail_keys, keys, message)

    def routed(key: str, replica: int) -> None:  # called on the loop thread
        engine = engine_ref()
        if engine is not None:
            engine._on_routed(key, replica)

    return emit, on_exit, fail, routed


def _reap_engine(client: CoreClient, exit_stack: contextlib.ExitStack) -> None:
    """Finalizer of an Engine garbage-collected without ``shutdown()``.

    The GC may run it on any thread, the engine's own included, so the blocking part
    (stop the core client, free the model, stop the loop) runs on a short-lived thread.
    """

    def reap() -> None:
        try:
            client.shutdown(10.0)
            exit_stack.close()
        except Exception:
            logger.exception("reaping an unreferenced engine failed")

    threading.Thread(target=reap, name="nbengine-reaper", daemon=True).start()


def _child_seed(seed: int, index: int) -> int:
    """The seed of completion ``index`` of an n>1 request: ``seed + index`` in 64 bits."""
    child = seed + index
    return child if child <= SEED_MAX else child - 2**64


def _boxed(fn: Callable[..., T], *args: Any) -> tuple[T]:
    return (fn(*args),)


class Engine:
    """An LLM engine running on background threads of this process.

    ``Engine(model=None, **kwargs)``: ``model`` is a Hugging Face-format directory (None:
    the shipped default model); keyword arguments are ``EngineConfig`` fields
    (``dtype``, ``quantization``, ``max_model_len``, ``seed``, ``block_size``, ``num_kv_blocks``,
    ``enable_prefix_caching``, ``kv_cache_memory_gb``, ``max_num_seqs``,
    ``max_num_batched_tokens``, ``policy``, ``enable_chunked_prefill``,
    ``stream_interval``). ``generate()`` returns a ``RequestHandle`` at once and is safe
    to call from any thread or event loop. Use ``with Engine(...) as engine:`` or call
    ``shutdown()``.

    ``backend="inproc"`` (default) runs the core on a thread of this process;
    ``backend="ray"`` runs ``data_parallel_size`` cores as Ray actors (keywords
    ``data_parallel_size``, ``ray_address``, ``resources_per_replica``, ``routing``;
    see docs/scale-out.md) while the frontend stays here.
    """

    def __init__(self, model: str | Path | None = None, **kwargs: Any) -> None:
        runner: RunnerLike | None = kwargs.pop("_runner", None)  # test hook
        tokenizer = kwargs.pop("_tokenizer", None)  # test hook
        backend = kwargs.pop("backend", "inproc")
        backend_options: dict[str, Any] = {
            k: kwargs.pop(k)
            for k in ("data_parallel_size", "ray_address", "resources_per_replica", "routing")
            if k in kwargs
        }
        self.config = EngineConfig.from_kwargs(model, **kwargs)

        from nbengine.model.generation_defaults import default_sampling_params
        from nbengine.model.loader import resolve_model_dir

        # The model directory (None only for a test's injected tokenizer and default model).
        model_dir: Path | None = None
        if tokenizer is None or model is not None:
            model_dir = resolve_model_dir(model, self.config.model.revision)
        if tokenizer is None:
            from nbengine.model.tokenizer import Tokenizer

            assert model_dir is not None
            tokenizer = Tokenizer.from_dir(model_dir)
        self.tokenizer = tokenizer
        self._model_dir = model_dir
        if self.config.model.dtype == "auto" and model_dir is not None:
            # Resolved once, here, so the config (and every replica) names the real dtype.
            from nbengine.model.loader import auto_dtype, read_hf_config

            self.config.model.dtype = auto_dtype(read_hf_config(model_dir))
        self.backend = backend
        self._client: CoreClient = make_core_client(backend, self.config, runner, backend_options)
        if backend == "inproc":  # in-process internals that tests reach into
            self._core: EngineCore = self._client.core  # type: ignore[attr-defined]
            self._core_queue: queue.Queue[EngineCoreMessage] = self._client.queue  # type: ignore[attr-defined]
        self._vocab_size = int(self._client.vocab_size)
        self._max_model_len = int(self._client.max_model_len)
        self._inputs = InputProcessor(tokenizer, self._vocab_size, self._max_model_len,
                                      default_sampling_params(model_dir))
        self._eos_token_ids = frozenset(self._client.eos_token_ids) | frozenset(
            getattr(tokenizer, "eos_token_ids", ())
        )
        self._stream_interval = self.config.scheduler.stream_interval

        # Metrics log and widgets; fed by the hooks below, on the loop thread.
        self._monitor = EngineMonitor(self)
        self._dead: str | None = None  # why the engine can no longer serve (loop thread writes)
        self._closed = False
        self._shutdown_lock = threading.Lock()
        self._shutdown_done = threading.Event()
        self._incarnations = itertools.count(1)
        self._auto_ids = itertools.count()
        # The processor reaches the engine through a weak reference, so that dropping
        # the last user reference frees the engine at once (no reference cycle).
        ref = weakref.ref(self)
        self._processor = OutputProcessor(
            tokenizer,
            send_abort=lambda keys: ref()._send_abort(keys),  # type: ignore[union-attr]
            on_event=lambda ev: ref()._on_event(ev),  # type: ignore[union-attr]
            on_step=lambda st: ref()._on_step(st),  # type: ignore[union-attr]
            on_request=lambda *a: ref()._on_request(*a),  # type: ignore[union-attr]
            on_tokens=lambda *a: ref()._on_tokens(*a),  # type: ignore[union-attr]
        )

        self._exit_stack = contextlib.ExitStack()
        try:
            self._portal = self._exit_stack.enter_context(
                anyio.from_thread.start_blocking_portal("asyncio", name="nbengine-loop")
            )
            self._loop: asyncio.AbstractEventLoop = self._portal.call(asyncio.get_running_loop)
            self._loop_thread: threading.Thread = self._portal.call(threading.current_thread)
        except BaseException:
            self._exit_stack.close()
            self._client.shutdown(10.0)
            raise
        self._core_dead_since: float | None = None
        self._client.start(*_client_callbacks(weakref.ref(self)))
        if backend == "inproc":
            self._core_thread: threading.Thread = self._client.thread  # type: ignore[attr-defined]
        _live_engines.add(self)
        # Unreferenced without shutdown() (a re-executed cell): stop the threads anyway.
        self._finalizer = weakref.finalize(self, _reap_engine, self._client, self._exit_stack)
        self._finalizer.atexit = False  # at exit, _shutdown_all_engines does it

    # ------------------------------------------------------------- event hooks

    def _on_event(self, ev: LifecycleEvent) -> None:
        """Called on the loop thread for every lifecycle transition."""
        self._monitor.on_event(ev)

    def _on_step(self, stats: StepStats) -> None:
        """Called on the loop thread for every engine step."""
        self._monitor.on_step(stats)

    def _on_request(
        self, key: str, request_id: str, num_prompt_tokens: int, arrival_time: float
    ) -> None:
        """Called on the loop thread when an incarnation (each n>1 child) is registered."""
        self._monitor.on_request(key, request_id, num_prompt_tokens, arrival_time)

    def _on_routed(self, key: str, replica: int) -> None:
        """Called on the loop thread when a multi-replica backend places ``key``."""
        monitor = getattr(self, "_monitor", None)
        if monitor is not None:
            monitor.metrics.on_replica(key, replica)

    def _on_tokens(
        self, key: str, num_output_tokens: int, now: float, num_cached_tokens: int | None
    ) -> None:
        """Called on the loop thread when ``key`` has new tokens (cumulative count)."""
        self._monitor.on_tokens(key, num_output_tokens, now, num_cached_tokens)

    # ------------------------------------------------------------ core thread

    def _emit(self, outputs: EngineCoreOutputs) -> None:
        """Core thread: hand a batch to the loop without blocking."""
        self._call_soon(self._process_outputs, outputs)

    def _call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed (shutdown)
            logger.debug("engine loop closed; dropped %s", getattr(fn, "__name__", fn))

    # -------------------------------------------------------------- loop thread

    def _process_outputs(self, outputs: EngineCoreOutputs) -> None:
        try:
            if outputs.engine_error is not None:
                self._dead = f"The engine core failed: {outputs.engine_error}"
            self._processor.process(outputs)
        except Exception as exc:
            logger.exception("output processing failed")
            self._die(f"Output processing failed: {type(exc).__name__}: {exc}")

    def _on_core_exit(self, error: str | None) -> None:
        if self._closed and error is None:
            return
        self._die(f"The engine core stopped: {error or 'its loop exited'}")

    def _die(self, message: str) -> None:
        if self._dead is None:
            self._dead = message
        try:
            self._processor.fail_all(self._dead)
        finally:  # the core must stop even if failing the requests went wrong
            self._client.send(EngineCoreMessage(MessageType.SHUTDOWN))

    def _fail_keys(self, keys: set[str], message: str) -> None:
        """Loop thread: one replica is lost; fail only the requests it held."""
        try:
            self._processor.fail_requests(keys, message)
        except Exception as exc:
            logger.exception("failing the requests of a lost replica failed")
            self._die(f"Output processing failed: {type(exc).__name__}: {exc}")

    def _send_abort(self, keys: list[str]) -> None:
        self._client.send(EngineCoreMessage(MessageType.ABORT, list(keys)))

    def _submit(self, prep: PreparedRequest) -> RequestHandle:
        """Register ``prep`` on the loop and return its handle, atomically for the caller.

        A ``KeyboardInterrupt`` (or any exception) that reaches the caller while it waits
        for the loop leaves nothing behind: if the request got registered, it is aborted
        and the core's confirmation awaited before the exception propagates, so its id is
        free again (docs/lifecycle.md, "Interrupts"). Interrupts that arrive during that
        clean-up are held back and the first one is re-raised after it.
        """
        try:
            return self._call_on_loop(self._register, prep)
        except BaseException:
            if threading.current_thread() is self._loop_thread:
                raise
            self._withdraw(prep)
            raise

    def _withdraw(self, prep: PreparedRequest) -> None:
        """Undo a registration whose caller was interrupted (see ``_submit``)."""
        deferred: BaseException | None = None
        fut: Future[RequestOutput] | None = None
        asked = False
        while True:
            try:
                if not asked:
                    # Runs on the loop after the registration call (the portal is FIFO);
                    # idempotent, so an interrupt before `asked` is set just repeats it.
                    fut = self._call_on_loop(self._withdraw_on_loop, prep)
                    asked = True
                if fut is not None:
                    self._wait_future(fut, None, f"withdrawal of {prep.request_id!r}")
                break
            except (KeyboardInterrupt, SystemExit) as exc:
                deferred = deferred or exc  # finish the clean-up first
            except Exception:  # the engine died: nothing is left registered
                logger.debug("withdrawing an interrupted request failed", exc_info=True)
                break
        if deferred is not None:
            raise deferred

    def _withdraw_on_loop(self, prep: PreparedRequest) -> Future[RequestOutput] | None:
        prep.withdrawn = True
        handle = prep.handle
        if handle is None:
            return None
        live = handle._live
        if live is None or live.finalized:
            return None
        return self._processor.request_abort(live)

    def _register(self, prep: PreparedRequest) -> RequestHandle:
        if prep.withdrawn:
            raise RuntimeError("the caller was interrupted before the request was registered")
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        requests = self._processor.requests
        request_id = prep.request_id
        if request_id is None:
            request_id = str(next(self._auto_ids))
            while request_id in requests:
                request_id = str(next(self._auto_ids))
        else:
            live = requests.get(request_id)
            if live is not None:
                raise RequestIdInUseError(request_id, live.status)
        incarnation = next(self._incarnations)
        params = prep.params
        handle = RequestHandle(
            self, request_id, params, prep.prompt, prep.prompt_token_ids, prep.arrival
        )
        n = params.n
        children: list[ChildState] = []
        child_params: list[SamplingParams] = []
        for i in range(n):
            if n == 1:
                key, cp = f"{request_id}#{incarnation}", params
            else:
                key = f"{request_id}#{incarnation}.{i}"
                cp = params.replace(
                    n=1,
                    # Completion i draws from seed + i (wrapped into 64 bits).
                    seed=None if params.seed is None else _child_seed(params.seed, i),
                    # One copy of the prompt's logprobs: completion 0 computes them.
                    prompt_logprobs=params.prompt_logprobs if i == 0 else None,
                )
            child_params.append(cp)
            children.append(
                ChildState(key=key, index=i, params=cp,
                           detok=IncrementalDetokenizer(self.tokenizer, cp, prep.prompt_token_ids))
            )
        live = LiveRequest(
            request_id=request_id,
            incarnation=incarnation,
            handle=handle,
            params=params,
            prompt=prep.prompt,
            prompt_token_ids=prep.prompt_token_ids,
            children=children,
            metrics=RequestMetrics(arrival_time=prep.arrival),
            stream_interval=max(self._stream_interval, params.stream_interval),
        )
        self._processor.add(live)
        prep.handle = handle
        for child, cp in zip(children, child_params):
            self._client.send(
                EngineCoreMessage(
                    MessageType.ADD,
                    EngineCoreRequest(
                        request_id=child.key,
                        prompt_token_ids=list(prep.prompt_token_ids),
                        sampling_params=cp,
                        arrival_time=prep.arrival,
                        priority=prep.priority,
                        eos_token_ids=self._eos_token_ids,
                    ),
                )
            )
        return handle

    def _run_on_core(self, fn: Callable[[EngineCore], T]) -> Future[T]:
        """Run ``fn(core)`` on the core thread between steps (a UTILITY message).

        With ``backend="ray"`` it runs in replica 0's actor (``fn`` must pickle).
        """
        return self._client.run_utility(fn)

    def _start_aborts(self, request_ids: list[str]) -> list[Future[RequestOutput] | None]:
        futures: list[Future[RequestOutput] | None] = []
        for rid in request_ids:
            live = self._processor.requests.get(rid)
            futures.append(None if live is None else self._processor.request_abort(live))
        return futures

    def _start_abort_handle(self, handle: RequestHandle) -> Future[RequestOutput] | None:
        live = handle._live
        if live is None or live.finalized:
            return None
        return self._processor.request_abort(live)

    # ----------------------------------------------------------- thread helpers

    def _on_engine_thread(self) -> bool:
        t = threading.current_thread()
        return t is self._loop_thread or self._client.owns_thread(t)

    def _call_on_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a short sync function on the loop thread and return its result."""
        if threading.current_thread() is self._loop_thread:
            return fn(*args)
        if self._closed:
            raise EngineDeadError(self._dead or "The engine has been shut down.")
        try:
            # Boxed: the portal would await an awaitable result (a RequestHandle is one).
            return self._portal.call(_boxed, fn, *args)[0]
        except RuntimeError as exc:
            if not self._loop_thread.is_alive() or self._closed:
                raise EngineDeadError(self._dead or "The engine has been shut down.") from exc
            raise

    def _check_waiter_alive(self) -> None:
        """Raise EngineDeadError if nothing will ever wake a waiter (threads gone)."""
        if not self._loop_thread.is_alive():
            raise EngineDeadError(self._dead or "The engine loop thread is gone.")
        if self._client.is_alive():
            self._core_dead_since = None
            return
        now = time.monotonic()
        if self._core_dead_since is None:
            self._core_dead_since = now
        elif now - self._core_dead_since > _CORE_DEATH_GRACE_S:
            raise EngineDeadError(self._dead or "The engine core thread is gone.")

    def _wait_future(self, fut: Future[T], deadline: float | None, what: str) -> T:
        while True:
            if fut.done():
                return fut.result()
            wait = _WAKE_S
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"{what} was not confirmed in time; it completes later.")
                wait = min(wait, remaining)
            try:
                return fut.result(timeout=wait)
            except FutureTimeoutError:
                self._check_waiter_alive()

    async def _await_future(self, fut: Future[T]) -> T:
        while not fut.done():
            wake, wait = make_async_waiter()
            fut.add_done_callback(lambda _f: wake())
            await wait(0.25)
            if not fut.done():
                self._check_waiter_alive()
        return fut.result()

    # ------------------------------------------------------------- public API

    def generate(
        self,
        prompt: str | Sequence[int],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
    ) -> RequestHandle:
        """Start generating for ``prompt`` (a str or token ids); return its handle at once.

        Raises ValueError/TypeError for an invalid prompt, id or params,
        RequestIdInUseError if ``request_id`` is still live, EngineDeadError if the
        engine failed or was shut down. Thread-safe; never blocks on the model.
        """
        if self._dead is not None or self._closed:
            raise EngineDeadError(self._dead or "The engine has been shut down.")
        if not self._client.is_alive():  # died without its failure reaching the loop
            raise EngineDeadError("The engine core thread is gone.")
        prep = self._inputs.prepare(prompt, sampling_params, request_id, priority)
        return self._submit(prep)

    def chat(
        self,
        messages: Sequence[dict[str, Any]],
        params: SamplingParams | None = None,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: Sequence[dict[str, Any]] | None = None,
        request_id: str | None = None,
    ) -> RequestHandle:
        """Start the assistant's reply to ``messages``; return its handle at once.

        ``messages`` is a list of ``{"role": ..., "content": ...}`` dicts, rendered by the
        model's chat template (or ``chat_template``: Jinja source, or the name of one of
        the model's templates) into prompt token ids equal to transformers'
        ``apply_chat_template(..., tokenize=True)``; ``chat_template_kwargs`` reach the
        template (e.g. ``{"enable_thinking": False}``), ``tools`` are JSON schemas. The
        reply ends at the model's end-of-turn (eos) tokens. Everything else is
        ``generate()`` with those ids (``handle.prompt`` holds the rendered text).
        Raises ``NoChatTemplateError`` (a ValueError) for a model without a template.
        See docs/models.md, "Chat".
        """
        from nbengine.frontend.chat import engine_chat

        return engine_chat(
            self, messages, params, request_id, chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template_kwargs=chat_template_kwargs, tools=tools,
        )

    def _normalise_ids(self, request_ids: str | Iterable[str]) -> tuple[list[str], bool]:
        if isinstance(request_ids, str):
            return [request_ids], True
        if not isinstance(request_ids, Iterable):
            raise TypeError(
                f"request ids must be a string or an iterable of strings, got {request_ids!r}."
            )
        ids = list(request_ids)
        for rid in ids:
            if not isinstance(rid, str):
                raise TypeError(f"request ids must be strings, got {rid!r}.")
        return ids, False

    def abort(
        self, request_ids: str | Iterable[str], timeout: float | None = None
    ) -> RequestOutput | list[RequestOutput | None] | None:
        """Abort requests and block until the core confirms it released them.

        Returns the final output (finish_reason "abort") for one id, or a list for a
        list of ids; None for ids that are unknown or already finished. Idempotent.
        TimeoutError if ``timeout`` passes first (the abort still completes later).
        """
        ids, single = self._normalise_ids(request_ids)
        try:
            futures = self._call_on_loop(self._start_aborts, ids)
        except EngineDeadError:
            return None if single else [None] * len(ids)
        if self._on_engine_thread():
            # Called from the loop itself (a hook): waiting would deadlock; report what is known.
            done = [f.result() if f is not None and f.done() else None for f in futures]
            return done[0] if single else done
        deadline = None if timeout is None else time.monotonic() + timeout
        results = [
            None if f is None else self._wait_future(f, deadline, f"abort of {rid!r}")
            for rid, f in zip(ids, futures)
        ]
        return results[0] if single else results

    async def abort_async(
        self, request_ids: str | Iterable[str]
    ) -> RequestOutput | list[RequestOutput | None] | None:
        """``abort()`` for asyncio and trio callers: awaits the core's confirmation."""
        ids, single = self._normalise_ids(request_ids)
        try:
            futures = self._call_on_loop(self._start_aborts, ids)
        except EngineDeadError:
            return None if single else [None] * len(ids)
        results: list[RequestOutput | None] = []
        for f in futures:
            if f is None:
                results.append(None)
            else:
                out: RequestOutput = await self._await_future(f)
                results.append(out)
        return results[0] if single else results

    def _abort_future(self, handle: RequestHandle) -> Future[RequestOutput] | None:
        """Start aborting ``handle``'s request on the loop; None if there is nothing to
        wait for (its final output is in, or the engine is dead)."""
        if handle._final is not None:
            return None
        try:
            return self._call_on_loop(self._start_abort_handle, handle)
        except EngineDeadError:
            return None

    def _abort_handle(self, handle: RequestHandle, timeout: float | None) -> RequestOutput | None:
        if handle._final is None and self._on_engine_thread():
            self._abort_handle_nowait(handle)  # never block the engine's own threads
            return handle._final
        fut = self._abort_future(handle)
        if fut is not None:
            deadline = None if timeout is None else time.monotonic() + timeout
            return self._wait_future(fut, deadline, f"cancel of {handle.request_id!r}")
        return handle._final

    def _abort_handle_nowait(self, handle: RequestHandle) -> None:
        if handle._final is None and not self._closed:
            self._call_soon(self._start_abort_handle, handle)

    async def _abort_handle_async(self, handle: RequestHandle) -> RequestOutput | None:
        fut = self._abort_future(handle)
        if fut is not None:
            return await self._await_future(fut)
        return handle._final

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate(prompt)`` without params runs with: ``SamplingParams()`` with the
        model's generation_config.json sampling fields applied (vLLM's name and rule)."""
        return self._inputs.default_params

    def has_unfinished_requests(self) -> bool:
        """True while any request is live (not yet delivered its final output)."""
        return self.num_unfinished_requests() > 0

    def num_unfinished_requests(self) -> int:
        """Number of live requests (user ids, not children)."""
        return len(self._processor.requests)

    # ------------------------------------------------- metrics and widgets (any thread)

    def events(self) -> pd.DataFrame:
        """One row per lifecycle transition: request_id, key, from_status, to_status,
        time, elapsed, wall_time, num_output_tokens, step (``nbengine.metrics``)."""
        return self._monitor.metrics.events()

    def request_stats(self) -> pd.DataFrame:
        """One row per request incarnation: status, finish_reason, prompt/output tokens,
        queue_time, ttft, itl_mean, itl_p99, e2e_time, preemptions, num_cached_tokens."""
        return self._monitor.metrics.request_stats()

    def step_stats(self) -> pd.DataFrame:
        """One row per engine step: batch size, prefill/decode tokens, KV blocks used and
        total, step_time, running, waiting, preemptions, prefix-cache hit rate."""
        return self._monitor.metrics.step_stats()

    def dashboard(self) -> Dashboard:
        """The live dashboard widget: requests and their statuses with Cancel buttons,
        "Cancel all", KV cache usage, throughput and running/waiting charts."""
        return self._monitor.dashboard()

    def plot_timeline(self, **kwargs: Any) -> go.Figure:
        """A static plotly Gantt chart of every request's statuses over time."""
        return self._monitor.plot_timeline(**kwargs)

    @property
    def is_alive(self) -> bool:
        """False once the engine failed or was shut down."""
        return self._dead is None and not self._closed

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop both threads, fail live requests (EngineDeadError), free the model.

        Idempotent and safe from any thread: a call made while another shutdown runs
        waits for that one to complete (TimeoutError after ``timeout`` plus a grace of a
        few seconds). If the core is stuck inside a model step for longer than
        ``timeout``, everything else is stopped and freed, a ``RuntimeWarning`` says what
        is still running, and the core frees the model when its step returns.
        """
        with self._shutdown_lock:
            first = not self._closed
            self._closed = True
        if not first:
            if not self._on_engine_thread() and not self._shutdown_done.wait(
                timeout + _SHUTDOWN_GRACE_S
            ):
                raise TimeoutError(
                    f"The engine's shutdown, started by another caller, did not complete "
                    f"within {timeout + _SHUTDOWN_GRACE_S:g} s."
                )
            return
        try:
            self._shutdown(timeout)
        finally:
            self._shutdown_done.set()

    def _shutdown(self, timeout: float) -> None:
        _live_engines.discard(self)
        self._finalizer.detach()
        reason = "The engine has been shut down."
        if self._loop_thread.is_alive():
            try:
                self._portal.call(self._shutdown_on_loop, reason)
            except Exception:
                logger.exception("failing live requests at shutdown failed")
        left: str | None = None
        try:
            left = self._client.shutdown(timeout)
        except Exception:
            logger.exception("engine core shutdown failed")
        try:
            self._exit_stack.close()
        except Exception:
            logger.exception("closing the engine loop failed")
        self._monitor.shutdown()  # widgets show their final states, the UI updater stops
        if left is not None:
            warnings.warn(f"nbengine shutdown: {left}.", RuntimeWarning, stacklevel=3)

    def replicas(self) -> list[dict[str, Any]]:
        """Health of each engine core: one dict per replica (``alive``, ``unfinished``, ...)."""
        return self._client.describe()

    def restart_replica(self, index: int) -> None:
        """Replace replica ``index`` (dead or alive) by a fresh one; ``backend="ray"`` only.

        A live replica's requests fail first (EngineDeadError naming the replica).
        """
        if self._closed:
            raise EngineDeadError(self._dead or "The engine has been shut down.")
        self._client.restart_replica(index)

    def _shutdown_on_loop(self, reason: str) -> None:
        if self._dead is None:
            self._dead = reason
        self._processor.fail_all(reason, FinishReason.ABORT)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        state = "alive" if self.is_alive else "dead"
        model = self.config.model.model
        shown = "the default model" if model is None else str(model)
        # The in-process runner's memory plan (model/memory_plan.py), while the engine lives.
        runner = getattr(getattr(self._client, "core", None), "runner", None)
        plan = getattr(runner, "memory_plan", None)
        memory = f", memory: {plan.summary()}" if plan is not None and self.is_alive else ""
        quant = self.config.model.quantization
        quantized = "" if quant is None else f"quantization={quant}, "
        return (f"Engine(model={shown!r}, dtype={self.dtype}, {quantized}"
                f"max_model_len={self._max_model_len}, {state}{memory})")

    @property
    def dtype(self) -> str:
        """The dtype the model runs in (``dtype="auto"`` resolved: docs/models.md)."""
        return self.config.model.dtype
