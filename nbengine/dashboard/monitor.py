"""``EngineMonitor``: the engine's UI over its metrics log.

The engine owns its ``MetricsLog`` as its first observer (nbengine/frontend/observer.py)
and creates its monitor when a widget is first asked for (``engine.monitor``). The
monitor's hooks forward to a metrics log, so it can also observe an engine itself
(``add_observer``), as it did before the engine owned the log: ``on_request`` when an
incarnation is registered, ``on_event(ev)`` for every lifecycle transition,
``on_scheduled`` with the core's schedule time of a running request,
``on_tokens`` when a request has new tokens, ``on_step(stats)`` for every step and
``on_routed`` when a replica takes a request. The monitor uses only the engine's public
API. Readers on any
thread use ``metrics`` (thread-safe), ``handle_widget()``, ``dashboard()`` and
``plot_timeline()``. Widget modules (ipywidgets, plotly) are imported only when a
widget or figure is first asked for.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import TYPE_CHECKING, Any

from nbengine.frontend.notebook import in_kernel, preload_widget_modules
from nbengine.metrics import MetricsLog

if TYPE_CHECKING:
    import plotly.graph_objects as go

    from nbengine.core.messages import StepStats
    from nbengine.dashboard.dashboard import Dashboard
    from nbengine.dashboard.handle_widget import HandleWidget
    from nbengine.dashboard.updater import UIUpdater
    from nbengine.frontend.engine import Engine
    from nbengine.frontend.events import LifecycleEvent
    from nbengine.frontend.handles import RequestHandle

__all__ = ["EngineMonitor", "in_kernel"]

logger = logging.getLogger(__name__)


class EngineMonitor:
    """Metrics and widgets of one engine (see the module docstring for the threads)."""

    def __init__(self, engine: Engine, metrics: MetricsLog | None = None) -> None:
        self._engine_ref = weakref.ref(engine)
        self.metrics = metrics if metrics is not None else MetricsLog()
        self._lock = threading.Lock()  # guards lazy creation below
        self._updater: UIUpdater | None = None
        self._dashboard: Dashboard | None = None
        self._closed = False
        preload_widget_modules()

    @property
    def engine(self) -> Engine:
        engine = self._engine_ref()
        if engine is None:
            raise RuntimeError("The engine of this monitor no longer exists.")
        return engine

    def engine_alive(self) -> bool:
        """False once the engine failed, was shut down or was garbage collected."""
        engine = self._engine_ref()
        return engine is not None and engine.is_alive and not self._closed

    def _engine_running(self) -> bool:
        """True while the engine's loop thread runs (final states may still arrive)."""
        engine = self._engine_ref()
        return engine is not None and engine.loop_running

    # ------------------------------------------------------- hooks (loop thread)

    def on_request(
        self, key: str, request_id: str, num_prompt_tokens: int, arrival_time: float
    ) -> None:
        """An incarnation (each n>1 child) was registered."""
        self.metrics.on_request(key, request_id, num_prompt_tokens, arrival_time)

    def on_event(self, ev: LifecycleEvent) -> None:
        """A lifecycle transition."""
        self.metrics.on_event(ev)

    def on_constraint(self, key: str, request_id: str, constraint: str) -> None:
        """Hook: ``key`` runs under a structured-output constraint."""
        self.metrics.on_constraint(key, request_id, constraint)

    def on_adapter(self, key: str, request_id: str, lora_name: str) -> None:
        """Hook: ``key`` runs under the LoRA adapter ``lora_name``."""
        self.metrics.on_adapter(key, request_id, lora_name)

    def on_scheduled(self, key: str, when: float) -> None:
        """``key`` went RUNNING. The frontend stamps events when a batch reaches the loop;
        ``when`` is the core's (earlier) schedule time of the request."""
        self.metrics.on_scheduled(key, when)

    def on_routed(self, key: str, replica: int) -> None:
        """A multi-replica backend placed ``key`` on ``replica``."""
        self.metrics.on_replica(key, replica)

    def on_step(self, stats: StepStats) -> None:
        """An engine step."""
        self.metrics.on_step(stats)

    def on_tokens(
        self, key: str, num_output_tokens: int, now: float, num_cached_tokens: int | None
    ) -> None:
        """``key`` has ``num_output_tokens`` output tokens in all (cumulative), as of ``now``."""
        self.metrics.on_tokens(key, num_output_tokens, now, num_cached_tokens)

    # -------------------------------------------------------------- aborts (any)

    def abort_nowait(self, request_id: str, key: str | None = None) -> None:
        """Schedule an abort on the loop and return at once (widget callbacks use this).

        With ``key`` only that incarnation is aborted: a newer request reusing the id
        is left alone.
        """
        engine = self._engine_ref()
        if engine is not None:
            engine.abort_nowait(request_id, key)

    def abort_all_nowait(self) -> None:
        """Schedule an abort of every live request and return at once."""
        engine = self._engine_ref()
        if engine is not None:
            engine.abort_all_nowait()

    # --------------------------------------------------------------- widgets

    @property
    def updater(self) -> UIUpdater:
        """The engine's one UI updater (created on first use)."""
        from nbengine.dashboard.updater import UIUpdater

        with self._lock:
            if self._updater is None:
                self._updater = UIUpdater(alive=self._engine_running)
                if self._closed:
                    self._updater.stop()
            return self._updater

    def handle_widget(self, handle: RequestHandle) -> HandleWidget:
        """A new live widget of ``handle``, created on the calling thread
        (``RequestHandle.widget()`` keeps one per handle)."""
        from nbengine.dashboard.handle_widget import make_handle_widget

        return make_handle_widget(handle, self.updater)

    def dashboard(self) -> Dashboard:
        """The engine's live dashboard (one per engine; display it as often as you like)."""
        from nbengine.dashboard.dashboard import Dashboard

        with self._lock:
            dash = self._dashboard
        if dash is None:
            dash = Dashboard(self)
            with self._lock:
                if self._dashboard is None:
                    self._dashboard = dash
                else:
                    dash = self._dashboard
            self.updater.add(dash.view)
        return dash

    def plot_timeline(self, **kwargs: Any) -> go.Figure:
        """A static plotly Gantt chart of every request's statuses over time."""
        from nbengine.dashboard.timeline import plot_timeline

        return plot_timeline(self.metrics.event_records(), **kwargs)

    def shutdown(self) -> None:
        """Stop the UI updater after showing final states. Idempotent."""
        with self._lock:
            self._closed = True
            updater = self._updater
        if updater is not None:
            updater.stop()
