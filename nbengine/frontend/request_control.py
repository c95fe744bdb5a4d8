"""``RequestControl``: submission and aborts of one engine's requests; the handles' owner.

It runs on the caller's thread and reaches the loop thread's state (``RequestRegistry``)
only through the ``LoopBridge``: ``portal.call`` to register or to start aborts,
``call_soon`` for the calls that return at once (docs/architecture.md, "Threads").

Every abort starts the same way (``_start``): one loop call that returns a future per
request (None: nothing to wait for). The sync call then waits for the futures, the async
call awaits them, the nowait calls schedule the start and return. A caller on one of the
engine's own threads never waits (it would deadlock the loop): it gets what is known.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, TypeVar

from nbengine.frontend.handles import RequestHandle
from nbengine.frontend.input_processor import PreparedRequest
from nbengine.frontend.loop_bridge import LoopBridge
from nbengine.frontend.registry import RequestRegistry
from nbengine.outputs import RequestOutput
from nbengine.request import EngineDeadError

if TYPE_CHECKING:
    from nbengine.dashboard.monitor import EngineMonitor
    from nbengine.frontend.notebook import NotebookFacade

__all__ = ["RequestControl", "normalise_ids"]

logger = logging.getLogger(__name__)

T = TypeVar("T")
AbortResult = RequestOutput | list[RequestOutput | None] | None


def normalise_ids(request_ids: str | Iterable[str]) -> tuple[list[str], bool]:
    """``(ids, single)``: one id or an iterable of ids, each checked to be a string."""
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


class RequestControl:
    """Starts, withdraws and aborts the requests of one engine (``handles.HandleOwner``).

    ``anchor`` is the engine: a live handle keeps it alive through ``anchor`` (the control
    itself holds it only weakly, so dropping the last user reference still frees the
    engine at once). ``closed`` says whether ``shutdown()`` has begun.
    """

    def __init__(
        self,
        bridge: LoopBridge,
        registry: RequestRegistry,
        anchor: NotebookFacade,
        closed: Callable[[], bool],
    ) -> None:
        self._bridge = bridge
        self._registry = registry
        self._anchor = weakref.ref(anchor)
        self._closed = closed

    # ------------------------------------------------------- handles.HandleOwner

    @property
    def monitor(self) -> EngineMonitor:
        """The engine's metrics and widgets (``widget()`` asks it for one)."""
        engine = self._anchor()
        if engine is None:
            raise EngineDeadError("The engine of this request no longer exists.")
        return engine.monitor

    @property
    def anchor(self) -> object:
        """The engine a live handle keeps alive (docs/reliability.md)."""
        return self._anchor()

    @property
    def is_alive(self) -> bool:
        """False once the engine failed or ``shutdown()`` began."""
        return self._registry.dead is None and not self._closed()

    def on_engine_thread(self) -> bool:
        """True on one of the engine's own threads, where nothing may block."""
        return self._bridge.on_engine_thread()

    def check_health(self) -> None:
        """Raise EngineDeadError if nothing will ever deliver outputs again (the loop
        thread is gone, or the core is gone without its failure reaching the loop)."""
        self._bridge.check_health()

    # ---------------------------------------------------------------- submission

    def submit(self, prep: PreparedRequest) -> RequestHandle:
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

    def submit_all(self, prepared: list[PreparedRequest]) -> list[RequestHandle]:
        """``submit`` each in order; an exception or interrupt meanwhile cancels those
        already started, then propagates."""
        handles: list[RequestHandle] = []
        try:
            for prep in prepared:
                handles.append(self.submit(prep))
        except BaseException:
            for h in handles:
                if not h.done():
                    try:
                        h.cancel()
                    except Exception:
                        pass
            raise
        return handles

    def _withdraw(self, prep: PreparedRequest) -> None:
        """Undo a registration whose caller was interrupted (see ``submit``)."""
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

    # -------------------------------------------------------------------- aborts

    def _start(self, fn: Callable[..., T], *args: Any, nowait: bool = False) -> T | None:
        """The one abort start: ``fn(*args)`` on the loop. With ``nowait`` it is only
        scheduled (None); else its result (the futures to wait for), or None when the
        engine is dead (nothing is left to abort)."""
        if nowait:
            self._bridge.call_soon(fn, *args)
            return None
        try:
            return self._bridge.call(fn, *args)
        except EngineDeadError:
            return None

    def _wait(
        self, futures: list[Future[RequestOutput] | None], timeout: float | None, what: list[str]
    ) -> list[RequestOutput | None]:
        """Block for ``futures`` (TimeoutError once ``timeout`` passes); on the engine's
        own threads, return what is known at once instead."""
        if self.on_engine_thread():
            return [f.result() if f is not None and f.done() else None for f in futures]
        deadline = None if timeout is None else time.monotonic() + timeout
        return [
            None if f is None else self._bridge.wait_future(f, deadline, label)
            for label, f in zip(what, futures)
        ]

    def abort(self, request_ids: str | Iterable[str], timeout: float | None) -> AbortResult:
        """``Engine.abort``."""
        ids, single = normalise_ids(request_ids)
        futures = self._start(self._registry.start_aborts, ids)
        if futures is None:
            return None if single else [None] * len(ids)
        results = self._wait(futures, timeout, [f"abort of {rid!r}" for rid in ids])
        return results[0] if single else results

    async def abort_async(self, request_ids: str | Iterable[str]) -> AbortResult:
        """``Engine.abort_async``."""
        ids, single = normalise_ids(request_ids)
        futures = self._start(self._registry.start_aborts, ids)
        if futures is None:
            return None if single else [None] * len(ids)
        results = await self._bridge.await_all(futures)
        return results[0] if single else results

    def abort_nowait(self, request_id: str, key: str | None) -> None:
        """``Engine.abort_nowait``."""
        if self.is_alive:
            self._start(self._registry.abort_where, request_id, key, nowait=True)

    def abort_all_nowait(self) -> None:
        """``Engine.abort_all_nowait``."""
        if self.is_alive:
            self._start(self._registry.abort_all, nowait=True)

    def _start_handle(self, handle: RequestHandle) -> Future[RequestOutput] | None:
        """Start aborting ``handle``'s incarnation; None if there is nothing to wait for
        (its final output is in, or the engine is dead)."""
        if handle.final_output is not None:
            return None
        return self._start(self._registry.start_abort_handle, handle)

    def abort_handle(self, handle: RequestHandle, timeout: float | None) -> RequestOutput | None:
        """``handle.cancel()``: abort its incarnation, wait for the confirmation."""
        if handle.final_output is None and self.on_engine_thread():
            self.abort_handle_nowait(handle)  # never block the engine's own threads
            return handle.final_output
        fut = self._start_handle(handle)
        if fut is not None:
            (out,) = self._wait([fut], timeout, [f"cancel of {handle.request_id!r}"])
            return out
        return handle.final_output

    def abort_handle_nowait(self, handle: RequestHandle) -> None:
        """``handle.cancel(wait=False)``: schedule the abort, return at once."""
        if handle.final_output is None and not self._closed():
            self._start(self._registry.start_abort_handle, handle, nowait=True)

    async def abort_handle_async(self, handle: RequestHandle) -> RequestOutput | None:
        """``await handle.cancel_async()``."""
        fut = self._start_handle(handle)
        if fut is not None:
            return await self._bridge.await_future(fut)
        return handle.final_output
