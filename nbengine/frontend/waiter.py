"""A wake-up call from any thread to a coroutine waiting on asyncio or trio.

``make_async_waiter()`` returns ``(wake, wait)`` bound to the running event loop:
``wake()`` may be called from any thread (the engine's loop thread delivers outputs
with it) and ``await wait(timeout)`` returns when woken or after ``timeout`` seconds.

Cancellation invariant (docs/lifecycle.md, "Cancelling a consumer"): a task cancelled
while it awaits ``wait`` always sees ``CancelledError``, even when the wake-up arrives
in the same loop iteration. ``asyncio.wait_for`` does not promise that before Python
3.12: when its inner wait completes as the outer task is cancelled it can return the
inner result and drop the cancellation. So the asyncio waiter awaits one plain future,
resolved by the wake-up or by a ``call_later`` timer; ``Task.cancel()`` on a task that
awaits a future either cancels the future or, if it is already done, marks the task to
raise ``CancelledError`` at its next step. That holds on every supported version.

``make_async_waiter(shielded=True)`` gives a ``wait`` that no cancellation ends early:
what a coroutine awaits while a cancellation or ``KeyboardInterrupt`` propagates through
it, to see the abort it started confirmed before the exception goes on
(docs/lifecycle.md, "Interrupts"). On asyncio it awaits ``asyncio.shield`` of its
future again after each cancellation; the caller's re-raised exception carries the
cancellations it absorbed (a task's ``cancelling()`` count on 3.11+ is left as the
cancellers made it, so ``asyncio.timeout`` and ``asyncio.run`` read it right). On trio
it waits in a shielded cancel scope. A ``KeyboardInterrupt`` raised inside such a wait
(a second Ctrl-C) still ends it at once.

This module imports only the standard library and sniffio (and uses anyio only where
anyio is already imported), so its behaviour can be checked under other interpreters
(tests/frontend/test_waiter.py, tests/frontend/test_async_interrupts.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import sniffio

__all__ = [
    "ABORT_CONFIRM_S",
    "ASYNC_WAKE_S",
    "interrupts_the_caller",
    "make_async_waiter",
    "next_wait_s",
]

WakeFn = Callable[[], None]
WaitFn = Callable[[float], Awaitable[None]]

# How long a cancelled or interrupted coroutine waits (shielded) for the core to confirm
# the abort of its request before the exception goes on; the core confirms within one
# engine step, and the abort completes later if this passes (docs/lifecycle.md).
ABORT_CONFIRM_S = 10.0

# How long one async wait sleeps before its caller looks at the engine's health again,
# when nothing woke it earlier.
ASYNC_WAKE_S = 0.25


def next_wait_s(until: float | None) -> float | None:
    """How long the next wait may sleep: ``ASYNC_WAKE_S``, cut to the time left before
    ``until`` (a ``time.monotonic()`` reading) when one is given; None once it passed."""
    if until is None:
        return ASYNC_WAKE_S
    left = until - time.monotonic()
    return min(ASYNC_WAKE_S, left) if left > 0 else None


def interrupts_the_caller(exc: BaseException) -> bool:
    """True for a cancellation (asyncio's or trio's), ``KeyboardInterrupt`` or
    ``SystemExit``: an exception that may await a shielded wait before it propagates.

    Ordinary exceptions (a dead engine, no supported event loop) and ``GeneratorExit``
    (a coroutine being closed, which may not await) are not.
    """
    return not isinstance(exc, (Exception, GeneratorExit))


def make_async_waiter(shielded: bool = False) -> tuple[WakeFn, WaitFn]:
    """A ``(wake, wait)`` pair for the running asyncio or trio loop; ``wake`` is thread-safe.

    With ``shielded=True``, cancelling the waiting task does not end ``wait`` (only the
    wake-up or the timeout does): use it only where a cancellation is already being
    propagated and will be re-raised after the wait.
    """
    lib = sniffio.current_async_library()
    if lib == "trio":
        return _trio_waiter(shielded)
    if lib != "asyncio":
        raise RuntimeError(f"nbengine supports asyncio and trio, not {lib}.")
    return _asyncio_waiter(shielded)


def _asyncio_waiter(shielded: bool) -> tuple[WakeFn, WaitFn]:
    loop = asyncio.get_running_loop()
    woken: asyncio.Future[None] = loop.create_future()

    def resolve() -> None:  # on the consumer's loop
        if not woken.done():
            woken.set_result(None)

    def wake() -> None:
        try:
            loop.call_soon_threadsafe(resolve)
        except RuntimeError:  # the consumer's loop is closed
            pass

    async def wait(timeout: float) -> None:
        timer = loop.call_later(timeout, resolve)
        try:
            await woken
        finally:
            timer.cancel()

    async def wait_shielded(timeout: float) -> None:
        timer = loop.call_later(timeout, resolve)
        try:
            with _anyio_shield():
                while not woken.done():
                    try:
                        # A cancellation cancels the shield, never ``woken``: wait on.
                        await asyncio.shield(woken)
                    except asyncio.CancelledError:
                        continue
        finally:
            timer.cancel()

    return wake, (wait_shielded if shielded else wait)


def _anyio_shield() -> contextlib.AbstractContextManager[Any]:
    """A shielded anyio cancel scope where anyio is in use, else nothing.

    anyio's cancel scopes on asyncio cancel a waiting task again at every loop iteration
    until it leaves the scope: without this, a shielded wait inside one (the server's
    task groups) would spin until woken. Plain ``task.cancel()`` still reaches the wait
    through it, and the loop above absorbs that.
    """
    anyio = sys.modules.get("anyio")
    if anyio is None:
        return contextlib.nullcontext()
    scope: contextlib.AbstractContextManager[Any] = anyio.CancelScope(shield=True)
    return scope


def _trio_waiter(shielded: bool) -> tuple[WakeFn, WaitFn]:
    import trio

    token = trio.lowlevel.current_trio_token()
    event = trio.Event()

    def wake() -> None:
        try:
            token.run_sync_soon(event.set)
        except trio.RunFinishedError:
            pass

    async def wait(timeout: float) -> None:
        # trio's cancellation is level-triggered: a cancelled scope always raises (and
        # raises again at the caller's next checkpoint after a shielded wait).
        with trio.CancelScope(shield=shielded), trio.move_on_after(timeout):
            await event.wait()

    return wake, wait
