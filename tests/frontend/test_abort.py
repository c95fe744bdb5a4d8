"""The abort protocol (docs/lifecycle.md) through the real engine."""

from __future__ import annotations

import _thread
import signal
import threading
import time
from collections.abc import Iterator

import pytest

import nbengine as nb
from nbengine import RequestOutputKind as Kind
from nbengine import RequestStatus as S

from support.requests import long_params, wait_first_token
from support.scenarios import abort_and_readd_race


def first_output(h: nb.RequestHandle):
    it = iter(h)
    return it, next(it)


def test_abort_list_ends_streams_normally_with_abort_output(engine: nb.Engine) -> None:
    victims = [
        engine.generate("Once", long_params(output_kind=Kind.DELTA), request_id=f"v{i}")
        for i in range(5)
    ]
    others = [
        engine.generate(
            "Once", nb.SamplingParams(max_tokens=8, ignore_eos=True), request_id=f"o{i}"
        )
        for i in range(5)
    ]
    iters = [first_output(h)[0] for h in victims]
    finals = engine.abort([h.request_id for h in victims] + ["unknown-id"])
    assert isinstance(finals, list) and finals[-1] is None
    for h, it, final in zip(victims, iters, finals[:-1]):
        assert final is not None and final.finished
        assert final.status is S.FINISHED_ABORTED and h.status is S.FINISHED_ABORTED
        (c,) = final.outputs
        assert c.finish_reason == "abort" and c.stop_reason is None and len(c.token_ids) > 0
        rest = list(it)  # the stream ends normally, with the final output last
        assert rest and rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"
        assert all(not o.finished for o in rest[:-1])
    for h in others:
        r = h.result()
        assert len(r.outputs[0].token_ids) == 8 and r.outputs[0].finish_reason == "length"
    assert engine.num_unfinished_requests() == 0


def test_abort_is_idempotent_and_ignores_unknown(engine: nb.Engine) -> None:
    assert engine.abort("never-existed") is None
    h = engine.generate("Hi", long_params(), request_id="twice")
    first = engine.abort("twice", timeout=30)
    assert first is not None and first.outputs[0].finish_reason == "abort"
    assert engine.abort("twice") is None
    assert h.cancel() is first  # cancelling a finished handle returns its final output


def test_abort_before_the_first_token(engine: nb.Engine) -> None:
    for _i in range(5):
        h = engine.generate("Once upon", long_params(), request_id="early")
        final = engine.abort("early")
        assert final is not None and final.outputs[0].finish_reason == "abort"
        assert h.done() and h.status is S.FINISHED_ABORTED
        r = engine.generate(
            "Once upon", nb.SamplingParams(max_tokens=3, ignore_eos=True), request_id="early"
        ).result()
        assert len(r.outputs[0].token_ids) == 3


def test_consumer_stopping_after_20_tokens(engine: nb.Engine) -> None:
    h = engine.generate("The", long_params(output_kind=Kind.DELTA), request_id="twenty")
    seen = []
    for out in h:
        for t in out.outputs[0].token_ids:
            if len(seen) < 20:
                seen.append(t)
        if len(seen) == 20:
            break
    assert len(seen) == 20
    assert h.done() and h.status is S.FINISHED_ABORTED  # leaving the loop cancelled it
    assert engine.num_unfinished_requests() == 0
    r = engine.generate(
        "The", nb.SamplingParams(max_tokens=5, ignore_eos=True), request_id="twenty"
    ).result()
    assert len(r.outputs[0].token_ids) == 5


def test_live_id_rejected_and_first_request_intact(engine: nb.Engine) -> None:
    h = engine.generate("Hi", nb.SamplingParams(max_tokens=30, ignore_eos=True), request_id="dup")
    with pytest.raises(nb.RequestIdInUseError, match="'dup'") as exc:
        engine.generate("Hi", nb.SamplingParams(max_tokens=2), request_id="dup")
    assert exc.value.request_id == "dup" and exc.value.status.name in str(exc.value)
    r = h.result()
    assert len(r.outputs[0].token_ids) == 30 and r.outputs[0].finish_reason == "length"


def test_readd_while_abort_pending_is_rejected(engine: nb.Engine) -> None:
    """abort() runs on another thread and the core is held (a UTILITY waits on a gate), so
    the re-add certainly comes before the confirmation: it must be rejected."""
    h = engine.generate("Once", long_params(), request_id="race")
    wait_first_token(h)
    gate = threading.Event()
    engine._run_on_core(lambda core: gate.wait(30))
    t = threading.Thread(target=engine.abort, args=("race",))
    t.start()
    while h.status is not S.RELEASING:
        assert not h.done()
        time.sleep(0.001)
    with pytest.raises(nb.RequestIdInUseError) as exc:
        engine.generate("Once", nb.SamplingParams(max_tokens=3), request_id="race")
    assert exc.value.status is S.RELEASING
    assert t.is_alive()  # abort() has not returned: the core has not confirmed
    gate.set()
    t.join(30)
    assert h.done() and h.final_output is not None
    assert h.final_output.outputs[0].finish_reason == "abort"
    r = engine.generate(
        "Once", nb.SamplingParams(max_tokens=3, ignore_eos=True), request_id="race"
    ).result()
    assert len(r.outputs[0].token_ids) == 3 and r.outputs[0].finish_reason == "length"


def test_readd_race_stress_never_mixes(engine: nb.Engine) -> None:
    abort_and_readd_race(engine, "race2", rounds=15)


def test_result_timeout_raises_and_request_keeps_running(engine: nb.Engine) -> None:
    h = engine.generate("Hi", long_params())
    with pytest.raises(TimeoutError):
        h.result(timeout=0.2)
    assert not h.done()
    final = h.cancel()
    assert final is not None and final.outputs[0].finish_reason == "abort"


@pytest.fixture(autouse=True)
def _ctrl_c_raises() -> Iterator[None]:
    """Ctrl-C raises KeyboardInterrupt, as in a notebook or a terminal: a shell that starts
    pytest as a background job hands it SIGINT ignored, and then ``interrupt_main`` would
    do nothing."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


def _interrupt_soon(delay: float = 0.05) -> threading.Timer:
    t = threading.Timer(delay, _thread.interrupt_main)
    t.start()
    return t


def test_keyboard_interrupt_in_sync_iteration_cancels_and_confirms(engine: nb.Engine) -> None:
    h = engine.generate("Hi", long_params(output_kind=Kind.DELTA), request_id="kbi")
    n = 0
    with pytest.raises(KeyboardInterrupt):
        for _out in h:
            n += 1
            if n == 1:
                _interrupt_soon()
    assert h.done() and h.status is S.FINISHED_ABORTED  # confirmed before re-raising
    assert engine.num_unfinished_requests() == 0
    r = engine.generate(
        "Hi", nb.SamplingParams(max_tokens=2, ignore_eos=True), request_id="kbi"
    ).result()
    assert len(r.outputs[0].token_ids) == 2


def test_keyboard_interrupt_in_result_cancels_and_confirms(engine: nb.Engine) -> None:
    h = engine.generate("Hi", long_params(), request_id="kbi2")
    _interrupt_soon(0.2)
    with pytest.raises(KeyboardInterrupt):
        h.result()
    assert h.done() and h.status is S.FINISHED_ABORTED


def test_cancel_without_waiting_for_ui_callbacks(engine: nb.Engine) -> None:
    h = engine.generate("Hi", long_params(), request_id="nowait")
    wait_first_token(h)
    assert h.cancel(wait=False) is None  # returns at once
    final = h.result(timeout=60)
    assert final.outputs[0].finish_reason == "abort" and h.status is S.FINISHED_ABORTED


def _interrupt_after_registration(
    engine: nb.Engine, monkeypatch: pytest.MonkeyPatch, on_call: int = 1
) -> None:
    """Make the loop raise KeyboardInterrupt in the main thread right after it registers
    the ``on_call``-th request: the interrupt lands inside generate(), after the
    registration and before the handle reaches the caller."""
    processor = engine._processor
    original = processor.add
    calls = {"n": 0}

    def add_then_interrupt(live):  # type: ignore[no-untyped-def]
        original(live)
        calls["n"] += 1
        if calls["n"] == on_call:
            _thread.interrupt_main()

    monkeypatch.setattr(processor, "add", add_then_interrupt)


def test_keyboard_interrupt_inside_generate_leaves_no_request(
    engine: nb.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    _interrupt_after_registration(engine, monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        engine.generate("Once upon", long_params(), request_id="kbi")
    monkeypatch.undo()
    # Either the caller has the handle, or the request was aborted and confirmed: here
    # the caller has none, so nothing may be live and the id is free at once.
    assert engine.num_unfinished_requests() == 0
    out = engine.generate(
        "Again", nb.SamplingParams(max_tokens=3, ignore_eos=True), request_id="kbi"
    ).result(timeout=60)
    assert len(out.outputs[0].token_ids) == 3


def test_keyboard_interrupt_inside_llm_generate_leaves_no_request(
    tiny_model,
    monkeypatch: pytest.MonkeyPatch,  # type: ignore[no-untyped-def]
) -> None:
    from support.models import ENGINE_KW

    with nb.LLM(str(tiny_model), **ENGINE_KW) as llm:
        _interrupt_after_registration(llm.engine, monkeypatch, on_call=2)
        with pytest.raises(KeyboardInterrupt):
            llm.generate(["a", "b", "c"], long_params(), use_tqdm=False)
        monkeypatch.undo()
        assert llm.engine.num_unfinished_requests() == 0
        outs = llm.generate(
            ["a", "b"], nb.SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False
        )
        assert [len(o.outputs[0].token_ids) for o in outs] == [2, 2]
