"""``plot_timeline``: a static plotly Gantt chart of each request's statuses over time.

One horizontal bar trace per status present (named after the status, in lifecycle
order, coloured as the badges), one row per request incarnation, time in seconds since
the first event shown. A plain ``go.Figure`` renders as
``application/vnd.plotly.v1+json``: deterministic and offline, fit for nbval cells.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Sequence
from typing import TYPE_CHECKING

from nbengine.dashboard.style import STATUS_COLORS
from nbengine.request import RequestStatus

if TYPE_CHECKING:
    import plotly.graph_objects as go

    from nbengine.frontend.events import LifecycleEvent

__all__ = ["plot_timeline", "timeline_segments"]

# A terminal status has no duration; it is drawn as a thin bar of this share of the span.
_TERMINAL_WIDTH_SHARE = 0.01


def timeline_segments(
    events: Sequence[LifecycleEvent], now: float | None = None
) -> tuple[list[str], dict[RequestStatus, list[tuple[str, float, float]]], float]:
    """Split events into ``(label, start, duration)`` segments per status.

    Returns (row labels in arrival order, segments by status, origin time). A live
    request's last status lasts until ``now`` (default: the current monotonic time).
    Labels are request ids; a reused id's later incarnations get `` (2)``, `` (3)``...
    """
    by_key: dict[str, list[LifecycleEvent]] = defaultdict(list)
    order: list[str] = []
    for ev in events:
        if ev.key not in by_key:
            order.append(ev.key)
        by_key[ev.key].append(ev)
    if not order:
        return [], {}, 0.0
    if now is None:
        now = time.monotonic()
    origin = min(evs[0].time for evs in by_key.values())
    end_time = max(now, max(evs[-1].time for evs in by_key.values()))
    span = max(end_time - origin, 1e-3)
    seen: dict[str, int] = defaultdict(int)
    labels: list[str] = []
    segments: dict[RequestStatus, list[tuple[str, float, float]]] = defaultdict(list)
    for key in order:
        evs = by_key[key]
        rid = evs[0].request_id
        seen[rid] += 1
        label = rid if seen[rid] == 1 else f"{rid} ({seen[rid]})"
        labels.append(label)
        for i, ev in enumerate(evs):
            status = ev.to_status
            start = ev.time - origin
            if RequestStatus.is_finished(status):
                duration = span * _TERMINAL_WIDTH_SHARE
            elif i + 1 < len(evs):
                duration = evs[i + 1].time - ev.time
            else:
                duration = now - ev.time
            segments[status].append((label, start, max(duration, 0.0)))
    return labels, dict(segments), origin


_LEGEND_ROW_PX = 24  # one legend entry, with room to spare


def plot_timeline(
    events: Sequence[LifecycleEvent], now: float | None = None, title: str = "Request timeline"
) -> go.Figure:
    """A Gantt chart of ``events`` (see the module docstring)."""
    import plotly.graph_objects as go

    labels, segments, _origin = timeline_segments(events, now)
    fig = go.Figure()
    for status in RequestStatus:  # lifecycle order: deterministic trace order and names
        segs = segments.get(status)
        if not segs:
            continue
        fig.add_trace(
            go.Bar(
                name=status.name,
                orientation="h",
                y=[s[0] for s in segs],
                base=[round(s[1], 6) for s in segs],
                x=[round(s[2], 6) for s in segs],
                marker_color=STATUS_COLORS[status],
                hovertemplate=(
                    f"%{{y}}<br>{status.name}<br>from %{{base:.3f}} s for %{{x:.3f}} s"
                    "<extra></extra>"
                ),
            )
        )
    fig.update_layout(
        title=title,
        barmode="overlay",
        xaxis_title="seconds since the first request",
        yaxis=dict(
            title="request", categoryorder="array", categoryarray=labels, autorange="reversed"
        ),
        legend_title_text="status",
        # Tall enough for every request row and for the whole legend (one entry per
        # status shown, plus its title): plotly clips a legend taller than the plot.
        height=max(250, 60 + 28 * len(labels), 90 + _LEGEND_ROW_PX * (len(fig.data) + 1)),
        margin=dict(l=10, r=10, t=50, b=40),
    )
    return fig
