"""``StreamingText``: a scrolling text box that follows its tail, as a terminal does.

An ``ipywidgets.HTML`` replaces its whole element on every value change, so a box with
a scroll bar jumps back to the top each time the text grows and the newest text is
hidden below the fold. This widget keeps one ``<pre>`` element for its whole life and
changes only its text:

- while the reader is at the bottom (or has never scrolled), each update scrolls to
  the new end, so the newest text stays in view;
- once the reader scrolls up, updates keep their position; scrolling back to the
  bottom resumes following.

Only ``value`` (plain text, not HTML) crosses to the browser; the front end is a small
anywidget module (no build step, see docs/architecture.md on widgets).
"""

from __future__ import annotations

from typing import Any

import anywidget
import traitlets

__all__ = ["StreamingText", "FOLLOW_SLACK_PX"]

# A reader within this many pixels of the bottom counts as "at the bottom" (sub-pixel
# scroll offsets and a last line partly shown must not stop the following).
FOLLOW_SLACK_PX = 8

_ESM = """
const SLACK = %(slack)d;

function render({ model, el }) {
  const pre = document.createElement("pre");
  pre.className = "nbengine-text-pre";
  el.appendChild(pre);
  // Invariant: `follow` is true exactly while the reader has not scrolled away from
  // the bottom; it is read before each update changes the height.
  let follow = true;
  let shown = "";
  let ours = -1;  // the scrollTop our own last scroll to the end produced
  const node = document.createTextNode("");
  pre.appendChild(node);
  // A wheel turned upwards is the reader leaving the tail, decided at once: the scroll
  // event comes a frame later, and an update in between must not pull them back down.
  pre.addEventListener("wheel", (e) => { if (e.deltaY < 0) follow = false; },
                       { passive: true });
  // The heights the text had since the last scroll event: a scroll event arrives a frame
  // after the scroll, so a reader who scrolled back to the bottom may find the text grown
  // by then; reaching the bottom of any of these heights is reaching the bottom.
  let heights = [];
  pre.addEventListener("scroll", () => {
    const seen = pre.scrollTop + pre.clientHeight;
    const bottoms = heights.concat([pre.scrollHeight]);
    heights = [];
    if (bottoms.some((h) => h - seen <= SLACK && seen - h <= SLACK)) {
      follow = true;  // back at the bottom (by wheel, keys or the scroll bar)
      if (pre.scrollHeight - seen > SLACK) {
        pre.scrollTop = pre.scrollHeight;  // the text grew meanwhile: catch up
        ours = pre.scrollTop;
      }
    } else if (pre.scrollTop !== ours) {
      follow = false;  // moved away by the reader, not by our own scroll to the end
    }
  });
  const show = () => {
    const text = model.get("value") || "";
    heights.push(pre.scrollHeight);
    if (heights.length > 64) heights.shift();
    if (text.startsWith(shown)) {
      node.appendData(text.slice(shown.length));  // the usual case: the text grew
    } else {
      node.data = text;
    }
    shown = text;
    if (follow) {
      pre.scrollTop = pre.scrollHeight;
      ours = pre.scrollTop;
    }
  };
  show();
  model.on("change:value", show);
  return () => model.off("change:value", show);
}
export default { render };
""" % {"slack": FOLLOW_SLACK_PX}  # noqa: UP031 - the JS braces rule out str.format

_CSS = """
.nbengine-text-pre {
  white-space: pre-wrap;
  word-break: break-word;
  margin: 0;
  max-height: 16em;
  overflow-y: auto;
  font-size: 12px;
}
"""


class StreamingText(anywidget.AnyWidget):
    """A read-only text box, 16em tall (about a dozen lines), that follows its tail
    while the reader stays at the bottom (see the module docstring). ``value`` is plain
    text."""

    _esm = traitlets.Unicode(_ESM).tag(sync=True)
    _css = traitlets.Unicode(_CSS).tag(sync=True)
    value = traitlets.Unicode("").tag(sync=True)

    def __init__(self, value: str = "", **kwargs: Any) -> None:
        super().__init__(value=value, **kwargs)

    def __repr__(self) -> str:
        return f"StreamingText({len(self.value)} chars)"
