"""``LiveFigure``: a plotly ``FigureWidget`` that a browser draws however late it renders.

Two gaps in plotly's ``FigureWidget`` (plotly 6/7, an anywidget) left the dashboard's
charts blank (empty axes, no title, no trace) when the browser was slow, as on a
loaded machine or a long notebook run with Run All:

1. Its comm opens (``Widget.__init__`` -> ``open()``) before plotly has filled in the
   figure: the first message carries ``_widget_data=[]`` and ``_widget_layout={}``,
   and the figure follows in later updates. The front end ignores those updates
   (its ``change:_widget_data`` / ``change:_widget_layout`` handlers are empty), so a
   view rendered from the first state draws an empty figure for good; every later
   restyle then targets traces the view does not have.
2. Later data reach the front end only as one-shot ``_py2js_*`` messages; a view
   that is still drawing (``Plotly.newPlot`` pending in a slow browser) or created
   after them starts from ``_widget_data`` as it was first sent, and misses them.

``LiveFigure`` fixes the first: its comm opens only once the figure is complete, so
any view has the layout (titles, axes, size) and every trace. Against the second,
``sync()`` after each update stores the current traces in ``_widget_data`` too, so a
view created later starts from them. Measured with the tutorials' browser test and
Chromium's CPU throttled: a plain FigureWidget drew the dashboard blank at 8x; a
LiveFigure drew titles but not always lines at 6x until the dashboard's traces also
got markers (a run within one throughput bin has single points, which a line alone
does not draw); with both, the charts drew at 6x and 8x.
"""

from __future__ import annotations

import copy
from typing import Any

import plotly.graph_objects as go

__all__ = ["LiveFigure"]


class LiveFigure(go.FigureWidget):
    """A ``FigureWidget`` whose first message holds the whole figure (see the module
    docstring); call ``sync()`` after changing its data."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Invariant: no comm exists until plotly's constructor has set _widget_data and
        # _widget_layout; trait changes before that are not sent anywhere.
        self._nbengine_defer_open = True
        super().__init__(*args, **kwargs)
        self._nbengine_defer_open = False
        self.open()

    def open(self) -> None:
        """Open the comm, except while the constructor is still filling the figure."""
        if getattr(self, "_nbengine_defer_open", False):
            return
        super().open()

    def sync(self) -> None:
        """Store the current traces as the state a newly rendered view starts from."""
        self._widget_data = copy.deepcopy(self._data)
