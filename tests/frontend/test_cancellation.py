"""Cancelling an asyncio task that consumes a handle always cancels (docs/lifecycle.md).

The task sees ``CancelledError`` every time, and the request ends FINISHED_ABORTED with
the core's confirmation before the task ends, whichever moment the cancellation lands
at: while the task waits for a token, as a token is delivered, or between two tokens.
"""

from __future__ import annotations

import asyncio
import random

import nbengine as nb
from nbengine import RequestOutputKind as Kind
from nbengine import RequestStatus as S

from support.requests import long_params

TRIALS = 100


async def _consume(
    engine: nb.Engine, h: nb.RequestHandle, mode: str, started: asyncio.Event
) -> None:
    if mode == "async for":
        async for _out in h:
            started.set()
    elif mode == "await":
        started.set()
        await h
    else:  # "abort_async": cancelled while awaiting the core's confirmation
        async for _out in h:
            started.set()
            await engine.abort_async(h.request_id)


def test_cancelled_consumer_tasks_always_see_cancellation(engine: nb.Engine) -> None:
    rng = random.Random(7)
    modes = ["async for", "await", "abort_async"]

    async def main() -> list[tuple[str, bool, S, str | None]]:
        results = []
        for i in range(TRIALS):
            mode = modes[i % len(modes)]
            h = engine.generate(
                "Once upon", long_params(output_kind=Kind.DELTA), request_id=f"cancel-{i}"
            )
            started = asyncio.Event()
            task = asyncio.ensure_future(_consume(engine, h, mode, started))
            await asyncio.wait_for(started.wait(), 60)
            await asyncio.sleep(rng.uniform(0, 0.01))
            # False when the task had already finished (abort_async confirmed first).
            asked = task.cancel()
            done, _ = await asyncio.wait({task}, timeout=60)
            # The cancelled task ended only once the core had confirmed the abort.
            status_at_end = h.status
            final = await asyncio.wait_for(asyncio.shield(h.result_async()), 60)
            swallowed = asked and not (task in done and task.cancelled())
            results.append((mode, swallowed, status_at_end, final.outputs[0].finish_reason))
        return results

    results = asyncio.run(main())
    swallowed = [(i, r) for i, r in enumerate(results) if r[1]]
    assert swallowed == []
    assert all(r[2] is S.FINISHED_ABORTED and r[3] == "abort" for r in results), results
    assert engine.num_unfinished_requests() == 0
