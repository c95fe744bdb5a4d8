"""``Engine``: the in-process LLM engine (docs/architecture.md: threads, queues, the step loop).

Threads:

- the caller's thread(s): ``generate()`` validates there (``InputProcessor``), then
  registers the request on the loop with one short ``portal.call``;
- ``nbengine-loop``: an anyio blocking portal (asyncio backend; ``LoopBridge``) that
  owns all frontend state (``RequestRegistry`` and its ``OutputProcessor``, the
  observers). Only this thread mutates it and only this thread puts ADD/ABORT messages
  on the core queue, so the queue order always matches the registry;
- ``nbengine-core``: ``EngineCore.run_busy_loop``. Its ``emit`` hands each batch to the
  loop with ``loop.call_soon_threadsafe`` and never blocks.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import queue
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from nbengine.config import EngineConfig
from nbengine.core.client import CoreClient, make_core_client
from nbengine.core.messages import EngineCoreMessage, EngineCoreOutputs
from nbengine.frontend.handles import RequestHandle
from nbengine.frontend.input_processor import InputProcessor, PreparedRequest
from nbengine.frontend.loop_bridge import LoopBridge, client_callbacks, reap_engine
from nbengine.frontend.observer import EngineObserver, ObserverList
from nbengine.frontend.registry import RequestRegistry
from nbengine.outputs import RequestOutput
from nbengine.request import EngineDeadError
from nbengine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import pandas as pd
    import plotly.graph_objects as go

    from nbengine.core.engine_core import EngineCore, RunnerLike
    from nbengine.dashboard.chat_panel import ChatPanel
    from nbengine.dashboard.dashboard import Dashboard
    from nbengine.dashboard.monitor import EngineMonitor
    from nbengine.server import Server

__all__ = ["Engine"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

_SHUTDOWN_GRACE_S = 5.0  # a second shutdown() waits this much longer than the first may take

_live_engines: weakref.WeakSet[Engine] = weakref.WeakSet()


def _shutdown_all_engines() -> None:
    for engine in list(_live_engines):
        try:
            engine.shutdown(timeout=5.0)
        except Exception:
            logger.exception("engine shutdown at exit failed")


atexit.register(_shutdown_all_engines)


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

            hf_config = read_hf_config(model_dir)
            self.config.model.dtype = auto_dtype(hf_config, self.config.model.device)
        self.backend = backend
        self._client: CoreClient = make_core_client(backend, self.config, runner, backend_options)
        if backend == "inproc":  # in-process internals that tests reach into
            self._core: EngineCore = self._client.core  # type: ignore[attr-defined]
            self._core_queue: queue.Queue[EngineCoreMessage] = self._client.queue  # type: ignore[attr-defined]
        self._vocab_size = int(self._client.vocab_size)
        self._max_model_len = int(self._client.max_model_len)
        self._eos_token_ids = frozenset(self._client.eos_token_ids) | frozenset(
            getattr(tokenizer, "eos_token_ids", ())
        )
        self._inputs = InputProcessor(
            tokenizer,
            self._vocab_size,
            self._max_model_len,
            default_sampling_params(model_dir),
            self._eos_token_ids,
            self.config.model.max_logprobs,
            kv_pool=self._client.kv_pool,
            max_prefill_tokens=None
            if self.config.scheduler.enable_chunked_prefill
            else self.config.scheduler.max_num_batched_tokens,
        )

        # Observers of the output processor (docs/architecture.md, "Seams"); the first is
        # the metrics log and widgets. The UI package is imported here, not at module level.
        from nbengine.dashboard.monitor import EngineMonitor

        self._observers = ObserverList()
        self.monitor: EngineMonitor = EngineMonitor(self)
        self._observers.add(self.monitor)
        # The loop thread's request state; it holds no reference to the engine, so
        # dropping the last user reference frees the engine at once (no reference cycle).
        self._registry = RequestRegistry(
            tokenizer,
            self._client,
            self._observers,
            self._eos_token_ids,
            self.config.scheduler.stream_interval,
        )
        self._processor = self._registry.processor
        self._closed = False
        self._shutdown_lock = threading.Lock()
        self._shutdown_done = threading.Event()
        ref = weakref.ref(self)

        self._exit_stack = contextlib.ExitStack()
        try:
            self._bridge = LoopBridge(
                self._client,
                self._exit_stack,
                closed=lambda: ref() is None or ref()._closed,  # type: ignore[union-attr]
                dead_reason=lambda: None if ref() is None else ref()._dead,  # type: ignore[union-attr]
            )
        except BaseException:
            self._exit_stack.close()
            self._client.shutdown(10.0)
            raise
        self._client.start(*client_callbacks(ref))
        if backend == "inproc":
            self._core_thread: threading.Thread = self._client.thread  # type: ignore[attr-defined]
        _live_engines.add(self)
        # Unreferenced without shutdown() (a re-executed cell): stop the threads anyway.
        self._finalizer = weakref.finalize(self, reap_engine, self._client, self._exit_stack)
        self._finalizer.atexit = False  # at exit, _shutdown_all_engines does it

    # -------------------------------------------------------------- observers

    def add_observer(self, observer: EngineObserver) -> None:
        """Notify ``observer`` of this engine's requests, lifecycle events, tokens and
        steps from now on (``nbengine.frontend.observer``); its hooks run on the engine's
        loop thread and must not block. Adding it twice does nothing."""
        self._observers.add(observer)

    def remove_observer(self, observer: EngineObserver) -> None:
        """Stop notifying ``observer``; ValueError if it was not added."""
        self._observers.remove(observer)

    def _on_routed(self, key: str, replica: int) -> None:
        """Called on the loop thread when a multi-replica backend places ``key``."""
        observers = getattr(self, "_observers", None)
        if observers is not None:
            observers.on_routed(key, replica)

    # ------------------------------------------------------------ core thread

    def _emit(self, outputs: EngineCoreOutputs) -> None:
        """Core thread: hand a batch to the loop without blocking."""
        self._bridge.call_soon(self._registry.process, outputs)

    @property
    def _dead(self) -> str | None:
        """Why the engine can no longer serve (the loop thread writes it)."""
        return self._registry.dead

    def _on_core_exit(self, error: str | None) -> None:
        """Loop thread: the core client's threads stopped."""
        if self._closed and error is None:
            return
        self._registry.die(f"The engine core stopped: {error or 'its loop exited'}")

    def _fail_keys(self, keys: set[str], message: str) -> None:
        """Loop thread: one replica is lost; fail only the requests it held."""
        self._registry.fail_keys(keys, message)

    # ----------------------------------------------------------- caller threads

    def _submit(self, prep: PreparedRequest) -> RequestHandle:
        """Register ``prep`` on the loop and return its handle, atomically for the caller.

        A ``KeyboardInterrupt`` (or any exception) that reaches the caller while it waits
        for the loop leaves nothing behind: if the request got registered, it is aborted
        and the core's confirmation awaited before the exception propagates, so its id is
        free again (docs/lifecycle.md, "Interrupts"). Interrupts that arrive during that
        clean-up are held back and the first one is re-raised after it.
        """
        try:
            return self._bridge.call(self._registry.register, prep, self)
        except BaseException:
            if threading.current_thread() is self._bridge.thread:
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
                    fut = self._bridge.call(self._registry.withdraw, prep)
                    asked = True
                if fut is not None:
                    self._bridge.wait_future(fut, None, f"withdrawal of {prep.request_id!r}")
                break
            except (KeyboardInterrupt, SystemExit) as exc:
                deferred = deferred or exc  # finish the clean-up first
            except Exception:  # the engine died: nothing is left registered
                logger.debug("withdrawing an interrupted request failed", exc_info=True)
                break
        if deferred is not None:
            raise deferred

    def _run_on_core(self, fn: Callable[[EngineCore], T]) -> Future[T]:
        """Run ``fn(core)`` on the core thread between steps (a UTILITY message).

        With ``backend="ray"`` it runs in replica 0's actor (``fn`` must pickle).
        """
        return self._client.run_utility(fn)

    # ------------------------------------- RequestHandle's owner (handles.HandleOwner)

    def on_engine_thread(self) -> bool:
        """True on one of this engine's own threads, where nothing may block."""
        return self._bridge.on_engine_thread()

    def check_health(self) -> None:
        """Raise EngineDeadError if nothing will ever deliver outputs again: the loop
        thread is gone, or the core has been gone for a few seconds without its failure
        reaching the loop. A failed engine whose threads still run delivers that failure
        to every waiter itself. Waiting loops call this when they wake without news."""
        self._bridge.check_health()

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

    def generate_many(
        self,
        prompts: Sequence[str | Sequence[int] | dict[str, Any]],
        sampling_params: Sequence[SamplingParams | None],
    ) -> list[RequestHandle]:
        """Start one request per prompt, with the params at the same index; return their
        handles in order (``LLM.generate`` is built on this).

        Every prompt is validated first, so a bad one raises (ValueError/TypeError) before
        any request starts. An exception or interrupt while they are being started cancels
        those already started, then propagates.
        """
        if len(prompts) != len(sampling_params):
            raise ValueError(
                f"Got {len(sampling_params)} sampling params for {len(prompts)} prompts."
            )
        prepared = [self._inputs.prepare(p, sp, None, 0) for p, sp in zip(prompts, sampling_params)]
        handles: list[RequestHandle] = []
        try:
            for prep in prepared:
                handles.append(self._submit(prep))
        except BaseException:
            for h in handles:
                if not h.done():
                    try:
                        h.cancel()
                    except Exception:
                        pass
            raise
        return handles

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
            self,
            messages,
            params,
            request_id,
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template_kwargs=chat_template_kwargs,
            tools=tools,
        )

    def serve(
        self,
        host: str = "127.0.0.1",
        port: int = 8000,
        api_key: str | None = None,
        **kwargs: Any,
    ) -> Server:
        """Start an OpenAI-compatible HTTP server on this engine; return it once it listens.

        ``server.url`` is the API's base URL, ``server.stop()`` (or ``with``) stops it.
        Binding a non-loopback ``host`` requires ``api_key``. Needs the ``serve`` extra.
        Keyword options (``model_name``, ``max_request_bytes``, ``max_tokens``): see
        docs/serving.md.
        """
        from nbengine.server import serve

        return serve(self, host, port, api_key, **kwargs)

    def chat_ui(self, **kwargs: Any) -> ChatPanel:
        """A chat panel widget on this engine: messages, Send, Stop, Regenerate, a system
        prompt, temperature and max-tokens; ``panel.messages`` is the conversation."""
        from nbengine.dashboard.chat_panel import ChatPanel

        return ChatPanel(self, **kwargs)

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
            futures = self._bridge.call(self._registry.start_aborts, ids)
        except EngineDeadError:
            return None if single else [None] * len(ids)
        if self.on_engine_thread():
            # Called from the loop itself (a hook): waiting would deadlock; report what is known.
            done = [f.result() if f is not None and f.done() else None for f in futures]
            return done[0] if single else done
        deadline = None if timeout is None else time.monotonic() + timeout
        results = [
            None if f is None else self._bridge.wait_future(f, deadline, f"abort of {rid!r}")
            for rid, f in zip(ids, futures)
        ]
        return results[0] if single else results

    async def abort_async(
        self, request_ids: str | Iterable[str]
    ) -> RequestOutput | list[RequestOutput | None] | None:
        """``abort()`` for asyncio and trio callers: awaits the core's confirmation (a
        cancellation meanwhile propagates once the aborts are confirmed, docs/lifecycle.md)."""
        ids, single = self._normalise_ids(request_ids)
        try:
            futures = self._bridge.call(self._registry.start_aborts, ids)
        except EngineDeadError:
            return None if single else [None] * len(ids)
        results = await self._bridge.await_all(futures)
        return results[0] if single else results

    def abort_nowait(self, request_id: str, key: str | None = None) -> None:
        """Schedule an abort of ``request_id`` on the loop and return at once (widget
        callbacks use this; ``abort()`` waits for the confirmation instead).

        With ``key`` (an incarnation's internal key, as in ``events()``) only that
        incarnation is aborted: a newer request reusing the id is left alone.
        """
        if not self.is_alive:
            return

        self._bridge.call_soon(self._registry.abort_where, request_id, key)

    def abort_all_nowait(self) -> None:
        """Schedule an abort of every live request on the loop and return at once."""
        if not self.is_alive:
            return

        self._bridge.call_soon(self._registry.abort_all)

    def _abort_future(self, handle: RequestHandle) -> Future[RequestOutput] | None:
        """Start aborting ``handle``'s request on the loop; None if there is nothing to
        wait for (its final output is in, or the engine is dead)."""
        if handle._final is not None:
            return None
        try:
            return self._bridge.call(self._registry.start_abort_handle, handle)
        except EngineDeadError:
            return None

    def abort_handle(self, handle: RequestHandle, timeout: float | None) -> RequestOutput | None:
        """``handle.cancel()``: abort its incarnation, wait for the confirmation."""
        if handle._final is None and self.on_engine_thread():
            self.abort_handle_nowait(handle)  # never block the engine's own threads
            return handle._final
        fut = self._abort_future(handle)
        if fut is not None:
            deadline = None if timeout is None else time.monotonic() + timeout
            return self._bridge.wait_future(fut, deadline, f"cancel of {handle.request_id!r}")
        return handle._final

    def abort_handle_nowait(self, handle: RequestHandle) -> None:
        """``handle.cancel(wait=False)``: schedule the abort, return at once."""
        if handle._final is None and not self._closed:
            self._bridge.call_soon(self._registry.start_abort_handle, handle)

    async def abort_handle_async(self, handle: RequestHandle) -> RequestOutput | None:
        """``await handle.cancel_async()``."""
        fut = self._abort_future(handle)
        if fut is not None:
            return await self._bridge.await_future(fut)
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

    def reset_prefix_cache(self, timeout: float | None = 60.0) -> bool:
        """Forget every prefix-cache entry (vLLM's name); runs between two core steps.

        Returns False, forgetting nothing, while any request holds KV blocks (as vLLM).
        With ``backend="ray"`` it resets replica 0 only.
        """
        if self._dead is not None or self._closed:
            raise EngineDeadError(self._dead or "The engine has been shut down.")
        from nbengine.core.engine_core import EngineCore

        deadline = None if timeout is None else time.monotonic() + timeout
        fut = self._run_on_core(EngineCore.reset_prefix_cache)
        return bool(self._bridge.wait_future(fut, deadline, "prefix-cache reset"))

    # ------------------------------------------------- metrics and widgets (any thread)

    def events(self) -> pd.DataFrame:
        """One row per lifecycle transition: request_id, key, from_status, to_status,
        time, elapsed, wall_time, num_output_tokens, step (``nbengine.metrics``)."""
        return self.monitor.metrics.events()

    def request_stats(self) -> pd.DataFrame:
        """One row per request incarnation: status, finish_reason, prompt/output tokens,
        queue_time, ttft, itl_mean, itl_p99, e2e_time, preemptions, num_cached_tokens."""
        return self.monitor.metrics.request_stats()

    def step_stats(self) -> pd.DataFrame:
        """One row per engine step: batch size, prefill/decode tokens, KV blocks used and
        total, step_time, running, waiting, preemptions, prefix-cache hit rate."""
        return self.monitor.metrics.step_stats()

    def dashboard(self) -> Dashboard:
        """The live dashboard widget: requests and their statuses with Cancel buttons,
        "Cancel all", KV cache usage, throughput and running/waiting charts."""
        return self.monitor.dashboard()

    def plot_timeline(self, **kwargs: Any) -> go.Figure:
        """A static plotly Gantt chart of every request's statuses over time."""
        return self.monitor.plot_timeline(**kwargs)

    @property
    def loop_running(self) -> bool:
        """True while the engine's loop thread runs, or has yet to start (final outputs
        may still arrive)."""
        bridge = getattr(self, "_bridge", None)
        return bridge is None or bridge.thread.is_alive()

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary size (the largest valid token id plus one)."""
        return self._vocab_size

    @property
    def max_model_len(self) -> int:
        """The longest sequence (prompt plus output tokens) a request may reach."""
        return self._max_model_len

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The token ids that end a request (the model's EOS ids and the tokenizer's)."""
        return self._eos_token_ids

    def encode_prompt(
        self, prompt: Any, sampling_params: SamplingParams | None = None
    ) -> list[int]:
        """The token ids ``prompt`` (text, token ids or a prompt dict) runs on, validated
        as ``generate()`` validates it (ValueError/TypeError naming the problem)."""
        params = sampling_params or self.get_default_sampling_params()
        return list(self._inputs.prepare(prompt, params, None, 0).prompt_token_ids)

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
            if not self.on_engine_thread() and not self._shutdown_done.wait(
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
        if self._bridge.thread.is_alive():
            try:
                self._bridge.portal.call(self._registry.shut_down, reason)
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
        self.monitor.shutdown()  # widgets show their final states, the UI updater stops
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
        return (
            f"Engine(model={shown!r}, dtype={self.dtype}, {quantized}"
            f"max_model_len={self._max_model_len}, {state}{memory})"
        )

    @property
    def dtype(self) -> str:
        """The dtype the model runs in (``dtype="auto"`` resolved: docs/models.md)."""
        return self.config.model.dtype
