"""LiveFigure notices a browser view that stopped receiving the figure's data."""

from __future__ import annotations

from typing import Any

import plotly.graph_objects as go

import nbengine as nb
from nbengine.dashboard.figure import STALE_REPORTS, LiveFigure


def _report(fig: LiveFigure, counts: list[int]) -> None:
    """What a view sends every second: the points each of its traces draws."""
    fig._on_view_report(fig, {"nbengine": "drawn", "counts": counts}, [])


def _figure() -> tuple[LiveFigure, list[int]]:
    fig = LiveFigure(go.Figure([go.Scatter(x=[1, 2, 3], y=[4, 5, 6]), go.Scatter(x=[], y=[])]))
    fig.sync()
    calls: list[int] = []
    fig.when_stale(lambda: calls.append(1))
    return fig, calls


def test_a_view_stuck_behind_the_data_is_reported_once() -> None:
    fig, calls = _figure()
    for _ in range(STALE_REPORTS - 1):
        _report(fig, [0, 0])
    assert calls == []
    _report(fig, [0, 0])
    assert calls == [1]
    for _ in range(2 * STALE_REPORTS):
        _report(fig, [0, 0])
    assert calls == [1]


def test_a_view_that_keeps_up_or_catches_up_is_not_reported() -> None:
    fig, calls = _figure()
    for _ in range(2 * STALE_REPORTS):
        _report(fig, [3, 0])  # draws everything the figure holds
    for counts in ([0, 0], [1, 0], [2, 0], [3, 0]):  # behind, but its counts move
        _report(fig, counts)
    _report(fig, [0, 0])
    _report(fig, [1, 0])
    assert calls == []


def test_the_dashboard_swaps_in_a_fresh_copy_of_a_stale_chart(engine: nb.Engine) -> None:
    dash = engine.dashboard()
    old = dash.figure
    held = [len(t.x) for t in old.data]
    for _ in range(STALE_REPORTS):
        _report(old, [-1] * len(held))  # a view that draws less than any data
    new: Any = dash.figure
    assert new is not old and new in dash.children and old not in dash.children
    assert [len(t.x) for t in new.data] == held
    assert [t.name for t in new.data] == [t.name for t in old.data]
