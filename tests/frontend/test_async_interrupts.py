"""Interrupts and cancellations of async consumers end the request before they propagate.

docs/lifecycle.md, "Cancelling a consumer": a ``KeyboardInterrupt`` or a cancellation
that lands while a coroutine waits in ``await h`` / ``async for out in h`` (or in
``cancel_async()`` / ``abort_async()``) aborts the request and awaits the core's
confirmation before it reaches the caller, as the sync path does: the request is
``FINISHED_ABORTED`` when the caller sees the exception, and its id is free at once.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
import sniffio
import trio
from test_waiter import _interpreters

import nbengine as nb
import nbengine.frontend.waiter as waiter
from nbengine import RequestOutputKind as Kind
from nbengine import RequestStatus as S

from support.requests import long_params

WORKER = Path(__file__).with_name("interrupt_worker.py")
HARNESS = Path(__file__).with_name("interrupt_harness.py")
HANG_GUARD_S = 300.0


def _run_worker(model: Path, runner: str, way: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(nb.__file__).resolve().parent.parent), env.get("PYTHONPATH", "")]
    )
    done = subprocess.run(
        [sys.executable, str(WORKER), str(model), runner, way],
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result: dict[str, str] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.parametrize("way", ["await", "aiter"])
@pytest.mark.parametrize("runner", ["asyncio", "asyncio-plain", "trio"])
def test_sigint_while_awaiting_aborts_before_it_propagates(
    tiny_model: Path, runner: str, way: str
) -> None:
    """A real SIGINT under asyncio.run (this Python's, and 3.10's way of running a loop)
    and trio.run: the caller catches KeyboardInterrupt with the request already aborted
    and confirmed, and reuses its id at once."""
    got = _run_worker(tiny_model, runner, way)
    assert got == {"raised": "KeyboardInterrupt", "status": "FINISHED_ABORTED", "reused": "length"}


async def _started(h: nb.RequestHandle) -> None:
    for _ in range(6000):
        if h.token_ids:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"no token from {h.request_id}")


@pytest.mark.parametrize("way", ["await", "aiter", "cancel_async", "abort_async"])
def test_cancelled_task_sees_cancellation_after_the_confirmation(
    engine: nb.Engine, way: str
) -> None:
    """When the cancelled task ends, its request is FINISHED_ABORTED (not RELEASING)."""

    async def consume(h: nb.RequestHandle) -> None:
        if way == "await":
            await h
        elif way == "aiter":
            async for _ in h:
                pass
        elif way == "cancel_async":
            await h.cancel_async()
        else:
            await engine.abort_async(h.request_id)

    async def main() -> None:
        for i in range(10):
            h = engine.generate("Once", long_params(output_kind=Kind.DELTA), request_id="tc")
            await _started(h)
            task = asyncio.ensure_future(consume(h))
            # Let the task start waiting (a task cancelled before its first step never
            # touches the request), then land the cancel a few loop iterations apart.
            for _ in range(1 + i % 3):
                await asyncio.sleep(0)
            task.cancel()
            done, _ = await asyncio.wait({task}, timeout=60)
            if way in ("await", "aiter"):
                assert task in done and task.cancelled()
            assert h.status is S.FINISHED_ABORTED, (i, h.status)
            assert h.final_output is not None
            assert h.final_output.outputs[0].finish_reason == "abort"

    asyncio.run(main())


def test_wait_for_timeout_aborts_and_still_times_out(engine: nb.Engine) -> None:
    """``asyncio.wait_for(h, t)`` (and ``asyncio.timeout`` on 3.11+): TimeoutError, the
    request confirmed aborted; the task's own cancellation bookkeeping is untouched."""

    async def main() -> None:
        h = engine.generate("Once", long_params(), request_id="wf")
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(h.result_async(), 0.3)
        assert h.status is S.FINISHED_ABORTED
        if sys.version_info >= (3, 11):
            h = engine.generate("Once", long_params(), request_id="wf")
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.3):
                    await h
            assert h.status is S.FINISHED_ABORTED
            task = asyncio.current_task()
            assert task is not None and task.cancelling() == 0

    asyncio.run(main())


def test_anyio_cancelled_task_group_sees_the_request_aborted(engine: nb.Engine) -> None:
    """anyio's scopes (the server's) re-cancel a waiting task at every loop iteration;
    the consumer still awaits the confirmation before the task group exits."""

    async def main() -> None:
        h = engine.generate("Hi", long_params(output_kind=Kind.DELTA), request_id="anyio-c")

        async def consume() -> None:
            async for _ in h:
                pass

        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            await _started(h)
            tg.cancel_scope.cancel()
        assert h.status is S.FINISHED_ABORTED

    asyncio.run(main())


@pytest.mark.parametrize("way", ["await", "aiter"])
def test_trio_cancelled_scope_sees_the_request_aborted(engine: nb.Engine, way: str) -> None:
    async def main() -> None:
        h = engine.generate("Hi", long_params(output_kind=Kind.DELTA), request_id="trio-c")
        with trio.move_on_after(0.3) as scope:
            if way == "await":
                await h
            else:
                async for _ in h:
                    pass
        assert scope.cancelled_caught
        assert h.status is S.FINISHED_ABORTED

    trio.run(main)


def _run_harness(python: str, *extra: str) -> dict[str, dict[str, object]]:
    # The harness needs sniffio only: put just that package on the other interpreter's path.
    env = {**os.environ, "PYTHONPATH": str(Path(sniffio.__file__).resolve().parent.parent)}
    done = subprocess.run(
        [python, str(HARNESS), waiter.__file__, *extra],
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result: dict[str, dict[str, object]] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_interrupted_waits_confirm_first_on_every_interpreter_found() -> None:
    """The engine needs torch, which other interpreters here may lack; the asyncio side
    (3.10's KeyboardInterrupt in the loop, 3.11+'s cancelled main task) is checked on
    each CPython 3.10+ found with the waiter alone and a thread that confirms."""
    pythons = {f"{sys.version_info[0]}.{sys.version_info[1]}": sys.executable, **_interpreters()}
    expected_timeout: dict[str, object] = {"raised": "TimeoutError", "confirmed": True}
    for version, python in sorted(pythons.items()):
        got = _run_harness(python)
        assert got["sigint"] == {"raised": "KeyboardInterrupt", "confirmed": True}, version
        assert got["sigint_nested"] == got["sigint"] == got["sigint_inside"], version
        assert got["cancel_twice"] == {"cancelled": True, "confirmed_at_end": True}, version
        if version != "3.10":
            assert got["timeout"] == {**expected_timeout, "cancelling": 0}, version


def test_interrupt_harness_control_unshielded_wait_is_cut_short() -> None:
    """Control: awaiting the confirmation unshielded, a second cancel ends it early."""
    got = _run_harness(sys.executable, "--unshielded")
    assert got["cancel_twice"] == {"cancelled": True, "confirmed_at_end": False}
