"""A real SIGINT while a coroutine waits on a request; run in its own process.

``python interrupt_worker.py MODEL_DIR RUNNER WAY`` (test_async_interrupts.py runs it):
one engine, one request that runs until aborted, and a coroutine that waits on it with
``WAY`` (``await``: ``await h``; ``aiter``: ``async for out in h``) under ``RUNNER``:

- ``asyncio``: ``asyncio.run`` of this interpreter (on 3.11+ its SIGINT handler cancels
  the main task, and ``asyncio.run`` then raises ``KeyboardInterrupt``);
- ``asyncio-plain``: an event loop without that handler, run and cleaned up as Python
  3.10's ``asyncio.run`` does (``KeyboardInterrupt`` is raised in the loop or in the
  coroutine; the clean-up then cancels the tasks left pending);
- ``trio``: ``trio.run`` (trio delivers ``KeyboardInterrupt`` to its main task).

Once the request has a token, a timer thread sends SIGINT to this process. The worker
prints one JSON line: what reached the caller of the runner, the request's status seen
right after catching it, and how a request reusing the id at once finished.
"""

from __future__ import annotations

import asyncio
import faulthandler
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import nbengine as nb

HANG_GUARD_S = 240.0


def run_plain_asyncio(main: Callable[[], Awaitable[Any]]) -> Any:
    """``asyncio.run`` as Python 3.10 has it: no SIGINT handler, pending tasks are
    cancelled and run to completion after the main coroutine stops, whatever stopped it."""
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(main())
    finally:
        try:
            pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for task in pending:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        finally:
            loop.close()


def interrupt_after_first_token(h: nb.RequestHandle) -> None:
    """SIGINT to this process once ``h`` has produced a token (from a timer thread)."""

    def fire() -> None:
        deadline = time.monotonic() + 60.0
        while not h.token_ids and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(0.05)  # the consumer is waiting again by now
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=fire, daemon=True).start()


def main() -> None:
    model_dir, runner, way = sys.argv[1:4]
    faulthandler.dump_traceback_later(HANG_GUARD_S, exit=True)
    import torch

    torch.set_num_threads(1)  # a test process on a shared 2-core machine
    with nb.Engine(
        model_dir, num_kv_blocks=1024, block_size=16, max_num_seqs=8, max_num_batched_tokens=256
    ) as engine:
        params = nb.SamplingParams(
            max_tokens=100_000, ignore_eos=True, output_kind=nb.RequestOutputKind.DELTA
        )
        handles: list[nb.RequestHandle] = []

        async def consume() -> None:
            h = engine.generate("Once upon a time", params, request_id="intr")
            handles.append(h)
            interrupt_after_first_token(h)
            if way == "await":
                await h
            else:
                async for _ in h:
                    pass

        raised = "nothing"
        try:
            if runner == "asyncio":
                asyncio.run(consume())
            elif runner == "asyncio-plain":
                run_plain_asyncio(consume)
            else:
                import trio

                trio.run(consume)
        except BaseException as exc:  # what reached the caller of the runner
            raised = type(exc).__name__
        status = handles[0].status.name  # read at once: nothing has been awaited since
        try:
            reuse = engine.generate(
                "Once upon a time",
                nb.SamplingParams(max_tokens=3, ignore_eos=True),
                request_id="intr",
            )
            reused = str(reuse.result(timeout=60).outputs[0].finish_reason)
        except Exception as exc:  # RequestIdInUseError while the first is not confirmed
            reused = type(exc).__name__
    print(json.dumps({"raised": raised, "status": status, "reused": reused}), flush=True)


if __name__ == "__main__":
    main()
