"""Stress the async waiter's cancellation promise; run as a script under any Python.

``python waiter_harness.py PATH/TO/waiter.py [--wait-for]`` loads ``waiter.py`` by path
(it needs only the standard library and sniffio), then cancels 400 tasks that wait on
it, each time with the wake-up racing the cancellation in a different order (woken in
the same loop iteration, one iteration earlier, from another thread, or after).
It prints ``swallowed N of 400``: the cancels that returned True (the task was not done)
but whose task then returned normally. ``--wait-for`` runs the same trials against a
waiter built on ``asyncio.wait_for`` (nbengine's earlier one) as a control.
"""

from __future__ import annotations

import asyncio
import importlib.util
import random
import sys
import threading
import time
from collections.abc import Awaitable, Callable

TRIALS = 400


def wait_for_waiter() -> tuple[Callable[[], None], Callable[[float], Awaitable[None]]]:
    loop = asyncio.get_running_loop()
    event = asyncio.Event()

    def wake() -> None:
        loop.call_soon_threadsafe(event.set)

    async def wait(timeout: float) -> None:
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    return wake, wait


async def trials(
    make: Callable[[], tuple[Callable[[], None], Callable[[float], Awaitable[None]]]],
) -> int:
    rng = random.Random(1)
    swallowed = 0
    for i in range(TRIALS):
        wake, wait = make()

        async def consumer(wait: Callable[[float], Awaitable[None]] = wait) -> str:
            await wait(5.0)
            return "woken"

        task = asyncio.ensure_future(consumer())
        for _ in range(rng.randrange(3)):
            await asyncio.sleep(0)
        mode = i % 4
        if mode == 0:
            wake()
            cancelled = task.cancel()
        elif mode == 1:
            wake()
            await asyncio.sleep(0)
            cancelled = task.cancel()
        elif mode == 2:
            delay = rng.random() * 0.0005
            waker = threading.Thread(
                target=lambda delay=delay, wake=wake: (time.sleep(delay), wake())
            )
            waker.start()
            await asyncio.sleep(rng.random() * 0.0005)
            cancelled = task.cancel()
            waker.join()
        else:
            cancelled = task.cancel()
            wake()
        try:
            await task
        except asyncio.CancelledError:
            continue
        swallowed += cancelled
    return swallowed


def main() -> None:
    spec = importlib.util.spec_from_file_location("nbengine_waiter", sys.argv[1])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    make = wait_for_waiter if "--wait-for" in sys.argv[2:] else module.make_async_waiter
    swallowed = asyncio.run(trials(make))
    print(f"{sys.version_info[0]}.{sys.version_info[1]} swallowed {swallowed} of {TRIALS}")


if __name__ == "__main__":
    main()
