"""``NotebookFacade``: the notebook conveniences of ``Engine`` (docs/api.md).

The metrics tables read the engine's metrics log; the widgets, the chat panel and the
HTTP server are imported on first use, so the frontend loads without the UI (these
methods are the frontend's only upward imports: docs/architecture.md, "Layers").
"""

from __future__ import annotations

import logging
import sys
import threading
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    import pandas as pd
    import plotly.graph_objects as go

    from nbengine.dashboard.chat_panel import ChatPanel
    from nbengine.dashboard.dashboard import Dashboard
    from nbengine.dashboard.monitor import EngineMonitor
    from nbengine.frontend.engine import Engine
    from nbengine.metrics import MetricsLog
    from nbengine.server import Server

__all__ = ["NotebookFacade", "in_kernel", "preload_widget_modules"]

logger = logging.getLogger(__name__)

_preload_started = False


def in_kernel() -> bool:
    """True inside a Jupyter kernel (where widgets can render), not merely with ipykernel
    imported."""
    if "IPython" not in sys.modules:  # never import IPython just to ask
        return False
    from IPython import get_ipython

    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def preload_widget_modules() -> None:
    """In a Jupyter kernel, import the widget modules on a background thread, once.

    The first ``plotly`` FigureWidget import takes seconds (plotly.io pulls in nbformat
    and jsonschema); doing it while the engine starts keeps ``engine.dashboard()`` quick.
    Outside a kernel (scripts, tests) nothing happens.
    """
    global _preload_started
    if _preload_started or not in_kernel():
        return
    _preload_started = True
    # pandas is imported here, on the caller's thread, before the preload thread starts:
    # plotly imports it too, and a first import of pandas racing between that thread and
    # the notebook's (engine.events()) can leave one of them a partially initialised module.
    import pandas  # noqa: F401

    def preload() -> None:
        try:
            import ipywidgets  # noqa: F401
            import plotly.graph_objects as go

            go.FigureWidget  # noqa: B018 - resolves the lazy FigureWidget import
        except Exception:  # missing optional parts show up when a widget is asked for
            logger.debug("widget module preload failed", exc_info=True)

    threading.Thread(target=preload, name="nbengine-preload", daemon=True).start()


class NotebookFacade:
    """Tables, widgets and the HTTP server of one engine (a base class of ``Engine``)."""

    _metrics: MetricsLog
    _monitor: EngineMonitor | None = None
    _monitor_lock = threading.Lock()  # guards the first creation of any engine's monitor

    def _engine(self) -> Engine:
        return cast("Engine", self)  # the only subclass

    @property
    def monitor(self) -> EngineMonitor:
        """The engine's widgets and their updater over its metrics log (``.metrics``);
        created on first use, which imports the UI (the dashboard attaches here)."""
        from nbengine.dashboard.monitor import EngineMonitor

        with self._monitor_lock:
            monitor = self._monitor
            if monitor is None:
                engine = self._engine()
                monitor = self._monitor = EngineMonitor(engine, self._metrics)
                if engine._closed:  # shut down before any widget was asked for
                    monitor.shutdown()
        return monitor

    def events(self) -> pd.DataFrame:
        """One row per lifecycle transition: request_id, key, from_status, to_status,
        time, elapsed, wall_time, num_output_tokens, step (``nbengine.metrics``)."""
        return self._metrics.events()

    def request_stats(self) -> pd.DataFrame:
        """One row per request incarnation: status, finish_reason, prompt/output tokens,
        queue_time, ttft, itl_mean, itl_p99, e2e_time, preemptions, num_cached_tokens,
        spec_accepted_tokens (speculative drafts accepted: docs/speculative-decoding.md)."""
        return self._metrics.request_stats()

    def step_stats(self) -> pd.DataFrame:
        """One row per engine step: batch size, prefill/decode tokens, KV blocks used and
        total, step_time, running, waiting, preemptions, prefix-cache hit rate,
        spec_draft_tokens and spec_accepted_tokens (speculative decoding)."""
        return self._metrics.step_stats()

    def dashboard(self) -> Dashboard:
        """The live dashboard widget: requests and their statuses with Cancel buttons,
        "Cancel all", KV cache usage, throughput and running/waiting charts."""
        return self.monitor.dashboard()

    def plot_timeline(self, **kwargs: Any) -> go.Figure:
        """A static plotly Gantt chart of every request's statuses over time."""
        return self.monitor.plot_timeline(**kwargs)

    def serve(
        self,
        host: str = "127.0.0.1",
        port: int = 8000,
        api_key: str | None = None,
        **kwargs: Any,
    ) -> Server:
        """Start an OpenAI-compatible HTTP server on this engine; return it once it listens.

        ``server.url`` is the API's base URL, ``server.stop()`` (or ``with``) stops it.
        Binding a non-loopback ``host`` requires ``api_key``. Needs the ``serve`` extra.
        Keyword options (``model_name``, ``max_request_bytes``, ``max_tokens``): see
        docs/serving.md.
        """
        from nbengine.server import serve

        return serve(self._engine(), host, port, api_key, **kwargs)

    def chat_ui(self, **kwargs: Any) -> ChatPanel:
        """A chat panel widget on this engine: messages, Send, Stop, Regenerate, a system
        prompt, temperature and max-tokens; ``panel.messages`` is the conversation."""
        from nbengine.dashboard.chat_panel import ChatPanel

        return ChatPanel(self._engine(), **kwargs)
