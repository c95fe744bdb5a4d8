"""The loop bridge: how other threads reach an engine's ``nbengine-loop`` thread.

docs/architecture.md, "Threads": all frontend state lives on the loop thread, an anyio
blocking portal (asyncio backend). ``LoopBridge`` owns that portal and every crossing
onto it: a short sync call from a caller's thread (``call``), a fire-and-forget call
from any thread (``call_soon``, what the core thread uses), and the waits for a
future the loop resolves, sync (``wait_future``) and async on any asyncio or trio loop
(``await_future``). Waits wake every fraction of a second to check that something is
still alive to resolve them (``check_health``): nothing an engine thread does may hang
a caller forever.

``client_callbacks`` are the core client's hooks into an engine (core thread -> loop);
``reap_engine`` is the finalizer of an engine dropped without ``shutdown()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from typing import TYPE_CHECKING, Any, TypeVar

import anyio.from_thread

from nbengine.core.client import CoreClient
from nbengine.core.messages import EngineCoreOutputs
from nbengine.frontend.waiter import (
    ABORT_CONFIRM_S,
    interrupts_the_caller,
    make_async_waiter,
    next_wait_s,
)
from nbengine.request import EngineDeadError

if TYPE_CHECKING:
    from nbengine.frontend.engine import Engine

__all__ = ["LoopBridge", "client_callbacks", "reap_engine", "wait_for_reapers"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

_WAKE_S = 0.1
_CORE_DEATH_GRACE_S = 2.0  # a dead core thread whose failure the loop has not delivered


def _boxed(fn: Callable[..., T], *args: Any) -> tuple[T]:
    return (fn(*args),)


class LoopBridge:
    """The loop thread of one engine and the calls that cross onto it.

    ``closed()`` and ``dead_reason()`` read the engine's state (whether it was shut down,
    why it can no longer serve); they must not keep the engine alive.
    """

    def __init__(
        self,
        client: CoreClient,
        exit_stack: contextlib.ExitStack,
        closed: Callable[[], bool],
        dead_reason: Callable[[], str | None],
    ) -> None:
        self._client = client
        self._closed = closed
        self._dead_reason = dead_reason
        # Closed with the exit stack (Engine.shutdown, or the reaper).
        self.portal = exit_stack.enter_context(
            anyio.from_thread.start_blocking_portal("asyncio", name="nbengine-loop")
        )
        self.loop: asyncio.AbstractEventLoop = self.portal.call(asyncio.get_running_loop)
        self.thread: threading.Thread = self.portal.call(threading.current_thread)
        self._core_dead_since: float | None = None

    @classmethod
    def start(
        cls,
        client: CoreClient,
        closed: Callable[[], bool],
        dead_reason: Callable[[], str | None],
    ) -> tuple[LoopBridge, contextlib.ExitStack]:
        """Start the loop thread; the bridge and the exit stack that stops it. If the
        loop cannot start, ``client`` is shut down before the error propagates."""
        exit_stack = contextlib.ExitStack()
        try:
            return cls(client, exit_stack, closed, dead_reason), exit_stack
        except BaseException:
            exit_stack.close()
            client.shutdown(10.0)
            raise

    def _dead_error(self, default: str) -> EngineDeadError:
        return EngineDeadError(self._dead_reason() or default)

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the loop soon; returns at once, from any thread."""
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed (shutdown)
            logger.debug("engine loop closed; dropped %s", getattr(fn, "__name__", fn))

    def on_engine_thread(self) -> bool:
        """True on the loop thread or one of the core client's threads (never block there)."""
        t = threading.current_thread()
        return t is self.thread or self._client.owns_thread(t)

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a short sync function on the loop thread and return its result."""
        if threading.current_thread() is self.thread:
            return fn(*args)
        if self._closed():
            raise self._dead_error("The engine has been shut down.")
        try:
            # Boxed: the portal would await an awaitable result (a RequestHandle is one).
            return self.portal.call(_boxed, fn, *args)[0]
        except RuntimeError as exc:
            if not self.thread.is_alive() or self._closed():
                raise self._dead_error("The engine has been shut down.") from exc
            raise

    def check_health(self) -> None:
        """Raise EngineDeadError if nothing will ever wake a waiter (threads gone)."""
        if not self.thread.is_alive():
            raise self._dead_error("The engine loop thread is gone.")
        if self._client.is_alive():
            self._core_dead_since = None
            return
        now = time.monotonic()
        if self._core_dead_since is None:
            self._core_dead_since = now
        elif now - self._core_dead_since > _CORE_DEATH_GRACE_S:
            raise self._dead_error("The engine core thread is gone.")

    def wait_future(self, fut: Future[T], deadline: float | None, what: str) -> T:
        """Block until the loop resolves ``fut``; TimeoutError (naming ``what``) after
        ``deadline`` (a ``time.monotonic()`` reading), EngineDeadError if nothing will."""
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
                self.check_health()

    async def await_future(self, fut: Future[T]) -> T:
        """``wait_future`` for a coroutine on any asyncio or trio loop (see ``await_all``)."""
        await self.await_all([fut])
        return fut.result()

    async def await_all(self, futures: Sequence[Future[T] | None]) -> list[T | None]:
        """Await the abort confirmations ``futures`` (None: nothing to await) on any asyncio
        or trio loop; their results, in order.

        A cancellation or ``KeyboardInterrupt`` meanwhile does not cut them short: they
        are awaited on, shielded, for at most ``ABORT_CONFIRM_S`` before it propagates
        (docs/lifecycle.md), so its catcher finds every abort it asked for confirmed.
        """
        pending = [f for f in futures if f is not None]
        try:
            await self._await_done(pending, None)
        except BaseException as exc:
            if interrupts_the_caller(exc):
                await self._await_done_quietly(pending)
            raise
        return [None if f is None else f.result() for f in futures]

    async def _await_done(self, futures: list[Future[T]], until: float | None) -> bool:
        """Wait until every future is done (True), shielded and giving up at ``until``
        (a ``time.monotonic()`` reading; False then) when it is given."""
        for fut in futures:
            while not fut.done():
                timeout = next_wait_s(until)
                if timeout is None:
                    return False
                wake, wait = make_async_waiter(shielded=until is not None)
                fut.add_done_callback(_call_ignoring_future(wake))
                await wait(timeout)
                if not fut.done():
                    self.check_health()
        return True

    async def _await_done_quietly(self, futures: list[Future[T]]) -> None:
        """``_await_done``, shielded and bounded, while an interruption propagates."""
        try:
            confirmed = await self._await_done(futures, time.monotonic() + ABORT_CONFIRM_S)
        except Exception:  # the engine died meanwhile: nothing will confirm
            logger.debug("awaiting an abort's confirmation failed", exc_info=True)
            return
        if not confirmed:
            logger.warning(
                "an abort was not confirmed within %s s; it completes later", ABORT_CONFIRM_S
            )


def _call_ignoring_future(fn: Callable[[], None]) -> Callable[[Future[Any]], None]:
    """A done-callback that calls ``fn`` (bound now: each wait has its own waker)."""
    return lambda _f: fn()


def client_callbacks(
    engine_ref: weakref.ref[Engine],
) -> tuple[
    Callable[[EngineCoreOutputs], None],
    Callable[[str | None], None],
    Callable[[set[str], str], None],
    Callable[[str, int], None],
]:
    """``emit``, ``on_exit``, ``fail_keys`` and ``on_routed`` for the core client.

    They hold the Engine only weakly: an engine that nobody references any more (its
    notebook cell was re-executed) can be garbage-collected, and its finalizer
    (``reap_engine``) then stops the client's threads and frees the model.
    """

    def emit(outputs: EngineCoreOutputs) -> None:  # the core thread: never block
        engine = engine_ref()
        if engine is not None:
            engine._bridge.call_soon(engine._registry.process, outputs)

    def on_exit(error: str | None) -> None:
        engine = engine_ref()
        if engine is not None:
            engine._bridge.call_soon(engine._on_core_exit, error)

    def fail(keys: set[str], message: str) -> None:
        engine = engine_ref()
        if engine is not None:
            engine._bridge.call_soon(engine._registry.fail_keys, keys, message)

    def routed(key: str, replica: int) -> None:  # called on the loop thread
        engine = engine_ref()
        if engine is not None:
            engine._observers.on_routed(key, replica)

    return emit, on_exit, fail, routed


REAP_TIMEOUT_S = 10.0  # how long a reaper waits for the core thread to stop

_reapers: set[threading.Thread] = set()
_reapers_lock = threading.Lock()


def reap_engine(client: CoreClient, exit_stack: contextlib.ExitStack) -> None:
    """Finalizer of an Engine garbage-collected without ``shutdown()``.

    The GC may run it on any thread, the engine's own included, so the blocking part
    (stop the core client, free the model, stop the loop) runs on a short-lived thread;
    interpreter exit waits for it (``wait_for_reapers``).
    """

    def reap() -> None:
        try:
            client.shutdown(REAP_TIMEOUT_S)
            exit_stack.close()
        except Exception:
            logger.exception("reaping an unreferenced engine failed")
        finally:
            with _reapers_lock:
                _reapers.discard(threading.current_thread())

    thread = threading.Thread(target=reap, name="nbengine-reaper", daemon=True)
    with _reapers_lock:  # started under the lock: wait_for_reapers never joins it unstarted
        _reapers.add(thread)
        thread.start()


def wait_for_reapers(timeout: float) -> bool:
    """Wait until every reaper thread has freed its engine (at most ``timeout`` seconds in
    all); True when none is left.

    Interpreter exit must not overtake a reaper: once the interpreter finalizes, a daemon
    thread that asks for the GIL is ended on the spot, and one ended while freeing the
    model's tensors (whose deleters take the GIL from C++) aborts the whole process
    ("terminate called without an active exception")."""
    deadline = time.monotonic() + timeout
    with _reapers_lock:
        threads = list(_reapers)
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    with _reapers_lock:
        return not _reapers
