"""``NotebookFacade``: the notebook conveniences of ``Engine`` (docs/api.md).

The metrics tables read the engine's metrics log; the widgets, the chat panel and the
HTTP server are imported on first use, so the frontend loads without the UI (these
methods are the frontend's only upward imports: docs/architecture.md, "Layers").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    import pandas as pd
    import plotly.graph_objects as go

    from nbengine.dashboard.chat_panel import ChatPanel
    from nbengine.dashboard.dashboard import Dashboard
    from nbengine.dashboard.monitor import EngineMonitor
    from nbengine.frontend.engine import Engine
    from nbengine.server import Server

__all__ = ["NotebookFacade"]


class NotebookFacade:
    """Tables, widgets and the HTTP server of one engine (a base class of ``Engine``)."""

    monitor: EngineMonitor

    def _engine(self) -> Engine:
        return cast("Engine", self)  # the only subclass

    def events(self) -> pd.DataFrame:
        """One row per lifecycle transition: request_id, key, from_status, to_status,
        time, elapsed, wall_time, num_output_tokens, step (``nbengine.metrics``)."""
        return self.monitor.metrics.events()

    def request_stats(self) -> pd.DataFrame:
        """One row per request incarnation: status, finish_reason, prompt/output tokens,
        queue_time, ttft, itl_mean, itl_p99, e2e_time, preemptions, num_cached_tokens."""
        return self.monitor.metrics.request_stats()

    def step_stats(self) -> pd.DataFrame:
        """One row per engine step: batch size, prefill/decode tokens, KV blocks used and
        total, step_time, running, waiting, preemptions, prefix-cache hit rate."""
        return self.monitor.metrics.step_stats()

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
