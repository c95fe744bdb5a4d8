"""TEMPORARY: wires EngineMonitor into Engine until the engine.py edit lands (05:00)."""

from __future__ import annotations

from typing import Any

from nbengine.dashboard.handle_widget import handle_mimebundle
from nbengine.dashboard.monitor import EngineMonitor
from nbengine.frontend.engine import Engine
from nbengine.frontend.handles import RequestHandle


def install() -> None:
    if hasattr(Engine, "dashboard"):
        return
    orig_init = Engine.__init__
    orig_on_event = Engine._on_event
    orig_on_step = Engine._on_step
    orig_shutdown = Engine.shutdown

    def __init__(self: Engine, *a: Any, **k: Any) -> None:
        self._monitor = EngineMonitor(self)
        orig_init(self, *a, **k)

    def _on_event(self: Engine, ev: Any) -> None:
        orig_on_event(self, ev)
        self._monitor.on_event(ev)

    def _on_step(self: Engine, st: Any) -> None:
        orig_on_step(self, st)
        self._monitor.on_step(st)

    def _on_request(self: Engine, *a: Any) -> None:
        self._monitor.on_request(*a)

    def _on_tokens(self: Engine, *a: Any) -> None:
        self._monitor.on_tokens(*a)

    def shutdown(self: Engine, timeout: float = 10.0) -> None:
        orig_shutdown(self, timeout)
        self._monitor.shutdown()

    Engine.__init__ = __init__  # type: ignore[method-assign]
    Engine._on_event = _on_event  # type: ignore[method-assign]
    Engine._on_step = _on_step  # type: ignore[method-assign]
    Engine._on_request = _on_request  # type: ignore[method-assign]
    Engine._on_tokens = _on_tokens  # type: ignore[method-assign]
    Engine.shutdown = shutdown  # type: ignore[method-assign]
    Engine.events = lambda self: self._monitor.metrics.events()  # type: ignore[attr-defined]
    Engine.request_stats = lambda self: self._monitor.metrics.request_stats()  # type: ignore
    Engine.step_stats = lambda self: self._monitor.metrics.step_stats()  # type: ignore
    Engine.dashboard = lambda self: self._monitor.dashboard()  # type: ignore
    Engine.plot_timeline = lambda self, **kw: self._monitor.plot_timeline(**kw)  # type: ignore
    RequestHandle.widget = lambda self: self._engine._monitor.handle_widget(self)  # type: ignore
    RequestHandle._repr_mimebundle_ = (  # type: ignore[attr-defined]
        lambda self, **kw: handle_mimebundle(self, **kw)
    )
