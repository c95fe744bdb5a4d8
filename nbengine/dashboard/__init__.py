"""Notebook widgets of the engine: per-request handle widgets, the dashboard, the updater.

Importing this package does not import ipywidgets or plotly; the widget modules do.
"""

from nbengine.dashboard.monitor import EngineMonitor

__all__ = ["EngineMonitor"]
