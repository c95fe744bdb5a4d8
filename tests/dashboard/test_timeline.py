"""plot_timeline: a static Gantt figure with one bar series per status present."""

from __future__ import annotations

import plotly.graph_objects as go

import nbengine as nb
from nbengine.dashboard.timeline import plot_timeline
from nbengine.frontend.events import LifecycleEvent
from nbengine.request import RequestStatus as S

from support.requests import long_params, wait_until


def _rec(rid: str, key: str, prev: S | None, to: S, t: float) -> LifecycleEvent:
    return LifecycleEvent(rid, key, prev, to, t, 1000 + t, 0, None)


def test_one_bar_series_per_status_present_in_lifecycle_order() -> None:
    events = [
        _rec("a", "a#1", None, S.QUEUED, 0.0),
        _rec("a", "a#1", S.QUEUED, S.WAITING, 0.1),
        _rec("a", "a#1", S.WAITING, S.RUNNING, 0.3),
        _rec("a", "a#1", S.RUNNING, S.FINISHED_STOPPED, 1.3),
        _rec("a", "a#2", None, S.QUEUED, 2.0),  # the id reused
        _rec("a", "a#2", S.QUEUED, S.WAITING, 2.1),
    ]
    fig = plot_timeline(events, now=3.0)
    assert isinstance(fig, go.Figure) and not isinstance(fig, go.FigureWidget)
    assert [t.name for t in fig.data] == ["QUEUED", "WAITING", "RUNNING", "FINISHED_STOPPED"]
    assert all(t.type == "bar" and t.orientation == "h" for t in fig.data)
    running = next(t for t in fig.data if t.name == "RUNNING")
    assert list(running.y) == ["a"] and list(running.base) == [0.3]
    assert list(running.x) == [1.0]
    waiting = next(t for t in fig.data if t.name == "WAITING")
    assert list(waiting.y) == ["a", "a (2)"]
    assert list(waiting.x) == [0.2, 0.9]  # the live one lasts until `now`
    assert list(fig.layout.yaxis.categoryarray) == ["a", "a (2)"]


def test_empty_timeline_is_an_empty_figure() -> None:
    fig = plot_timeline([])
    assert isinstance(fig, go.Figure) and len(fig.data) == 0


def test_engine_plot_timeline_after_a_run(engine: nb.Engine) -> None:
    done = engine.generate(
        "Hi there", nb.SamplingParams(max_tokens=4, ignore_eos=True), request_id="tl-done"
    )
    h = engine.generate("Hi there", long_params(), request_id="tl-abort")
    done.result()
    wait_until(lambda: len(h.token_ids) > 0, what="a token")
    h.cancel()
    fig = engine.plot_timeline()
    names = [t.name for t in fig.data]
    ev = engine.events()
    present = set(ev["to_status"])
    assert set(names) == present
    assert names == [s.name for s in S if s.name in present]
    for name in ("RUNNING", "RELEASING", "FINISHED_ABORTED", "FINISHED_LENGTH_CAPPED"):
        assert name in names
    # Deterministic JSON structure: the same trace names every run, no random uids.
    assert "uid" not in fig.to_plotly_json()["data"][0]
