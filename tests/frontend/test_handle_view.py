"""The handle's view: what ``text``, ``snapshot()`` and the widgets read while a request
streams is one delivery's state, never a mix of two (docs/architecture.md, "The output
path", step 3)."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import nbengine as nb
from nbengine.frontend.detokenizer import IncrementalDetokenizer
from nbengine.request import RequestStatus

from support.models import ENGINE_KW

WAIT_S = 60.0


@pytest.fixture
def busy_switching() -> Iterator[None]:
    """Threads switch as often as CPython allows: a reader that could see a half-made
    state sees it here within a few requests."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


def _visible_prefixes(
    engine: nb.Engine, params: nb.SamplingParams, prompt_ids: list[int], ids: list[int]
) -> list[str]:
    """``[k]``: the text a live request may show after its first ``k`` output tokens."""
    detok = IncrementalDetokenizer(engine.tokenizer, params, prompt_ids)
    texts = [""]
    for tid in ids:
        detok.update([tid])
        texts.append(detok.text[: detok.streamable_len(False)])
    return texts


def _watch(read: Callable[[], None], stop: threading.Event) -> threading.Thread:
    def loop() -> None:
        while not stop.is_set():
            read()

    t = threading.Thread(target=loop, name="view-reader", daemon=True)
    t.start()
    return t


def _check_snapshot(
    snap: dict[str, Any], final: nb.RequestOutput, visible: list[list[str]], where: str
) -> None:
    """One snapshot is one delivery: its texts, counts, status and finishes agree."""
    assert RequestStatus.is_finished(snap["status"]) == snap["finished"], (where, snap)
    outputs = snap["outputs"]
    assert [o["index"] for o in outputs] == [c.index for c in final.outputs], (where, snap)
    assert snap["num_output_tokens"] == sum(len(o["token_ids"]) for o in outputs), snap
    assert (snap["text"], snap["token_ids"]) == (outputs[0]["text"], outputs[0]["token_ids"])
    for o, comp, texts in zip(outputs, final.outputs, visible):
        n = len(o["token_ids"])
        assert o["token_ids"] == comp.token_ids[:n], (where, o)
        if snap["finished"]:
            assert o["text"] == comp.text and n == len(comp.token_ids), (where, o)
            assert o["finish_reason"] == comp.finish_reason, (where, o)
        else:
            assert o["text"] == texts[n], (where, n, o["text"], texts[n])
            assert o["finish_reason"] is None, (where, o)


def test_snapshots_read_on_another_thread_are_each_one_delivery(
    make_engine: Callable[..., nb.Engine], busy_switching: None
) -> None:
    engine = make_engine(**ENGINE_KW)
    params = [
        nb.SamplingParams(max_tokens=24, ignore_eos=True),
        nb.SamplingParams(n=3, max_tokens=16, ignore_eos=True, temperature=1.0, seed=7),
    ]
    handles = [
        engine.generate(f"Story {i}: once upon a time", params[i % 4 == 3], request_id=f"v{i}")
        for i in range(12)
    ]
    seen: list[tuple[nb.RequestHandle, dict[str, Any]]] = []
    done_without_final: list[str] = []
    stop = threading.Event()

    def read() -> None:
        for h in handles:
            seen.append((h, h.snapshot()))
            if h.done() and (h.final_output is None or not h.view.finished):
                done_without_final.append(h.request_id)

    reader = _watch(read, stop)
    try:
        finals = {h.request_id: h.result(timeout=WAIT_S) for h in handles}
    finally:
        stop.set()
        reader.join(WAIT_S)
    assert not reader.is_alive()
    visible = {
        h.request_id: [
            _visible_prefixes(engine, h.sampling_params, h.prompt_token_ids, c.token_ids)
            for c in finals[h.request_id].outputs
        ]
        for h in handles
    }
    assert len(seen) > len(handles)  # the reader saw the requests while they streamed
    assert done_without_final == []  # done() implies the final output and view
    for h, snap in seen:
        _check_snapshot(snap, finals[h.request_id], visible[h.request_id], h.request_id)
    for h in handles:  # and the handle's own readers agree with its final output
        final = finals[h.request_id]
        assert h.text == final.outputs[0].text and h.token_ids == final.outputs[0].token_ids
        assert h.status is final.status and h.snapshot()["finished"]


def test_final_only_requests_show_their_text_growing(
    make_engine: Callable[..., nb.Engine],
) -> None:
    """FINAL_ONLY delivers nothing to its consumer before the end, yet its handle's
    text grows with every token (the chat panel shows it so)."""
    engine = make_engine(**ENGINE_KW)
    params = nb.SamplingParams(
        max_tokens=200_000, ignore_eos=True, output_kind=nb.RequestOutputKind.FINAL_ONLY
    )
    h = engine.generate("Once upon a time", params, request_id="final-only")
    counts: list[int] = []
    try:
        deadline = time.monotonic() + WAIT_S
        while len(counts) < 3 and time.monotonic() < deadline and not h.done():
            view = h.snapshot()
            n = view["num_output_tokens"]
            if n and (not counts or n > counts[-1]):
                assert not view["finished"] and view["text"] == h.text[: len(view["text"])]
                counts.append(n)
            time.sleep(0.005)
    finally:
        final = h.cancel(timeout=WAIT_S)
    assert len(counts) == 3, counts
    assert final is not None and h.text == final.outputs[0].text
