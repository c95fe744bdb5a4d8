"""The UI updater: coalesces changes, runs on its own thread, stops on engine shutdown."""

from __future__ import annotations

import threading

import ipywidgets as widgets

import nbengine as nb
from nbengine.dashboard.updater import UIUpdater
from nbengine.request import RequestStatus

from support.requests import long_params, wait_until


class CounterView:
    """Shows a counter that another thread bumps as fast as it can."""

    def __init__(self) -> None:
        self.value = 0
        self.widget = widgets.IntText(0)
        self.writes = 0
        self.final_at: int | None = None
        self.widget.observe(self._count, names="value")

    def _count(self, _change: object) -> None:
        self.writes += 1

    def refresh(self) -> bool:
        v = self.value
        if self.widget.value != v:
            self.widget.value = v
        return self.final_at is not None and v >= self.final_at


def test_many_changes_become_at_most_one_write_per_tick() -> None:
    updater = UIUpdater(interval=0.05)
    view = CounterView()
    updater.add(view)
    try:
        for i in range(1, 200_001):
            view.value = i
        view.final_at = 200_000
        wait_until(lambda: view not in updater, what="the final state")
    finally:
        updater.stop()
    assert view.widget.value == 200_000  # the final state is always shown
    assert view.writes <= updater.ticks  # coalesced: never more than one write per tick
    assert view.writes < 200_000


def test_updater_runs_on_its_own_thread_while_the_caller_blocks() -> None:
    updater = UIUpdater(interval=0.02)
    view = CounterView()
    updater.add(view)
    seen_threads: set[str] = set()
    orig = view.refresh

    def refresh() -> bool:
        seen_threads.add(threading.current_thread().name)
        return orig()

    view.refresh = refresh  # type: ignore[method-assign]
    try:
        view.value = 7
        # This thread only waits; the widget still changes.
        wait_until(lambda: view.widget.value == 7, what="a background update")
        assert seen_threads == {"nbengine-ui"}
    finally:
        updater.stop()
    assert not updater.running


def test_a_failing_view_is_dropped_and_the_others_keep_updating() -> None:
    class Broken:
        def refresh(self) -> bool:
            raise RuntimeError("boom")

    updater = UIUpdater(interval=0.02)
    good, broken = CounterView(), Broken()
    updater.add(broken)
    updater.add(good)
    try:
        wait_until(lambda: broken not in updater, what="the broken view to be dropped")
        good.value = 3
        wait_until(lambda: good.widget.value == 3, what="the good view to update")
    finally:
        updater.stop()


def test_stop_is_final_and_idempotent() -> None:
    updater = UIUpdater(interval=0.02)
    view = CounterView()
    updater.add(view)
    view.value = 5
    updater.stop()
    assert view.widget.value == 5  # stop() shows the last state
    assert not updater.running and updater.num_views == 0
    updater.stop()
    late = CounterView()
    late.value = 9
    updater.add(late)  # refreshed once, at once; no thread restarts
    assert late.widget.value == 9 and not updater.running


def test_handle_widget_text_writes_are_coalesced(engine: nb.Engine) -> None:
    h = engine.generate("Once upon", nb.SamplingParams(max_tokens=300, ignore_eos=True))
    w = h.widget()
    text_writes = []
    w.text.observe(lambda c: text_writes.append(c), names="value")
    updater = engine.monitor.updater
    ticks0 = updater.ticks
    h.result()
    wait_until(lambda: w.view not in updater, what="the final state")
    assert len(text_writes) <= updater.ticks - ticks0 + 1
    assert len(text_writes) < 300


def test_engine_shutdown_stops_the_updater_after_final_states(fresh_engine: nb.Engine) -> None:
    h = fresh_engine.generate("Once upon", long_params(), request_id="live-at-shutdown")
    w = h.widget()
    dash = fresh_engine.dashboard()
    updater = fresh_engine.monitor.updater
    wait_until(lambda: h.status is RequestStatus.RUNNING, what="RUNNING")
    assert updater.running
    fresh_engine.shutdown()
    assert not updater.running
    assert updater.num_views == 0
    assert "FINISHED_ABORTED" in w.badge.value  # failed at shutdown, shown before stopping
    assert w.cancel_button.disabled
    assert "engine stopped" in dash.title.value


def test_updater_stops_by_itself_once_its_engine_is_gone() -> None:
    alive = threading.Event()
    alive.set()
    updater = UIUpdater(interval=0.02, alive=alive.is_set)
    view = CounterView()
    updater.add(view)
    wait_until(lambda: updater.ticks > 2, what="a few ticks")
    view.value = 11
    alive.clear()
    wait_until(lambda: not updater.running, what="the updater to stop")
    assert view.widget.value == 11  # the last tick ran
    assert updater.stopped and updater.num_views == 0
    updater.stop()  # a later explicit stop is a no-op


def test_trait_writer_writes_only_changed_values() -> None:
    import ipywidgets as widgets

    from nbengine.dashboard.traits import TraitWriter

    label, traits = widgets.Label(), TraitWriter()
    for value in ("a", "a", "b", "b", "a"):
        traits.set(label, "value", value)
    assert label.value == "a" and traits.writes == 3
