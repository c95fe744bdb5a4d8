"""Async consumers: asyncio and trio loops, on the main thread and on other threads."""

from __future__ import annotations

import asyncio
import threading

import pytest
import trio

import nbengine as nb
from nbengine import RequestOutputKind as Kind

from support.requests import long_params


def run_in_thread(fn, *args):
    box: dict[str, object] = {}

    def target() -> None:
        try:
            box["result"] = fn(*args)
        except BaseException as exc:  # pragma: no cover - re-raised below
            box["error"] = exc

    t = threading.Thread(target=target)
    t.start()
    t.join(120)
    assert not t.is_alive()
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["result"]


async def stream_text(engine: nb.Engine, prompt: str, n_tokens: int) -> tuple[str, list[int], str]:
    params = nb.SamplingParams(max_tokens=n_tokens, ignore_eos=True, seed=5, output_kind=Kind.DELTA)
    h = engine.generate(prompt, params)
    text, ids = "", []
    async for out in h:
        text += out.outputs[0].text
        ids += out.outputs[0].token_ids
    final = await h
    return text, ids, final.outputs[0].text


@pytest.mark.parametrize("where", ["main", "thread"])
def test_asyncio_iteration(engine: nb.Engine, where: str) -> None:
    async def main():
        return await asyncio.gather(*(stream_text(engine, "Once", 12) for _ in range(4)))

    res = asyncio.run(main()) if where == "main" else run_in_thread(asyncio.run, main())
    for text, ids, final_text in res:
        assert len(ids) == 12 and text == final_text == engine.tokenizer.decode(ids)


@pytest.mark.parametrize("where", ["main", "thread"])
def test_trio_iteration(engine: nb.Engine, where: str) -> None:
    async def main():
        results = []

        async def one() -> None:
            results.append(await stream_text(engine, "Hello", 10))

        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(one)
        return results

    res = trio.run(main) if where == "main" else run_in_thread(trio.run, main)
    assert len(res) == 3
    for text, ids, final_text in res:
        assert len(ids) == 10 and text == final_text == engine.tokenizer.decode(ids)


def test_cancelled_consumers_abort_their_requests(engine: nb.Engine) -> None:
    """Cancel the consumer tasks of 10 long requests (some n=3): the others are exact,
    nothing is left running, and a cancelled id can be reused."""
    N = 8

    async def main() -> None:
        started = asyncio.Event()
        counts: dict[str, int] = {}

        async def consume(rid: str, params: nb.SamplingParams) -> int:
            h = engine.generate("Once", params, request_id=rid)
            total = 0
            async for out in h:
                total += sum(len(c.token_ids) for c in out.outputs)
                counts[rid] = total
                if len(counts) >= 10:
                    started.set()
            return total

        long_tasks = [
            asyncio.create_task(
                consume(f"long-{i}", long_params(n=3 if i % 3 == 0 else 1, output_kind=Kind.DELTA))
            )
            for i in range(10)
        ]
        short = [
            asyncio.create_task(
                consume(
                    f"short-{i}",
                    nb.SamplingParams(
                        max_tokens=N, ignore_eos=True, n=1 + i % 3, output_kind=Kind.DELTA
                    ),
                )
            )
            for i in range(6)
        ]
        await asyncio.wait_for(started.wait(), 60)
        for t in long_tasks:
            t.cancel()
        for t in long_tasks:
            with pytest.raises(asyncio.CancelledError):
                await t
        for i, t in enumerate(short):
            assert await t == N * (1 + i % 3)
        # The cancellations reach the engine without blocking the consumer; wait for them.
        for _ in range(600):
            if engine.num_unfinished_requests() == 0:
                break
            await asyncio.sleep(0.05)
        assert engine.num_unfinished_requests() == 0
        h = engine.generate(
            "Once", nb.SamplingParams(max_tokens=N, ignore_eos=True), request_id="long-0"
        )
        assert len((await h).outputs[0].token_ids) == N

    asyncio.run(main())


def test_async_break_cancels_and_cancel_async_confirms(engine: nb.Engine) -> None:
    async def main() -> None:
        h = engine.generate("Hi", long_params(output_kind=Kind.DELTA), request_id="abrk")
        async for _ in h:
            break
        final = await h  # the dropped iterator cancelled the request
        assert final.outputs[0].finish_reason == "abort"
        h2 = engine.generate("Hi", long_params(), request_id="abrk")
        final2 = await h2.cancel_async()
        assert final2 is not None and final2.outputs[0].finish_reason == "abort"
        h3 = engine.generate("Hi", long_params(), request_id="abrk")
        final3 = await engine.abort_async(["abrk", "nope"])
        assert final3[0].outputs[0].finish_reason == "abort" and final3[1] is None
        assert h3.done()

    asyncio.run(main())


def test_trio_abort_async(engine: nb.Engine) -> None:
    async def main() -> None:
        h = engine.generate("Hi", long_params(), request_id="trio-ab")
        final = await engine.abort_async("trio-ab")
        assert final.outputs[0].finish_reason == "abort" and h.done()

        h2 = engine.generate("Hi", long_params(output_kind=Kind.DELTA))
        with trio.move_on_after(0.3):
            async for _ in h2:
                pass
        final2 = await h2  # the cancelled consumer cancelled the request
        assert final2.outputs[0].finish_reason == "abort"

    trio.run(main)
