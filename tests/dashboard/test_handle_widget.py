"""The handle widget: streaming state, Cancel that aborts without blocking, stable repr."""

from __future__ import annotations

import threading

import ipywidgets as widgets
import pytest

import nbengine as nb
from nbengine.dashboard import handle_widget
from nbengine.dashboard.handle_widget import HandleWidget, make_handle_widget
from nbengine.dashboard.stream_text import StreamingText
from nbengine.dashboard.updater import UIUpdater
from nbengine.frontend.observer import EngineObserver
from nbengine.request import RequestStatus

from support.requests import long_params, wait_until

WIDGET_MIME = "application/vnd.jupyter.widget-view+json"


def _badge(w: HandleWidget) -> str:
    return w.badge.value


def test_displaying_a_handle_gives_its_widget_and_a_stable_text_form(
    engine: nb.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(handle_widget, "_in_kernel", lambda: True)  # as in a notebook
    h = engine.generate("Once upon a time", long_params(), request_id="shown")
    try:
        bundle = h._repr_mimebundle_()
        w = h.widget()
        assert isinstance(w, HandleWidget)
        assert h.widget() is w  # one widget per handle
        assert bundle[WIDGET_MIME]["model_id"] == w.model_id
        assert bundle["text/plain"] == "RequestHandle(request_id='shown')"
        assert w._repr_mimebundle_()["text/plain"] == "RequestHandle(request_id='shown')"
        wait_until(lambda: len(h.token_ids) >= 5, what="a few tokens")
    finally:
        h.cancel()
    assert h._repr_mimebundle_()["text/plain"] == "RequestHandle(request_id='shown')"


def test_outside_a_kernel_a_handle_displays_as_text_only(engine: nb.Engine) -> None:
    h = engine.generate(
        "Hi", nb.SamplingParams(max_tokens=2, ignore_eos=True), request_id="terminal"
    )
    h.result()
    assert h._repr_mimebundle_() == {"text/plain": "RequestHandle(request_id='terminal')"}
    assert getattr(h, "_widget", None) is None  # no widget was made


def test_widget_streams_text_and_shows_the_final_state(engine: nb.Engine) -> None:
    params = nb.SamplingParams(max_tokens=40, ignore_eos=True)
    h = engine.generate("The cat sat", params, request_id="stream")
    w = h.widget()
    view = w.view
    assert view is not None
    final = h.result()
    updater = engine.monitor.updater
    wait_until(lambda: view not in updater, what="the finished view to be dropped")
    assert "FINISHED_LENGTH_CAPPED" in _badge(w)
    assert w.cancel_button.disabled
    assert '<span class="nbengine-tokens">40</span>' in w.stats.value
    # The escaped text of the whole completion is shown.

    assert final.outputs[0].text in w.text.value


def test_widget_of_a_finished_handle_shows_final_state_at_once(engine: nb.Engine) -> None:
    h = engine.generate("Hello", nb.SamplingParams(max_tokens=3, ignore_eos=True))
    h.result()
    w = h.widget()
    assert "FINISHED_LENGTH_CAPPED" in _badge(w)
    assert w.cancel_button.disabled
    assert w.view not in engine.monitor.updater


def test_cancel_click_aborts_with_confirmation_and_frees_the_id(engine: nb.Engine) -> None:
    h = engine.generate("Once upon a time", long_params(), request_id="click-me")
    w = h.widget()
    wait_until(lambda: h.status is RequestStatus.RUNNING, what="RUNNING")
    w.cancel_button.click()
    # At once, on the clicking thread: the button disables and the badge says RELEASING
    # (or already the confirmed FINISHED_ABORTED).
    assert w.cancel_button.disabled
    assert "RELEASING" in _badge(w) or "FINISHED_ABORTED" in _badge(w)
    final = h.result(timeout=60)
    assert final.status is RequestStatus.FINISHED_ABORTED
    assert final.outputs[0].finish_reason == "abort"
    wait_until(lambda: "FINISHED_ABORTED" in _badge(w), what="the badge to show FINISHED_ABORTED")
    # The id is free again: a new request with it runs to completion.
    again = engine.generate(
        "Once upon a time", nb.SamplingParams(max_tokens=5, ignore_eos=True), request_id="click-me"
    )
    out = again.result(timeout=60)
    assert out.outputs[0].finish_reason == "length"
    assert len(out.outputs[0].token_ids) == 5


def test_cancel_click_never_blocks_the_clicking_thread(engine: nb.Engine) -> None:
    """The click returns while the engine loop is stuck: the abort is only scheduled."""
    h = engine.generate("Once upon a time", long_params(), request_id="no-block")
    w = h.widget()
    wait_until(lambda: h.status is RequestStatus.RUNNING, what="RUNNING")
    release = threading.Event()
    stuck = threading.Event()

    class BlockLoop(EngineObserver):
        def on_step(self, stats: object) -> None:  # on the loop thread: nothing else runs
            if not stuck.is_set():
                stuck.set()
                release.wait(60)

    blocker = BlockLoop()
    engine.add_observer(blocker)
    assert stuck.wait(30)
    try:
        w.cancel_button.click()  # would hang here if it waited for the loop
        assert w.cancel_button.disabled
        assert not h.done()
    finally:
        release.set()
        engine.remove_observer(blocker)
    assert h.result(timeout=60).status is RequestStatus.FINISHED_ABORTED


def test_cancel_click_from_another_thread(engine: nb.Engine) -> None:
    """Kernel subshells run callbacks on their own threads."""
    h = engine.generate("Once upon a time", long_params(), request_id="subshell")
    w = h.widget()
    wait_until(lambda: h.status is RequestStatus.RUNNING, what="RUNNING")
    t = threading.Thread(target=w.cancel_button.click)
    t.start()
    t.join(30)
    assert not t.is_alive()
    assert h.result(timeout=60).outputs[0].finish_reason == "abort"


def test_second_click_and_click_after_finish_are_harmless(engine: nb.Engine) -> None:
    h = engine.generate("Hi", nb.SamplingParams(max_tokens=2, ignore_eos=True))
    w = h.widget()
    h.result()
    w.cancel_button.click()
    w.cancel_button.click()
    assert h.final_output is not None
    assert h.final_output.outputs[0].finish_reason == "length"


def test_widget_is_an_ipywidget_with_text_not_output(engine: nb.Engine) -> None:
    h = engine.generate("Hi", nb.SamplingParams(max_tokens=2, ignore_eos=True))
    h.result()
    w = h.widget()
    assert isinstance(w, widgets.VBox)
    assert isinstance(w.text, StreamingText)  # plain text, not an Output
    assert not any(isinstance(c, widgets.Output) for c in w.children)


def test_widget_of_an_n2_request_shows_both_completions(engine: nb.Engine) -> None:
    h = engine.generate(
        "Once", nb.SamplingParams(n=2, max_tokens=6, ignore_eos=True, temperature=1.0, seed=1)
    )
    final = h.result()
    w = h.widget()
    assert "completion 0" in w.text.value and "completion 1" in w.text.value
    assert '<span class="nbengine-tokens">12</span>' in w.stats.value
    assert len(final.outputs) == 2


def test_the_widget_never_shows_finished_before_the_whole_text(engine: nb.Engine) -> None:
    """The browser gets trait changes in the order they are written: once the badge
    reads FINISHED, the text it already has is the whole text and the count the whole
    count (the badge never comes a refresh before the last text)."""
    updater = UIUpdater(interval=0.005, name="test-ui")
    shown: dict[str, list[tuple[str, str]]] = {}
    try:
        handles = []
        for i in range(6):
            h = engine.generate(
                f"Tale {i}: the cat sat", nb.SamplingParams(max_tokens=24, ignore_eos=True)
            )
            w = make_handle_widget(h, updater)
            changes: list[tuple[str, str]] = [("text", w.text.value), ("stats", w.stats.value)]
            for part, name in ((w.badge, "badge"), (w.text, "text"), (w.stats, "stats")):
                part.observe(
                    lambda change, name=name, changes=changes: changes.append(
                        (name, change["new"])
                    ),
                    names="value",
                )
            shown[h.request_id] = changes
            handles.append(h)
        finals = {h.request_id: h.result(timeout=60) for h in handles}
        wait_until(lambda: updater.num_views == 0, what="every final state to be shown")
    finally:
        updater.stop()
    for rid, changes in shown.items():
        final = finals[rid].outputs[0]
        text = stats = ""
        finished_seen = False
        for name, value in changes:
            if name == "text":
                text = value
            elif name == "stats":
                stats = value
            elif "FINISHED" in value:
                finished_seen = True
                assert text == final.text, (rid, text, final.text)
                tokens = f'<span class="nbengine-tokens">{len(final.token_ids)}</span>'
                assert tokens in stats, (rid, stats)
        assert finished_seen, (rid, changes[-3:])
