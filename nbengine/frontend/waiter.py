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

This module imports only the standard library and sniffio, so its behaviour can be
checked under other interpreters (tests/frontend/test_waiter.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import sniffio

__all__ = ["make_async_waiter"]

WakeFn = Callable[[], None]
WaitFn = Callable[[float], Awaitable[None]]


def make_async_waiter() -> tuple[WakeFn, WaitFn]:
    """A ``(wake, wait)`` pair for the running asyncio or trio loop; ``wake`` is thread-safe."""
    lib = sniffio.current_async_library()
    if lib == "trio":
        return _trio_waiter()
    if lib != "asyncio":
        raise RuntimeError(f"nbengine supports asyncio and trio, not {lib}.")
    return _asyncio_waiter()


def _asyncio_waiter() -> tuple[WakeFn, WaitFn]:
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

    return wake, wait


def _trio_waiter() -> tuple[WakeFn, WaitFn]:
    import trio

    token = trio.lowlevel.current_trio_token()
    event = trio.Event()

    def wake() -> None:
        try:
            token.run_sync_soon(event.set)
        except trio.RunFinishedError:
            pass

    async def wait(timeout: float) -> None:
        # trio's cancellation is level-triggered: a cancelled scope always raises.
        with trio.move_on_after(timeout):
            await event.wait()

    return wake, wait
