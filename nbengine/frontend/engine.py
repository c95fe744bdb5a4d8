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

import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from nbengine.core.client import CoreClient
from nbengine.core.messages import EngineCoreMessage
from nbengine.frontend import lifecycle
from nbengine.frontend.engine_setup import make_core_client, make_input_processor, resolve_engine
from nbengine.frontend.handles import RequestHandle
from nbengine.frontend.loop_bridge import LoopBridge, client_callbacks, reap_engine
from nbengine.frontend.lora import LoRAManager
from nbengine.frontend.notebook import NotebookFacade, preload_widget_modules
from nbengine.frontend.observer import EngineObserver, ObserverList
from nbengine.frontend.registry import RequestRegistry
from nbengine.frontend.request_control import RequestControl
from nbengine.lora.request import LoRARequest
from nbengine.metrics import MetricsLog
from nbengine.outputs import RequestOutput
from nbengine.request import EngineDeadError
from nbengine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from nbengine.core.engine_core import EngineCore, RunnerLike

__all__ = ["Engine"]

T = TypeVar("T")


class Engine(NotebookFacade):
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
        setup = resolve_engine(model, kwargs, tokenizer)
        self.config = setup.config
        self.tokenizer = tokenizer = setup.tokenizer
        self._model_dir = setup.model_dir
        self.backend = backend = self.config.parallel.backend
        self._client: CoreClient = make_core_client(self.config, runner)
        if backend == "inproc":  # in-process internals that tests reach into
            self._core: EngineCore = self._client.core  # type: ignore[attr-defined]
            self._core_queue: queue.Queue[EngineCoreMessage] = self._client.queue  # type: ignore[attr-defined]
        self._inputs = inputs = make_input_processor(setup, self._client)
        self._vocab_size, self._max_model_len = inputs.vocab_size, inputs.max_model_len
        self._eos_token_ids = frozenset(inputs.eos_token_ids)

        # Observers of the output processor (docs/architecture.md, "Seams"); the first is
        # the metrics log. The UI attaches to it on first use (``monitor``, notebook.py).
        self._observers = ObserverList()
        self._metrics = MetricsLog()
        self._observers.add(self._metrics)
        preload_widget_modules()  # in a kernel only: the first widget then comes quickly
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

        def closed() -> bool:
            engine = ref()
            return engine is None or engine._closed

        self._bridge, self._exit_stack = LoopBridge.start(
            self._client,
            closed=closed,
            dead_reason=lambda: None if ref() is None else ref()._dead,  # type: ignore[union-attr]
        )
        self._control = RequestControl(self._bridge, self._registry, self, closed)
        bridge = self._bridge  # the manager holds no reference to the engine

        def wait(fut: Future[Any], what: str) -> Any:
            return bridge.wait_future(fut, time.monotonic() + 300.0, what)

        self._loras = LoRAManager(self.config.lora, self._client.run_utility, wait)
        self._client.start(*client_callbacks(ref))
        if backend == "inproc":
            self._core_thread: threading.Thread = self._client.thread  # type: ignore[attr-defined]
        lifecycle.track(self)
        # Unreferenced without shutdown() (a re-executed cell): stop the threads anyway.
        self._finalizer = weakref.finalize(self, reap_engine, self._client, self._exit_stack)
        self._finalizer.atexit = False  # at exit, lifecycle shuts it down instead

    # -------------------------------------------------------------- observers

    def add_observer(self, observer: EngineObserver) -> None:
        """Notify ``observer`` of this engine's requests, lifecycle events, tokens and
        steps from now on (``nbengine.frontend.observer``); its hooks run on the engine's
        loop thread and must not block. Adding it twice does nothing."""
        self._observers.add(observer)

    def remove_observer(self, observer: EngineObserver) -> None:
        """Stop notifying ``observer``; ValueError if it was not added."""
        self._observers.remove(observer)

    # ---------------------------------------------- the loop, the core and their health

    @property
    def _dead(self) -> str | None:
        """Why the engine can no longer serve (the loop thread writes it)."""
        return self._registry.dead

    def _on_core_exit(self, error: str | None) -> None:
        """Loop thread: the core client's threads stopped."""
        if self._closed and error is None:
            return
        self._registry.die(f"The engine core stopped: {error or 'its loop exited'}")

    def _run_on_core(self, fn: Callable[[EngineCore], T]) -> Future[T]:
        """Run ``fn(core)`` on the core thread between steps (a UTILITY message).

        With ``backend="ray"`` it runs in replica 0's actor (``fn`` must pickle).
        """
        return self._client.run_utility(fn)

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
        lora_request: LoRARequest | None = None,
    ) -> RequestHandle:
        """Start generating for ``prompt`` (a str or token ids); return its handle at once.

        ``lora_request``: run under that LoRA adapter (``enable_lora=True``; docs/lora.md),
        loaded on first use (a bad adapter raises here, naming the field).

        Raises ValueError/TypeError for an invalid prompt, id or params,
        RequestIdInUseError if ``request_id`` is still live, EngineDeadError if the
        engine failed or was shut down. Thread-safe; never blocks on the model (only a
        first use of an adapter waits for it to be loaded between two steps).
        """
        if self._dead is not None or self._closed:
            raise EngineDeadError(self._dead or "The engine has been shut down.")
        if not self._client.is_alive():  # died without its failure reaching the loop
            raise EngineDeadError("The engine core thread is gone.")
        prep = self._inputs.prepare(prompt, sampling_params, request_id, priority)
        prep.lora = self._loras.resolve(lora_request)
        return self._control.submit(prep)

    def generate_many(
        self,
        prompts: Sequence[str | Sequence[int] | dict[str, Any]],
        sampling_params: Sequence[SamplingParams | None],
        lora_requests: Sequence[LoRARequest | None] | None = None,
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
        if lora_requests is not None and len(lora_requests) != len(prompts):
            raise ValueError(f"Got {len(lora_requests)} lora_requests for {len(prompts)} prompts.")
        prepared = [self._inputs.prepare(p, sp, None, 0) for p, sp in zip(prompts, sampling_params)]
        for prep, lora in zip(prepared, lora_requests or ()):
            prep.lora = self._loras.resolve(lora)
        return self._control.submit_all(prepared)

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
        lora_request: LoRARequest | None = None,
        tool_call_parser: str | None = None,
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

        With ``tools``, the final output's ``outputs[i].tool_calls`` are the calls the
        reply made (``ToolCall``: ``name``, ``arguments`` JSON text, ``id``) and
        ``outputs[i].content`` its text without them, parsed by ``tool_call_parser``
        ("hermes", "llama3_json", "mistral"; default: the one the chat template's format
        shows, none if it shows none). See docs/api.md, "Tool calls".
        """
        from nbengine.frontend.chat import engine_chat

        return engine_chat(
            self,
            messages,
            params,
            request_id,
            tool_call_parser,
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template_kwargs=chat_template_kwargs,
            tools=tools,
            lora_request=lora_request,
        )

    # ------------------------------------------------------------- LoRA adapters

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load a LoRA adapter now (docs/lora.md); False if it was loaded already.

        Raises ValueError naming the field for an adapter that does not fit (``r`` above
        ``max_lora_rank``, ``target_modules``, the base model's shapes) and ValueError on an
        engine without ``enable_lora=True``.
        """
        return self._loras.add(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Unload adapter ``lora_int_id``; False if it is not loaded. Raises
        ``LoRAInUseError`` (a ValueError) while waiting or running requests use it."""
        return self._loras.remove(lora_int_id)

    def list_loras(self) -> set[int]:
        """The ids of the loaded LoRA adapters (vLLM's ``list_loras``)."""
        return self._loras.list_ids()

    def lora_by_name(self, lora_name: str) -> LoRARequest | None:
        """The loaded LoRA adapter called ``lora_name`` (the server's ``model``), or None."""
        return self._loras.by_name(lora_name)

    def lora_requests(self) -> list[LoRARequest]:
        """The loaded LoRA adapters, by id (the server lists them in /v1/models)."""
        return self._loras.requests()

    def abort(
        self, request_ids: str | Iterable[str], timeout: float | None = None
    ) -> RequestOutput | list[RequestOutput | None] | None:
        """Abort requests and block until the core confirms it released them.

        Returns the final output (finish_reason "abort") for one id, or a list for a
        list of ids; None for ids that are unknown or already finished. Idempotent.
        TimeoutError if ``timeout`` passes first (the abort still completes later).
        """
        return self._control.abort(request_ids, timeout)

    async def abort_async(
        self, request_ids: str | Iterable[str]
    ) -> RequestOutput | list[RequestOutput | None] | None:
        """``abort()`` for asyncio and trio callers: awaits the core's confirmation (a
        cancellation meanwhile propagates once the aborts are confirmed, docs/lifecycle.md)."""
        return await self._control.abort_async(request_ids)

    def abort_nowait(self, request_id: str, key: str | None = None) -> None:
        """Schedule an abort of ``request_id`` on the loop and return at once (widget
        callbacks use this; ``abort()`` waits for the confirmation instead).

        With ``key`` (an incarnation's internal key, as in ``events()``) only that
        incarnation is aborted: a newer request reusing the id is left alone.
        """
        self._control.abort_nowait(request_id, key)

    def abort_all_nowait(self) -> None:
        """Schedule an abort of every live request on the loop and return at once."""
        self._control.abort_all_nowait()

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
        return self._control.is_alive

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
            if not self._bridge.on_engine_thread():
                lifecycle.wait_for_shutdown(self._shutdown_done, timeout)
            return
        try:
            lifecycle.forget(self)
            self._finalizer.detach()
            lifecycle.teardown(
                self._bridge, self._registry, self._client, self._exit_stack, self._monitor, timeout
            )
        finally:
            self._shutdown_done.set()

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
    def memory_plan(self) -> Any:
        """The memory plan of an in-process engine (a ``MemoryPlan``: weights, KV cache
        and what was free; model/memory_plan.py), None for other backends."""
        runner = getattr(getattr(self._client, "core", None), "runner", None)
        return getattr(runner, "memory_plan", None)

    @property
    def dtype(self) -> str:
        """The dtype the model runs in (``dtype="auto"`` resolved: docs/models.md)."""
        return self.config.model.dtype
