"""``engine.dashboard()``: the live engine dashboard.

Parts: a table of requests (id, status badge, tokens, TTFT, age, source: "notebook",
"server", "chat", ... (nbengine/request_source.py), a Cancel button per
live row), a "Cancel all" button, the KV cache usage (a progress bar with blocks used /
total, the prefix-cache hit rate and, with speculative decoding, the share of drafted
tokens accepted, and the device it lives on with its memory) and
plotly ``FigureWidget`` charts of throughput and running/waiting counts over time.

Every widget is created once, on the caller's thread: the table is a fixed pool of
rows that the UI updater binds to requests (showing, hiding and relabelling rows are
trait changes). Row buttons look up the request bound to their row when clicked.
"""

from __future__ import annotations

import html
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ipywidgets as widgets

from nbengine.dashboard.style import (
    badge_html,
    constraint_tag_html,
    format_seconds,
    lora_tag_html,
)
from nbengine.dashboard.traits import TraitWriter
from nbengine.model.device import describe_device
from nbengine.request import RequestStatus
from nbengine.request_source import request_source

if TYPE_CHECKING:
    from nbengine.dashboard.monitor import EngineMonitor
    from nbengine.metrics import RequestRow

__all__ = ["Dashboard", "DashboardView"]

DEFAULT_ROWS = 12
CHART_WINDOW_S = 120.0  # the charts show this much recent history
CHART_EVERY_TICKS = 5  # charts refresh at ~2 Hz, the table at ~10 Hz
THROUGHPUT_BIN_S = 1.0
MAX_CHART_POINTS = 400

_COLS = (
    ("request", "150px"),
    ("status", "190px"),
    ("tokens", "70px"),
    ("TTFT", "80px"),
    ("age", "80px"),
    ("source", "80px"),
    ("", "90px"),
)


def _cell(text: str, width: str, cls: str) -> widgets.HTML:
    w = widgets.HTML(text, layout=widgets.Layout(width=width))
    w.add_class(cls)
    return w


class _Row:
    """One pooled table row; ``key``/``request_id`` name the request shown (None: hidden)."""

    def __init__(self) -> None:
        self.request_id: str | None = None
        self.key: str | None = None
        self.cancelled = False
        self.id_cell = _cell("", _COLS[0][1], "nbengine-row-id")
        self.badge = _cell("", _COLS[1][1], "nbengine-row-status")
        self.tokens = _cell("", _COLS[2][1], "nbengine-row-tokens")
        self.ttft = _cell("", _COLS[3][1], "nbengine-row-ttft")
        self.age = _cell("", _COLS[4][1], "nbengine-row-age")
        self.source = _cell("", _COLS[5][1], "nbengine-row-source")
        self.cancel = widgets.Button(
            description="Cancel", button_style="danger", layout=widgets.Layout(width=_COLS[6][1])
        )
        self.cancel.add_class("nbengine-row-cancel")
        self.box = widgets.HBox(
            [self.id_cell, self.badge, self.tokens, self.ttft, self.age, self.source, self.cancel],
            layout=widgets.Layout(display="none", align_items="center"),
        )
        self.box.add_class("nbengine-row")


class Dashboard(widgets.VBox):
    """The live dashboard widget of one engine (see the module docstring)."""

    def __init__(self, monitor: EngineMonitor, max_rows: int = DEFAULT_ROWS) -> None:
        import plotly.graph_objects as go
        from plotly.subplots import make_subplots

        from nbengine.dashboard.figure import LiveFigure

        self.title = widgets.HTML("<b>nbengine</b>")
        self.title.add_class("nbengine-dash-title")
        self.cancel_all = widgets.Button(
            description="Cancel all",
            icon="stop",
            button_style="danger",
            layout=widgets.Layout(width="auto"),
        )
        self.cancel_all.add_class("nbengine-cancel-all")
        head = widgets.HBox(
            [_cell(f"<b>{name}</b>", width, "nbengine-col") for name, width in _COLS]
        )
        self.rows = [_Row() for _ in range(max_rows)]
        self.more = widgets.HTML("")
        self.more.add_class("nbengine-more")
        table = widgets.VBox([head, *[r.box for r in self.rows], self.more])
        table.add_class("nbengine-table")
        self.kv_bar = widgets.IntProgress(
            value=0,
            min=0,
            max=1,
            description="KV cache",
            bar_style="info",
            layout=widgets.Layout(width="360px"),
        )
        self.kv_label = widgets.HTML("")
        self.kv_label.add_class("nbengine-kv")
        # The device the KV cache lives on: its name and memory (model/device.py).
        self.device_label = widgets.HTML("")
        self.device_label.add_class("nbengine-device")
        kv = widgets.HBox(
            [self.kv_bar, self.kv_label, self.device_label],
            layout=widgets.Layout(grid_gap="12px"),
        )
        self.replicas = widgets.HTML("")  # health of each engine core (replica)
        self.replicas.add_class("nbengine-replicas")
        fig = make_subplots(rows=1, cols=2, subplot_titles=("throughput (tokens/s)", "requests"))
        # Lines and markers: a run shorter than one throughput bin has a single point,
        # which a line alone does not draw (the chart looked empty).
        points = dict(mode="lines+markers", marker=dict(size=4))
        fig.add_trace(go.Scatter(name="generated tok/s", x=[], y=[], **points), 1, 1)
        fig.add_trace(go.Scatter(name="prompt tok/s", x=[], y=[], **points), 1, 1)
        fig.add_trace(go.Scatter(name="running", x=[], y=[], line_shape="hv", **points), 1, 2)
        fig.add_trace(go.Scatter(name="waiting", x=[], y=[], line_shape="hv", **points), 1, 2)
        fig.update_layout(
            height=280, margin=dict(l=40, r=10, t=40, b=30), legend=dict(orientation="h", y=-0.2)
        )
        fig.update_xaxes(title_text="seconds")
        # A LiveFigure, not a plain FigureWidget: a slow browser drew the plain one blank
        # (nbengine/dashboard/figure.py).
        self.figure = LiveFigure(fig)
        self.figure.when_stale(self._replace_figure)
        self._chart_lock = monitor.updater.lock  # held by the updater while it writes charts
        super().__init__(
            # The button comes first: the title's width changes with its counts, and a
            # button after it would move under the pointer.
            [
                widgets.HBox(
                    [self.cancel_all, self.title],
                    layout=widgets.Layout(grid_gap="16px", align_items="center"),
                ),
                table,
                kv,
                self.replicas,
                self.figure,
            ]
        )
        self.add_class("nbengine-dashboard")
        self.view = DashboardView(self, monitor)

    def _replace_figure(self) -> None:
        """The browser's view of the charts stopped receiving updates (a fault of the
        widget front end, nbengine/dashboard/figure.py): show a fresh copy instead."""
        from nbengine.dashboard.figure import LiveFigure

        with self._chart_lock:
            old = self.figure
            new = LiveFigure(old)
            new.when_stale(self._replace_figure)
            self.figure = new
            kept: tuple[Any, ...] = tuple(self.children)  # type: ignore[has-type]
            self.children = tuple(new if c is old else c for c in kept)
        old.close()

    def __repr__(self) -> str:
        return "Dashboard()"

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any] | None:
        data = super()._repr_mimebundle_(**kwargs)
        if data is not None:
            data["text/plain"] = "Dashboard()"
        return data


class DashboardView:
    """Keeps a ``Dashboard`` up to date; refreshed by the UI updater under its lock."""

    def __init__(self, dash: Dashboard, monitor: EngineMonitor) -> None:
        self.dash = dash
        self.monitor = monitor
        self._traits = TraitWriter()
        self._ticks = 0
        self._chart_version = -1
        self._model_label = ""  # " · <model> · <dtype>", kept fresh by _refresh_replicas
        self._refresh_replicas()
        dash.cancel_all.on_click(self._on_cancel_all)
        for row in dash.rows:
            row.cancel.on_click(lambda _b, row=row: self._on_cancel_row(row))

    # ------------------------------------------------------------ callbacks

    def _on_cancel_row(self, row: _Row) -> None:
        """Any thread: show RELEASING at once, schedule the abort, never block."""
        with self.monitor.updater.lock:
            rid, key = row.request_id, row.key
            if rid is None or row.cancelled:
                return
            row.cancelled = True
            self._set(row.cancel, "disabled", True)
            self._set(row.badge, "value", badge_html(RequestStatus.RELEASING))
        self.monitor.abort_nowait(rid, key)

    def _on_cancel_all(self, _button: object = None) -> None:
        with self.monitor.updater.lock:
            for row in self.dash.rows:
                if row.request_id is not None and not row.cancelled and not row.cancel.disabled:
                    row.cancelled = True
                    self._set(row.cancel, "disabled", True)
                    self._set(row.badge, "value", badge_html(RequestStatus.RELEASING))
        self.monitor.abort_all_nowait()

    # -------------------------------------------------------------- refresh

    def _set(self, w: widgets.Widget, name: str, value: Any) -> None:
        self._traits.set(w, name, value)

    @property
    def trait_writes(self) -> int:
        """Trait values actually changed (the coalescing tests read this)."""
        return self._traits.writes

    def refresh(self) -> bool:
        """Show the current state. Never final by itself: the updater stops at shutdown."""
        now = time.monotonic()
        metrics = self.monitor.metrics
        rows, counts = metrics.overview(len(self.dash.rows))
        self._refresh_table(rows, counts, now)
        self._refresh_kv()
        self._ticks += 1
        if self._ticks % CHART_EVERY_TICKS == 1 or self.monitor.updater.stopped:
            self._refresh_replicas()
            if metrics.version != self._chart_version:
                self._chart_version = metrics.version
                self._refresh_charts(now)
        return False

    def _refresh_table(
        self, rows: list[RequestRow], counts: dict[RequestStatus, int], now: float
    ) -> None:
        dash = self.dash
        n_live = sum(c for s, c in counts.items() if not RequestStatus.is_finished(s))
        n_done = sum(counts.values()) - n_live
        parts = ", ".join(f"{counts[s]} {s.name}" for s in RequestStatus if counts.get(s))
        alive = self.monitor.engine_alive()
        state = "" if alive else " — engine stopped"
        self._set(
            dash.title,
            "value",
            f"<b>nbengine</b>{self._model_label} — {n_live} live, {n_done} finished{state}"
            f'<br><span style="font-size:11px;color:#666">{html.escape(parts)}</span>',
        )
        self._set(dash.cancel_all, "disabled", n_live == 0 or not alive)
        for row, r in zip(dash.rows, rows + [None] * (len(dash.rows) - len(rows))):
            self._refresh_row(row, r, now)
        shown_live = sum(1 for r in rows if not RequestStatus.is_finished(r.status))
        more = n_live - shown_live
        self._set(dash.more, "value", f"<i>+ {more} more live requests</i>" if more > 0 else "")

    def _refresh_row(self, row: _Row, r: RequestRow | None, now: float) -> None:
        if r is None:
            row.request_id = row.key = None
            row.cancelled = False
            self._set(row.box.layout, "display", "none")
            return
        if row.key != r.key:
            row.cancelled = False
        row.request_id, row.key = r.request_id, r.key
        finished = RequestStatus.is_finished(r.status)
        status = r.status
        if row.cancelled and not finished:
            status = RequestStatus.RELEASING
        age = r.e2e_time if finished else now - r.arrival_time
        self._set(row.box.layout, "display", "flex")
        self._set(
            row.id_cell,
            "value",
            f'<span style="font-family:monospace">{html.escape(r.request_id)}</span>'
            + constraint_tag_html(r.constraint)
            + lora_tag_html(r.lora),
        )
        self._set(row.source, "value", html.escape(request_source(r.request_id)))
        self._set(row.badge, "value", badge_html(status))
        self._set(row.tokens, "value", str(r.output_tokens))
        self._set(row.ttft, "value", format_seconds(r.ttft))
        self._set(row.age, "value", format_seconds(age))
        self._set(row.cancel, "disabled", finished or row.cancelled)
        self._set(row.cancel.layout, "visibility", "hidden" if finished else "visible")

    def _refresh_kv(self) -> None:
        # Every replica's latest step: their caches are separate and add up.
        latest = list(self.monitor.metrics.latest_steps().values())
        if not latest:
            self._set(self.dash.kv_label, "value", "no steps yet")
            return
        used = sum(st.kv_blocks_used for st in latest)
        blocks = sum(st.kv_blocks_total for st in latest)
        queries = sum(st.prefix_cache_queries for st in latest)
        hit = sum(st.prefix_cache_hits for st in latest) / queries if queries else 0.0
        total = max(blocks, 1)
        self._set(self.dash.kv_bar, "max", total)
        self._set(self.dash.kv_bar, "value", min(used, total))
        # Speculative decoding: the share of drafted tokens accepted (when any was drafted).
        metrics = self.monitor.metrics
        drafted = metrics.total_spec_draft_tokens
        spec = (
            f" · draft acceptance {100 * metrics.total_spec_accepted_tokens / drafted:.0f}%"
            if drafted
            else ""
        )
        self._set(
            self.dash.kv_label,
            "value",
            f"{used} / {blocks} blocks "
            f"({100 * used / total:.0f}%) · prefix-cache hit rate {100 * hit:.0f}%{spec}",
        )

    def _refresh_replicas(self) -> None:
        try:
            engine = self.monitor.engine
            replicas = engine.replicas()
            model = engine.config.model.model
            name = "default model" if model is None else Path(str(model)).name
            # Shown in the title (with the counts): which model runs, in which dtype.
            self._model_label = f" · {html.escape(name)} · {html.escape(engine.dtype)}"
            device = describe_device(engine.config.model.device)
        except Exception:  # the engine is gone: keep the last state shown
            return
        self._set(self.dash.device_label, "value", f"on {html.escape(device)}")
        lines = []
        for r in replicas:
            alive = r["alive"] and self.monitor.engine_alive()
            state = "alive" if alive else f"down: {r.get('error') or 'stopped'}"
            colour = "#2e7d32" if alive else "#c62828"
            lines.append(
                f'<span style="color:{colour}">&#9679;</span> replica {r["replica"]} '
                f"({html.escape(str(r['backend']))}): {html.escape(state)} · "
                f"{r['unfinished']} unfinished · {r['steps']} steps"
            )
        self._set(self.dash.replicas, "value", "<br>".join(lines))

    def _refresh_charts(self, now: float) -> None:
        metrics = self.monitor.metrics
        origin = metrics.start_time
        steps = metrics.steps_since(now - CHART_WINDOW_S)
        if not steps:
            return
        gen: dict[int, int] = {}
        prompt: dict[int, int] = {}
        for st in steps:
            b = math.floor((st.start_time - origin) / THROUGHPUT_BIN_S)
            gen[b] = gen.get(b, 0) + st.num_decode_tokens
            prompt[b] = prompt.get(b, 0) + st.num_prefill_tokens
        first_bin, last_bin = min(gen), max(gen)
        bins = list(range(first_bin, last_bin + 1))
        xs = [round((b + 0.5) * THROUGHPUT_BIN_S, 3) for b in bins]
        stride = max(1, len(steps) // MAX_CHART_POINTS)
        sampled = steps[::stride]
        if sampled[-1] is not steps[-1]:
            sampled.append(steps[-1])
        sx = [round(st.start_time - origin, 3) for st in sampled]
        fig = self.dash.figure
        with fig.batch_update():
            fig.data[0].x, fig.data[0].y = xs, [gen.get(b, 0) / THROUGHPUT_BIN_S for b in bins]
            fig.data[1].x, fig.data[1].y = xs, [prompt.get(b, 0) / THROUGHPUT_BIN_S for b in bins]
            fig.data[2].x, fig.data[2].y = sx, [st.num_running for st in sampled]
            fig.data[3].x, fig.data[3].y = sx, [st.num_waiting for st in sampled]
        fig.sync()  # a view rendered from now on starts from these data
        self._traits.writes += 1
