"""Interrupt a coroutine that waits on nbengine's async waiter; run as a script under any Python.

``python interrupt_harness.py PATH/TO/waiter.py`` loads ``waiter.py`` by path (it needs
only the standard library and sniffio) and checks, under this interpreter's own
``asyncio.run``, what the handles build on it (docs/lifecycle.md, "Interrupts and
cancellation of async consumers"): a coroutine waiting as ``await h`` does is
interrupted by a real SIGINT, or cancelled, and awaits a confirmation that another
thread delivers later (standing in for the engine core) with ``make_async_waiter(
shielded=True)`` before it re-raises. Python 3.10 raises ``KeyboardInterrupt`` in the
loop (its clean-up then cancels the pending task) or in the coroutine; 3.11+ cancel
the main task from ``asyncio.run``'s SIGINT handler. Either way the caller must see the
exception only after the confirmation. It prints one JSON object: scenario -> outcome.
``--unshielded`` awaits the confirmation with a plain wait instead (a control: a second
cancellation then cuts it short).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import signal
import sys
import threading
import time
from types import ModuleType
from typing import Any

CONFIRM_DELAY_S = 0.3  # the stand-in core confirms an abort this long after it is asked
SHIELDED = "--unshielded" not in sys.argv[2:]


class StandInRequest:
    """A request whose abort another thread confirms ``CONFIRM_DELAY_S`` later."""

    def __init__(self, waiter: ModuleType) -> None:
        self.waiter = waiter
        self.confirmed = False
        self.wakers: list[Any] = []
        self.lock = threading.Lock()

    def _confirm(self) -> None:
        with self.lock:
            self.confirmed = True
            wakers, self.wakers = self.wakers, []
        for wake in wakers:
            wake()

    async def _wait(self, shielded: bool, timeout: float) -> None:
        with self.lock:
            if self.confirmed:
                return
            wake, wait = self.waiter.make_async_waiter(shielded=shielded)
            self.wakers.append(wake)
        await wait(timeout)

    async def wait_forever(self, signal_after: int | None = None) -> None:
        """What ``await h`` does with a request that never finishes by itself; with
        ``signal_after``, the coroutine itself raises SIGINT after that many waits (so
        Python 3.10 raises ``KeyboardInterrupt`` inside the coroutine)."""
        try:
            waits = 0
            while True:
                await self._wait(False, 0.25 if signal_after is None else 0.02)
                waits += 1
                if waits == signal_after:
                    signal.raise_signal(signal.SIGINT)
        except BaseException as exc:
            if self.waiter.interrupts_the_caller(exc):
                threading.Timer(CONFIRM_DELAY_S, self._confirm).start()
                deadline = time.monotonic() + 10.0
                while not self.confirmed and time.monotonic() < deadline:
                    await self._wait(SHIELDED, 0.25)
            raise


def sigint_soon() -> None:
    threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()


def scenario_sigint(waiter: ModuleType, nested: bool, inside: bool = False) -> dict[str, Any]:
    req = StandInRequest(waiter)

    async def main() -> None:
        if inside:
            await req.wait_forever(signal_after=5)
            return
        sigint_soon()
        if nested:  # the waiting coroutine is a child task of the main one
            await asyncio.gather(req.wait_forever())
        else:
            await req.wait_forever()

    try:
        asyncio.run(main())
        raised = "nothing"
    except BaseException as exc:
        raised = type(exc).__name__
    return {"raised": raised, "confirmed": req.confirmed}


def scenario_cancel_twice(waiter: ModuleType) -> dict[str, Any]:
    """A second cancel during the shielded wait neither ends it nor is lost."""
    req = StandInRequest(waiter)

    async def main() -> dict[str, Any]:
        task = asyncio.ensure_future(req.wait_forever())
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.sleep(0.1)
        task.cancel()
        await asyncio.wait({task}, timeout=30)
        return {"cancelled": task.cancelled(), "confirmed_at_end": req.confirmed}

    return asyncio.run(main())


def scenario_timeout(waiter: ModuleType) -> dict[str, Any]:
    """3.11+: ``asyncio.timeout`` still turns its cancellation into TimeoutError."""
    if sys.version_info < (3, 11):
        return {"skipped": True}
    req = StandInRequest(waiter)

    async def main() -> dict[str, Any]:
        try:
            async with asyncio.timeout(0.1):  # type: ignore[attr-defined]
                await req.wait_forever()
            raised = "nothing"
        except BaseException as exc:
            raised = type(exc).__name__
        task = asyncio.current_task()
        assert task is not None
        return {"raised": raised, "confirmed": req.confirmed, "cancelling": task.cancelling()}

    return asyncio.run(main())


def main() -> None:
    spec = importlib.util.spec_from_file_location("nbengine_waiter", sys.argv[1])
    assert spec is not None and spec.loader is not None
    waiter = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(waiter)
    results = {
        "sigint": scenario_sigint(waiter, nested=False),
        "sigint_nested": scenario_sigint(waiter, nested=True),
        "sigint_inside": scenario_sigint(waiter, nested=False, inside=True),
        "cancel_twice": scenario_cancel_twice(waiter),
        "timeout": scenario_timeout(waiter),
    }
    print(json.dumps(results))


if __name__ == "__main__":
    main()
