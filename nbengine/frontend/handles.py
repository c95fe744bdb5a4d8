"""``RequestHandle``: what ``Engine.generate()`` returns.

Threading model: the engine's loop thread is the only writer (``_deliver``); any
thread may read or wait. Sync waits use a ``threading.Condition`` and wake at least
every 0.1 s (so SIGINT reaches the main thread and a dead engine is noticed). Async
waits register a waker that resumes the consumer's own event loop thread-safely
(asyncio ``loop.call_soon_threadsafe`` / trio ``token.run_sync_soon``), detected with
``sniffio``. State readers (``text``, ``token_ids``, ``status``, ``view``,
``snapshot()``, ``done()``) take no lock: they read the one immutable ``RequestView`` that each
delivery publishes by a reference swap (request_view.py; docs/architecture.md, "The
output path"), never the loop's own request state.

Stream semantics: outputs are shaped by ``params.output_kind``. When the consumer lags,
pending outputs are merged (DELTA: text and ids concatenated, last cumulative logprob;
CUMULATIVE: the newest state per completion index). Exactly one output has
``finished=True``: the last one. ``result()``/``await h`` return the full final output
(all text and ids of all ``n`` completions) whatever the output kind.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Generator, Iterable, Iterator
from typing import TYPE_CHECKING, Any, Protocol, cast

from nbengine.frontend.request_view import RequestView, final_view, initial_view, live_view
from nbengine.frontend.waiter import (
    ABORT_CONFIRM_S,
    interrupts_the_caller,
    make_async_waiter,
    next_wait_s,
)
from nbengine.outputs import RequestOutput
from nbengine.request import EngineDeadError, RequestStatus
from nbengine.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from nbengine.dashboard.handle_widget import HandleWidget
    from nbengine.dashboard.monitor import EngineMonitor
    from nbengine.frontend.output_processor import ChildState, LiveRequest
    from nbengine.lora.request import LoRARequest

__all__ = ["HandleOwner", "RequestHandle"]

logger = logging.getLogger(__name__)

_SYNC_WAKE_S = 0.1  # sync waits wake this often (SIGINT delivery, liveness checks)


def merge_outputs(pending: RequestOutput, new: RequestOutput, kind: RequestOutputKind) -> None:
    """Fold ``new`` into ``pending`` (an output the consumer has not taken yet), in place."""
    by_index = {c.index: c for c in pending.outputs}
    for comp in new.outputs:
        old = by_index.get(comp.index)
        if old is None:
            pending.outputs.append(comp)
            by_index[comp.index] = comp
        elif kind is RequestOutputKind.DELTA:
            old.text += comp.text
            old.token_ids.extend(comp.token_ids)
            if comp.logprobs is not None:
                old.logprobs = (old.logprobs or []) + comp.logprobs
            old.cumulative_logprob = comp.cumulative_logprob
            old.finish_reason = comp.finish_reason
            old.stop_reason = comp.stop_reason
        else:
            pending.outputs[pending.outputs.index(old)] = comp
            by_index[comp.index] = comp
    pending.outputs.sort(key=lambda c: c.index)
    pending.finished = new.finished
    pending.status = new.status
    pending.metrics = new.metrics
    pending.num_cached_tokens = new.num_cached_tokens
    if new.prompt_logprobs is not None:
        pending.prompt_logprobs = new.prompt_logprobs
    pending.error = new.error


class HandleOwner(Protocol):
    """What a handle needs from the engine that made it (its ``RequestControl``).

    Everything else reaches the handle from the loop thread: the output processor
    writes its state and calls ``_deliver``.
    """

    @property
    def monitor(self) -> EngineMonitor:
        """The engine's metrics and widgets (``widget()`` asks it for one)."""
        ...

    @property
    def anchor(self) -> object:
        """The engine itself, which a live handle keeps alive (docs/reliability.md)."""
        ...

    def check_health(self) -> None:
        """Raise EngineDeadError if nothing will ever deliver this handle's outputs."""
        ...

    def on_engine_thread(self) -> bool:
        """True on one of the engine's own threads, where nothing may block."""
        ...

    def abort_handle(self, handle: RequestHandle, timeout: float | None) -> RequestOutput | None:
        """Abort ``handle``'s incarnation and wait for the core's confirmation."""
        ...

    def abort_handle_nowait(self, handle: RequestHandle) -> None:
        """Schedule the abort of ``handle``'s incarnation; return at once."""
        ...

    async def abort_handle_async(self, handle: RequestHandle) -> RequestOutput | None:
        """Abort ``handle``'s incarnation and await the core's confirmation."""
        ...


class RequestHandle:
    """A live view of one request: iterate it, wait for it, or cancel it.

    ``for out in h`` / ``async for out in h`` stream ``RequestOutput``s (one consumer
    per handle); leaving the loop early cancels the request. ``h.result()`` /
    ``await h`` return the final output. ``h.cancel()`` aborts this incarnation and
    returns its final output. ``h.text``, ``h.token_ids``, ``h.status``, ``h.view``,
    ``h.snapshot()`` and ``h.done()`` may be read from any thread at any time: they all
    read the one ``RequestView`` the latest delivery published.
    """

    def __init__(
        self,
        engine: HandleOwner,
        request_id: str,
        params: SamplingParams,
        prompt: str | None,
        prompt_token_ids: list[int],
        arrival_time: float,
    ) -> None:
        self.request_id = request_id
        self.sampling_params = params
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.arrival_time = arrival_time
        self.lora_request: LoRARequest | None = None  # its LoRA adapter (docs/lora.md)
        # A live request keeps its engine alive (docs/reliability.md); a finished one must
        # not: widgets and IPython's Out[n] keep handles for the kernel's life, and they
        # would keep a re-created engine's predecessor, its threads and model with it.
        # So the strong reference is dropped when the final output arrives.
        self._engine_strong: HandleOwner | None = engine
        self._anchor: object = engine.anchor if engine is not None else None
        self._engine_weak = weakref.ref(engine) if engine is not None else None
        self._cond = threading.Condition(threading.Lock())
        self._pending: RequestOutput | None = None  # stream outputs not yet taken, merged
        self._stream_done = False  # the finished output has been taken by the consumer
        self._final: RequestOutput | None = None  # full final output, once delivered
        self._error: EngineDeadError | None = None
        # The latest delivery's view: replaced (never changed) by the loop thread, read
        # by any thread without the lock (request_view.py).
        self._view: RequestView = initial_view(request_id, params.n, arrival_time)
        self._live: LiveRequest | None = None  # the processor's state (loop thread writes it)
        self._consumer_claimed = False
        self._wakers: list[Callable[[], None]] = []
        self._done_callbacks: list[Callable[[RequestHandle], None]] = []
        self._widget: HandleWidget | None = None  # created by widget(), one per handle
        # Applied to the full final output(s) before anyone can see them (finish_with).
        self._final_hook: Callable[[RequestOutput], None] | None = None

    @property
    def _engine(self) -> HandleOwner:
        """The engine (EngineDeadError once a finished handle's engine is gone)."""
        engine = self._engine_strong
        if engine is None and self._engine_weak is not None:
            engine = self._engine_weak()
        if engine is None:
            raise EngineDeadError(f"The engine of request {self.request_id!r} no longer exists.")
        return engine

    # ------------------------------------------------------------------ state

    @property
    def view(self) -> RequestView:
        """The request as of its latest delivery: text, token count, status and finish
        reasons of one moment (immutable; read it once and use its fields)."""
        return self._view

    @property
    def status(self) -> RequestStatus:
        """The lifecycle status (QUEUED ... RELEASING, FINISHED_*)."""
        return self._view.status

    def done(self) -> bool:
        """True once the final output has been delivered (and the final view published)."""
        return self._view.finished

    @property
    def text(self) -> str:
        """The text of completion 0 so far (everything safe to show)."""
        return self._view.text

    @property
    def token_ids(self) -> list[int]:
        """The output token ids of completion 0 so far (a copy)."""
        return self._view.token_ids

    @property
    def final_output(self) -> RequestOutput | None:
        """The full final output (also for failed requests), or None while live."""
        return self._final

    def snapshot(self) -> dict[str, Any]:
        """The latest delivery's view as plain values (``view.as_dict()``; any thread)."""
        return self._view.as_dict()

    def __repr__(self) -> str:
        return f"RequestHandle(request_id={self.request_id!r}, status={self.status.name})"

    def widget(self) -> HandleWidget:
        """The live widget of this request (text, status badge, tokens/s, Cancel button);
        one per handle, created on the calling thread."""
        widget = self._widget
        if widget is not None:
            return widget
        try:
            engine = self._engine
        except EngineDeadError:  # finished, and its engine was freed: show the final state
            from nbengine.dashboard.handle_widget import final_handle_widget

            widget = final_handle_widget(self)
        else:
            widget = engine.monitor.handle_widget(self)
        with self._cond:
            if self._widget is None:
                self._widget = widget
            return self._widget

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any]:
        """In a notebook a handle shows its widget; the text/plain form stays
        ``RequestHandle(request_id=...)`` while it runs (stable for nbval)."""
        from nbengine.dashboard.handle_widget import handle_mimebundle

        return handle_mimebundle(self, **kwargs)

    # ------------------------------------------------------------- loop thread

    def _deliver(
        self,
        out: RequestOutput | None,
        final: RequestOutput | None = None,
        error: EngineDeadError | None = None,
        changed: Iterable[ChildState] = (),
    ) -> None:
        """Called on the loop thread only: hand over a stream output and/or the final
        output, and publish this delivery's view (none: only the view changes).

        ``changed``: the completions whose tokens or text changed since the last view.
        """
        # This delivery's view (request_view.py): the final output's, else the live
        # state's (a handle not registered yet keeps its initial view).
        view = self._view
        if final is not None:
            view = final_view(final, view, None if error is None else str(error))
        elif self._live is not None:
            view = live_view(self._live, view, changed)
        if out is None and final is None and error is None:
            self._view = view  # the one reference swap; nothing for a waiter
            return
        with self._cond:
            if final is not None and self._final_hook is not None:
                self._run_final_hook(final, out)
            if out is not None and not self._stream_done:
                if self._pending is None:
                    self._pending = out
                else:
                    merge_outputs(self._pending, out, self.sampling_params.output_kind)
            if error is not None:
                self._error = error
            if final is not None:
                self._final = final
                self._engine_strong = None  # see __init__
                self._anchor = None
            # The one reference swap, after the final output is set (done() reads the
            # view: once it is True, final_output and result() have the final output)
            # and before the waiters wake (a consumer that takes an output finds a view
            # at least as new).
            self._view = view
            self._cond.notify_all()
            wakers, self._wakers = self._wakers, []
            callbacks = list(self._done_callbacks) if final is not None else []
        for wake in wakers:
            wake()
        for cb in callbacks:
            try:
                cb(self)
            except Exception:  # a callback must not break output processing
                logger.exception("done callback of request %r failed", self.request_id)

    def finish_with(self, hook: Callable[[RequestOutput], None]) -> None:
        """Let ``hook`` complete the final output in place before it is published (the
        full final output, and the stream's last output unless it is a delta); at once
        if it has arrived already. ``Engine.chat`` uses it to attach parsed tool calls.
        One hook per handle; an exception in it is logged, never raised."""
        with self._cond:
            self._final_hook = hook
            if self._final is not None:
                self._run_final_hook(self._final, self._pending)

    def _run_final_hook(self, final: RequestOutput, out: RequestOutput | None) -> None:
        """Lock held: ``_final_hook`` on ``final`` and on ``out`` if that is the stream's
        full last output (FINAL_ONLY or CUMULATIVE)."""
        hook = self._final_hook
        assert hook is not None
        targets = [final]
        if (
            out is not None
            and out is not final
            and out.finished
            and self.sampling_params.output_kind is not RequestOutputKind.DELTA
        ):
            targets.append(out)
        for target in targets:
            try:
                hook(target)
            except Exception:  # a hook must not break output processing
                logger.exception("final-output hook of request %r failed", self.request_id)

    def add_done_callback(self, cb: Callable[[RequestHandle], None]) -> None:
        """Run ``cb(handle)`` once the final output is delivered (at once if it was).

        It runs on the engine's loop thread just after the final output is published and
        the handle's waiters are woken, so ``result()`` on another thread may return a
        moment before it has run.
        """
        with self._cond:
            if self._final is None:
                self._done_callbacks.append(cb)
                return
        cb(self)

    # ------------------------------------------------------------------ taking

    _NOTHING: Any = object()

    def _take_locked(self) -> RequestOutput | None | Any:
        """Next stream output, None when the stream has ended, _NOTHING to wait."""
        if self._pending is not None:
            out, self._pending = self._pending, None
            if out.finished:
                self._stream_done = True
            return out
        if self._error is not None:
            raise EngineDeadError(str(self._error))
        if self._stream_done or self._final is not None:
            return None
        return self._NOTHING

    def _claim_consumer(self) -> None:
        with self._cond:
            if self._consumer_claimed:
                raise RuntimeError(
                    f"Request {self.request_id!r} is already being iterated; a handle "
                    "supports one consumer (use result() or text alongside it)."
                )
            self._consumer_claimed = True

    # ---------------------------------------------------------------- sync API

    def __iter__(self) -> Iterator[RequestOutput]:
        self._claim_consumer()
        return self._sync_stream()

    def _sync_stream(self) -> Generator[RequestOutput, None, None]:
        me = threading.get_ident()
        completed = False
        try:
            while True:
                out = self._next_sync()
                if out is None:
                    completed = True
                    return
                completed = out.finished
                yield out
                if completed:
                    return
        except KeyboardInterrupt:
            completed = True
            self._cancel_quietly(block=True)
            raise
        finally:
            if not completed:
                # Left early (break, exception, close): cancel, confirmed when we can block.
                self._cancel_quietly(block=threading.get_ident() == me)

    def _next_sync(self) -> RequestOutput | None:
        with self._cond:
            while True:
                out = self._take_locked()
                if out is not self._NOTHING:
                    return out
                self._cond.wait(_SYNC_WAKE_S)
                if self._pending is None and self._final is None and self._error is None:
                    self._engine.check_health()

    def result(self, timeout: float | None = None) -> RequestOutput:
        """Block until the request finishes; return its full final output.

        Raises TimeoutError after ``timeout`` seconds (the request keeps running),
        EngineDeadError if the engine failed. KeyboardInterrupt cancels the request,
        waits for the core's confirmation, and re-raises.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            with self._cond:
                while self._final is None:
                    wait = _SYNC_WAKE_S
                    if deadline is not None:
                        remaining = deadline - time.monotonic()
                        if remaining <= 0:
                            raise TimeoutError(
                                f"Request {self.request_id!r} did not finish within "
                                f"{timeout} s (status {self.status.name})."
                            )
                        wait = min(wait, remaining)
                    self._cond.wait(wait)
                    if self._final is None:
                        self._engine.check_health()
        except KeyboardInterrupt:
            self._cancel_quietly(block=True)
            raise
        if self._error is not None:
            raise EngineDeadError(str(self._error))
        return self._final

    def cancel(self, timeout: float | None = None, wait: bool = True) -> RequestOutput | None:
        """Abort this request (``engine.abort`` of this incarnation); return its final output.

        Blocks until the core confirms (TimeoutError after ``timeout``; the abort still
        completes later). ``wait=False`` only requests the abort and returns None at once
        (for UI callbacks; the final output instead if the request had already finished);
        the final output then arrives through the handle as usual.
        """
        if self._final is not None:
            return self._final
        if not wait:
            self._engine.abort_handle_nowait(self)
            return None  # even if the abort was confirmed meanwhile: as documented
        return self._engine.abort_handle(self, timeout)

    def _cancel_quietly(self, block: bool) -> None:
        if self._final is not None:
            return
        try:
            if block and not self._engine.on_engine_thread():
                self._engine.abort_handle(self, None)
            else:
                self._engine.abort_handle_nowait(self)
        except Exception:  # the engine is gone: nothing left to cancel
            logger.debug("cancel of %r after early exit failed", self.request_id, exc_info=True)

    # --------------------------------------------------------------- async API

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        self._claim_consumer()
        return _AsyncStream(self)

    async def _wait_async(self, ready: Callable[[], bool], until: float | None = None) -> bool:
        """Wait on the caller's loop until ``ready()`` (checked under the lock); True then.

        With ``until`` (a ``time.monotonic()`` reading) the wait is shielded from
        cancellation and returns False once ``until`` passes.
        """
        while True:
            with self._cond:
                if ready():
                    return True
                timeout = next_wait_s(until)
                if timeout is None:
                    return False
                wake, wait = make_async_waiter(shielded=until is not None)
                self._wakers.append(wake)
            try:
                await wait(timeout)
            finally:
                with self._cond:
                    if wake in self._wakers:
                        self._wakers.remove(wake)
            with self._cond:
                if ready():
                    return True
            self._engine.check_health()

    async def _leave_async(self, exc: BaseException) -> None:
        """``exc`` leaves an async wait on this live request: the request must not run on.

        A cancellation or ``KeyboardInterrupt`` aborts it and awaits the core's
        confirmation, shielded, for at most ``ABORT_CONFIRM_S``, so whoever catches the
        exception finds the request FINISHED_ABORTED and its id free, as in the sync path
        (docs/lifecycle.md). Other exceptions (a dead engine) only schedule the abort.
        """
        if interrupts_the_caller(exc):
            await self._abort_confirmed()
        else:
            self._cancel_quietly(block=False)

    async def _abort_confirmed(self) -> None:
        """Abort this request and await its final output, shielded and bounded."""
        if self._final is not None:
            return
        self._cancel_quietly(block=False)
        try:
            confirmed = await self._wait_async(
                lambda: self._final is not None, time.monotonic() + ABORT_CONFIRM_S
            )
        except Exception:  # the engine died meanwhile: its requests are failed, not waited
            logger.debug("awaiting the abort of %r failed", self.request_id, exc_info=True)
            return
        if not confirmed:
            logger.warning(
                "the abort of request %r was not confirmed within %s s; it completes later",
                self.request_id,
                ABORT_CONFIRM_S,
            )

    async def _next_async(self) -> RequestOutput | None:
        box: list[Any] = []

        def ready() -> bool:
            out = self._take_locked()
            if out is self._NOTHING:
                return False
            box.append(out)
            return True

        await self._wait_async(ready)
        return cast("RequestOutput | None", box[0])  # ready() took an output, not _NOTHING

    async def result_async(self) -> RequestOutput:
        """``await h``: wait for the final output on any asyncio or trio loop.

        Cancelling the awaiting task aborts the request (as leaving ``async for`` early
        does; vLLM's ``AsyncLLM.generate`` behaves the same): the request ends
        FINISHED_ABORTED, and the task sees ``CancelledError`` once the core has confirmed
        it (a ``KeyboardInterrupt`` likewise). Shield the await (``asyncio.shield``) to let
        the request run on.
        """
        try:
            await self._wait_async(lambda: self._final is not None)
        except BaseException as exc:
            await self._leave_async(exc)
            raise
        if self._error is not None:
            raise EngineDeadError(str(self._error))
        assert self._final is not None
        return self._final

    def __await__(self) -> Generator[Any, None, RequestOutput]:
        return self.result_async().__await__()

    async def cancel_async(self) -> RequestOutput | None:
        """Abort this request and await the core's confirmation; return the final output."""
        if self._final is not None:
            return self._final
        return await self._engine.abort_handle_async(self)


class _AsyncStream:
    """The async iterator of one handle; leaving it early cancels the request."""

    __slots__ = ("_handle", "_done", "__weakref__")

    def __init__(self, handle: RequestHandle) -> None:
        self._handle = handle
        self._done = False

    def __aiter__(self) -> _AsyncStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            out = await self._handle._next_async()
        except BaseException as exc:
            # Cancelled task, KeyboardInterrupt, dead engine: the request must not run on.
            self._done = True
            await self._handle._leave_async(exc)
            raise
        if out is None:
            self._done = True
            raise StopAsyncIteration
        if out.finished:
            self._done = True
        return out

    async def aclose(self) -> None:
        """Leave the stream: abort the request and await the core's confirmation."""
        if not self._done:
            self._done = True
            await self._handle._abort_confirmed()

    def __del__(self) -> None:
        # `break` out of `async for` drops the iterator: cancel what is still running.
        if not self._done:
            self._done = True
            try:
                self._handle._cancel_quietly(block=False)
            except Exception:
                pass
