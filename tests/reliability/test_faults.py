"""Fault injection on real objects: a failing forward, a failing tokenizer, a dying
core thread, a KV pool too small for any prompt.

Each fault ends every affected request with a clear per-request error (a final
output with finish_reason "error"/status FINISHED_ERROR and ``error`` set) or an
``EngineDeadError``; no caller hangs (every wait here has a timeout); and a new
Engine works afterwards in the same process.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import nbengine as nb
from nbengine.request import RequestStatus

from .sizes import ENGINE_KW
from support.engine_state import assert_quiescent, call_with_timeout
from support.requests import WAIT_S, long_params

SP = nb.SamplingParams


def _fresh_engine_works(tiny_model: Path) -> None:
    with nb.Engine(str(tiny_model), **ENGINE_KW) as engine:
        out = engine.generate("Once upon", SP(max_tokens=4, ignore_eos=True)).result(WAIT_S)
        assert len(out.outputs[0].token_ids) == 4
        assert_quiescent(engine)


def _ended_with_error(handle: nb.RequestHandle, fragment: str) -> str:
    """The handle ends (within the timeout) with a clear error naming ``fragment``.

    Returns "dead" when ``result()`` raised EngineDeadError, "error" when the final
    output is a per-request error.
    """
    try:
        final = handle.result(timeout=WAIT_S)
    except nb.EngineDeadError as exc:
        assert fragment in str(exc), str(exc)
        assert handle.done()
        return "dead"
    assert final.finished
    assert final.status is RequestStatus.FINISHED_ERROR, final.status
    assert all(c.finish_reason == "error" for c in final.outputs)
    assert final.error is not None and fragment in final.error, final.error
    return "error"


def _consume_sync(handle: nb.RequestHandle, box: dict[str, Any]) -> None:
    try:
        box["outs"] = list(handle)
    except BaseException as exc:  # recorded for the assertion on the test's thread
        box["error"] = exc


def _consume_async(handle: nb.RequestHandle, box: dict[str, Any]) -> None:
    async def main() -> list[nb.RequestOutput]:
        return [out async for out in handle]

    try:
        box["outs"] = asyncio.run(main())
    except BaseException as exc:
        box["error"] = exc


def _start_consumers(engine: nb.Engine) -> list[tuple[threading.Thread, dict[str, Any]]]:
    consumers = []
    for fn in (_consume_sync, _consume_async):
        h = engine.generate("A consumer", long_params())
        box: dict[str, Any] = {}
        t = threading.Thread(target=fn, args=(h, box), daemon=True)
        t.start()
        consumers.append((t, box))
    return consumers


def _check_consumers_ended(
    consumers: list[tuple[threading.Thread, dict[str, Any]]], fragment: str
) -> None:
    for t, box in consumers:
        t.join(WAIT_S)
        assert not t.is_alive(), "a consumer of a failed engine hangs"
        if "error" in box:
            assert isinstance(box["error"], nb.EngineDeadError), repr(box["error"])
            assert fragment in str(box["error"])
        else:
            outs = box["outs"]
            assert outs and outs[-1].finished
            assert sum(o.finished for o in outs) == 1
            assert outs[-1].status is RequestStatus.FINISHED_ERROR


def _check_dead(engine: nb.Engine, fragment: str) -> None:
    assert not engine.is_alive
    with pytest.raises(nb.EngineDeadError) as info:
        engine.generate("after the failure")
    assert fragment in str(info.value)
    assert engine.abort("anything") is None
    call_with_timeout(engine.shutdown)
    assert not engine.is_alive


# Faults injected into a live engine. Each installer patches one real object so that it
# fails once ``started`` is set (every request below has been submitted by then, so a
# slow machine cannot turn the fault into a failure of generate() itself), and returns
# the message the fault carries and the ways a request may end ({"dead", "error"}).
Installer = Callable[[nb.Engine, threading.Event], tuple[str, set[str]]]


def _forward_raising_at(fail_at: int) -> Installer:
    def install(engine: nb.Engine, started: threading.Event) -> tuple[str, set[str]]:
        model = engine._core.runner.model  # type: ignore[attr-defined]
        real_forward = model.forward
        calls = {"n": 0}

        def failing_forward(*args: Any, **kwargs: Any) -> Any:
            calls["n"] += 1
            if calls["n"] == fail_at:
                started.wait(WAIT_S)
                raise RuntimeError("injected forward failure")
            return real_forward(*args, **kwargs)

        model.forward = failing_forward
        return "injected forward failure", {"dead", "error"}

    return install


def _tokenizer_raising(engine: nb.Engine, started: threading.Event) -> tuple[str, set[str]]:
    tokenizer = engine.tokenizer
    real_decode = tokenizer.decode
    calls = {"n": 0}

    def failing_decode(ids: Any, skip_special_tokens: bool = True) -> str:
        # Counted only once started: blocking the loop thread earlier would stall
        # generate() itself on a slow machine.
        if started.is_set():
            calls["n"] += 1
            if calls["n"] >= 6:  # fails from now on, also while flushing text at the end
                raise RuntimeError("injected decode failure")
        return real_decode(ids, skip_special_tokens=skip_special_tokens)

    tokenizer.decode = failing_decode  # type: ignore[method-assign]
    return "injected decode failure", {"dead"}


def _core_thread_dying(engine: nb.Engine, started: threading.Event) -> tuple[str, set[str]]:
    """The core thread ends with an exception its loop does not catch."""
    core = engine._core
    real_step = core.step
    calls = {"n": 0}

    def dying_step() -> Any:
        calls["n"] += 1
        if calls["n"] == 3:
            started.wait(WAIT_S)
            raise SystemExit("injected core thread death")
        return real_step()

    core.step = dying_step  # type: ignore[method-assign]
    return "injected core thread death", {"dead"}


@pytest.mark.parametrize(
    "install",
    [
        pytest.param(_forward_raising_at(1), id="forward-raising-at-step-1"),
        pytest.param(_forward_raising_at(4), id="forward-raising-at-step-4"),
        pytest.param(_tokenizer_raising, id="tokenizer-raising-while-decoding"),
        pytest.param(_core_thread_dying, id="core-thread-dying"),
    ],
)
def test_fault_ends_every_request_clearly(tiny_model: Path, install: Installer) -> None:
    engine = nb.Engine(str(tiny_model), **ENGINE_KW)
    started = threading.Event()
    fragment, allowed_ends = install(engine, started)
    try:
        handles = [engine.generate(f"Prompt {i}", long_params()) for i in range(3)]
        consumers = _start_consumers(engine)
        started.set()
        ends = {_ended_with_error(h, fragment) for h in handles}
        assert ends <= allowed_ends, ends
        _check_consumers_ended(consumers, fragment)
        _check_dead(engine, fragment)
    finally:
        engine.shutdown()
    _fresh_engine_works(tiny_model)


def test_core_thread_vanishing_silently(tiny_model: Path) -> None:
    """Even if the core's death is never reported, waiters notice and do not hang."""
    engine = nb.Engine(str(tiny_model), **ENGINE_KW)
    engine._on_core_exit = lambda error: None  # type: ignore[method-assign]
    core = engine._core
    real_step = core.step
    calls = {"n": 0}
    # The thread vanishes once both requests are in: counting steps alone raced with the
    # second generate(), which a fast core could outrun (it then raised EngineDeadError).
    submitted = threading.Event()

    def vanishing_step() -> Any:
        calls["n"] += 1
        if calls["n"] >= 3 and submitted.is_set():
            raise SystemExit("gone")
        return real_step()

    core.step = vanishing_step  # type: ignore[method-assign]
    try:
        handles = [engine.generate(f"Prompt {i}", long_params()) for i in range(2)]
        submitted.set()
        for h in handles:
            with pytest.raises(nb.EngineDeadError):
                h.result(timeout=WAIT_S)
        with pytest.raises(nb.EngineDeadError, match="core thread is gone"):
            engine.generate("after", SP(max_tokens=2))
    finally:
        call_with_timeout(engine.shutdown)
    _fresh_engine_works(tiny_model)


def test_kv_pool_too_small_for_any_prompt(tiny_model: Path) -> None:
    """A prompt the whole KV pool can never hold is refused at generate(), as one longer
    than max_model_len is (it used to end "length" with no tokens and an error)."""
    with nb.Engine(str(tiny_model), num_kv_blocks=1, block_size=4) as engine:
        prompt = "Once upon a time there was"
        n = len(engine.tokenizer.encode(prompt))
        assert n > 4
        with pytest.raises(
            ValueError,
            match=rf"^The prompt has {n} tokens, more than the KV cache holds "
            r"\(1 block of 4 tokens = 4 tokens\)",
        ):
            engine.generate(prompt, SP(max_tokens=4), request_id="big")
        # Nothing was registered: the id is free, the engine still serves prompts that fit ...
        small = engine.generate([1, 2], SP(max_tokens=10, ignore_eos=True), request_id="big")
        out = small.result(timeout=WAIT_S)
        # ... capped by the pool: 4 tokens in all, 2 of them the prompt.
        assert out.outputs[0].finish_reason == "length"
        assert len(out.outputs[0].token_ids) == 2
        # A prompt of exactly the pool's size is accepted and gets its token.
        full = engine.generate([1, 2, 3, 4], SP(max_tokens=10, ignore_eos=True)).result(WAIT_S)
        assert full.outputs[0].finish_reason == "length" and full.outputs[0].token_ids
        assert_quiescent(engine)
    _fresh_engine_works(tiny_model)


def test_a_prompt_above_the_step_budget_without_chunked_prefill_is_refused(
    tiny_model: Path,
) -> None:
    """Without chunked prefill a prompt must fit one step's token budget: one that does
    not is refused at generate() (the core would end it "length" with no tokens)."""
    with nb.Engine(
        str(tiny_model), max_num_batched_tokens=8, enable_chunked_prefill=False
    ) as engine:
        with pytest.raises(
            ValueError,
            match=r"^The prompt has 9 tokens, more than max_num_batched_tokens=8 .*"
            r"enable_chunked_prefill",
        ):
            engine.generate(list(range(1, 10)), SP(max_tokens=2), request_id="wide")
        out = engine.generate(list(range(1, 9)), SP(max_tokens=2), request_id="wide")
        assert out.result(timeout=WAIT_S).outputs[0].finish_reason is not None
        assert_quiescent(engine)


def test_kv_pool_pressure_preempts_and_everyone_finishes(tiny_model: Path) -> None:
    """A pool that holds only one request at a time: all finish, full length, no leak."""
    with nb.Engine(str(tiny_model), num_kv_blocks=4, block_size=4, max_num_seqs=8) as engine:
        handles = [
            engine.generate([1, 10 + i, 20 + i], SP(max_tokens=8, ignore_eos=True))
            for i in range(5)
        ]
        for h in handles:
            out = h.result(timeout=WAIT_S)
            assert out.outputs[0].finish_reason == "length"
            assert len(out.outputs[0].token_ids) == 8
        assert engine.step_stats().preemptions.sum() > 0
        assert_quiescent(engine)


def test_shutdown_during_a_stuck_step_and_a_concurrent_second_shutdown(tiny_model: Path) -> None:
    """shutdown(timeout) returns when a model step is stuck, frees what it can and says
    what it could not; a second shutdown() called meanwhile waits for the first."""
    engine = nb.Engine(str(tiny_model), **ENGINE_KW)
    model = engine._core.runner.model  # type: ignore[attr-defined]
    real_forward = model.forward
    in_step, release = threading.Event(), threading.Event()

    def stuck_forward(*args: Any, **kwargs: Any) -> Any:
        if not release.is_set():
            in_step.set()
            release.wait(WAIT_S)
        return real_forward(*args, **kwargs)

    model.forward = stuck_forward
    h = engine.generate("Once upon", long_params())
    assert in_step.wait(WAIT_S)
    done: dict[str, Any] = {}

    def first() -> None:
        with pytest.warns(RuntimeWarning, match="still inside a model step") as record:
            engine.shutdown(timeout=0.5)
        done["first"] = record

    def second() -> None:
        engine.shutdown(timeout=WAIT_S)
        done["second_saw_first"] = "first" in done

    t1 = threading.Thread(target=first)
    t1.start()
    while not engine._closed:  # the first call has started
        time.sleep(0.001)
    t2 = threading.Thread(target=second)
    t2.start()
    t1.join(WAIT_S)
    t2.join(WAIT_S)
    assert not t1.is_alive() and not t2.is_alive()
    assert done["second_saw_first"] is True  # the second returned only after the first
    assert h.done() and not engine.is_alive
    assert [t.name for t in threading.enumerate() if t.name == "nbengine-loop"] == []
    core_thread = engine._core_thread
    assert core_thread.is_alive()  # stuck in the step, as the warning said
    release.set()  # the step returns: the core thread stops and frees the model itself
    core_thread.join(WAIT_S)
    assert not core_thread.is_alive()
    assert engine._core._closed  # type: ignore[attr-defined]
    _fresh_engine_works(tiny_model)
