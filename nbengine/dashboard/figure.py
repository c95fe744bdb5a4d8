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

A third gap remains on a slow or loaded browser: now and then the front end renders a
LiveFigure from its first state and then receives nothing more on that widget's comm
(neither state updates nor custom messages; other widgets update, and messages from the
view still reach the kernel). The cause lies in the widget front end, not found here.
So each view reports, every second, how many points each of its traces draws
(``_REPORT_JS``); when a view keeps drawing fewer points than the figure holds and
its counts do not move for ``STALE_REPORTS`` reports, the ``when_stale`` callback runs
once: the dashboard replaces the figure with a fresh copy (a new comm, which draws).
"""

from __future__ import annotations

import copy
import functools
import re
from collections.abc import Callable
from typing import Any

import plotly.graph_objects as go

__all__ = ["LiveFigure"]


# Reports that a view is behind before ``on_stale`` runs (one report a second).
STALE_REPORTS = 3

# The last statement of plotly's front-end module (plotly 6 and 7): its three exports.
_EXPORTS = re.compile(r"export\{(\w+) as FigureModel,(\w+) as FigureView,(\w+) as default\};?")

# Wraps plotly's default export (an anywidget module: initialize + render) so that each
# view reports the points it draws; MODEL, VIEW and BASE are replaced by the names
# plotly's bundle gives them.
_REPORT_JS = """
const nbengineDefault = () => {
  const base = BASE();
  return {
    initialize(ctx) { return base.initialize(ctx); },
    render(ctx) {
      const cleanup = base.render(ctx);
      const report = () => {
        const drawn = Array.isArray(ctx.el.data) ? ctx.el.data : [];
        const count = (t) => (t && t.x && typeof t.x.length === "number" ? t.x.length : 0);
        const counts = drawn.map(count);
        ctx.model.send({ nbengine: "drawn", counts });
      };
      const timer = setInterval(report, 1000);
      return () => { clearInterval(timer); cleanup(); };
    },
  };
};
export { MODEL as FigureModel, VIEW as FigureView, nbengineDefault as default };
"""


@functools.cache
def _front_end_module() -> str | None:
    """plotly's front-end module with ``_REPORT_JS`` added, or None if it does not fit."""
    source = str(go.FigureWidget._esm)
    found = list(_EXPORTS.finditer(source))
    if not found:
        return None
    last = found[-1]  # earlier matches are inside strings of bundled libraries
    model, view, base = last.groups()
    report = _REPORT_JS.replace("MODEL", model).replace("VIEW", view).replace("BASE()", f"{base}()")
    return source[: last.start()] + report + source[last.end() :]


class LiveFigure(go.FigureWidget):
    """A ``FigureWidget`` whose first message holds the whole figure and whose views say
    when they fell behind (see the module docstring); call ``sync()`` after changing its
    data. A ``when_stale`` callback runs at most once, on the kernel's thread that
    handles widget messages."""

    _esm = _front_end_module() or go.FigureWidget._esm

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Invariant: no comm exists until plotly's constructor has set _widget_data and
        # _widget_layout; trait changes before that are not sent anywhere.
        self._nbengine_defer_open = True
        super().__init__(*args, **kwargs)
        self._nbengine_defer_open = False
        # (plotly figures refuse public attributes that are not figure properties)
        self._nbengine_on_stale: Callable[[], None] | None = None
        self._nbengine_behind: tuple[list[int], int] | None = None  # (counts, reports)
        self.on_msg(self._on_view_report)
        self.open()

    def _on_view_report(self, _widget: Any, content: Any, _buffers: Any) -> None:
        """A view's report of the points it draws (the third gap in the module docstring)."""
        if not isinstance(content, dict) or content.get("nbengine") != "drawn":
            return
        counts = content.get("counts")
        if not isinstance(counts, list) or self._nbengine_on_stale is None:
            return
        held = [len(t.get("x") or ()) for t in self._widget_data]
        behind = len(counts) < len(held) or any(c < h for c, h in zip(counts, held))
        last = self._nbengine_behind
        if not behind:
            self._nbengine_behind = None
            return
        n = last[1] + 1 if last is not None and last[0] == counts else 1
        self._nbengine_behind = (counts, n)
        if n >= STALE_REPORTS:
            on_stale, self._nbengine_on_stale = self._nbengine_on_stale, None
            on_stale()

    def when_stale(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` (once) when a view stays behind the figure's data."""
        self._nbengine_on_stale = callback

    def open(self) -> None:
        """Open the comm, except while the constructor is still filling the figure."""
        if getattr(self, "_nbengine_defer_open", False):
            return
        super().open()

    def sync(self) -> None:
        """Store the current traces as the state a newly rendered view starts from."""
        self._widget_data = copy.deepcopy(self._data)
