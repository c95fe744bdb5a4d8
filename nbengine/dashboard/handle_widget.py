"""The live widget of one request: streaming text, status badge, tokens/s, Cancel.

``HandleWidget`` is created on the caller's thread (``handle.widget()`` or displaying a
handle). After that only the UI updater writes its traits, through ``HandleView.refresh``
(which reads the handle's published view, never the loop's request state),
and the Cancel button's callback (on whatever thread the kernel runs it: the main
thread or a subshell thread) writes two traits under the same lock and schedules the
abort on the engine loop without waiting for it.
"""

from __future__ import annotations

import html
import threading
from typing import TYPE_CHECKING, Any, cast

import ipywidgets as widgets

from nbengine.dashboard.monitor import in_kernel as _in_kernel
from nbengine.dashboard.stream_text import StreamingText
from nbengine.dashboard.style import badge_html, constraint_tag_html, lora_tag_html
from nbengine.dashboard.traits import TraitWriter
from nbengine.request import RequestStatus

if TYPE_CHECKING:
    from nbengine.dashboard.updater import UIUpdater
    from nbengine.frontend.handles import RequestHandle

__all__ = ["HandleView", "HandleWidget", "handle_mimebundle", "stable_text"]

MAX_SHOWN_CHARS = 100_000  # longer texts show their tail (the browser stays responsive)


def stable_text(request_id: str) -> str:
    """The text/plain form of a displayed handle: never changes while it runs (nbval)."""
    return f"RequestHandle(request_id={request_id!r})"


def _shown_text(text: str) -> str:
    """The text the box shows: the whole text, or its tail once it is very long."""
    if len(text) > MAX_SHOWN_CHARS:
        return "…" + text[-MAX_SHOWN_CHARS:]
    return text


def _stats_html(num_tokens: int, rate: float | None) -> str:
    rate_s = "–" if rate is None else f"{rate:.1f}"
    return (
        f'<span class="nbengine-stats" style="font-family:monospace;font-size:12px">'
        f'<span class="nbengine-tokens">{num_tokens}</span> tokens · '
        f'<span class="nbengine-rate">{rate_s}</span> tok/s</span>'
    )


class HandleWidget(widgets.VBox):
    """The widget shown for a ``RequestHandle``: a VBox with a stable ``repr``.

    Children: a header (status badge, request id, tokens and tokens/s, Cancel button)
    and the text so far (a ``StreamingText``: it follows the newest text while the
    reader stays at the bottom). Attributes ``badge``, ``title``, ``stats``, ``cancel_button``
    and ``text`` are the parts; ``view`` keeps them up to date.
    """

    def __init__(
        self,
        request_id: str,
        constraint: str | None = None,
        lora_name: str | None = None,
        **kwargs: Any,
    ) -> None:
        self.request_id = request_id
        self.constraint = constraint  # structured outputs: shown as a tag after the id
        self.lora_name = lora_name  # its LoRA adapter: a tag after that (docs/lora.md)
        self.badge = widgets.HTML(badge_html(RequestStatus.QUEUED))
        self.badge.add_class("nbengine-badge")
        self.title = widgets.HTML(
            f'<b style="font-family:monospace">{html.escape(request_id)}</b>'
            + constraint_tag_html(constraint)
            + lora_tag_html(lora_name)
        )
        self.stats = widgets.HTML(_stats_html(0, None))
        self.cancel_button = widgets.Button(
            description="Cancel",
            icon="stop",
            button_style="danger",
            tooltip=f"Abort request {request_id!r}",
            layout=widgets.Layout(width="auto"),
        )
        self.cancel_button.add_class("nbengine-cancel")
        self.text = StreamingText("")
        self.text.add_class("nbengine-text")
        header = widgets.HBox(
            [self.badge, self.title, self.stats, self.cancel_button],
            layout=widgets.Layout(align_items="center", grid_gap="12px"),
        )
        super().__init__([header, self.text], **kwargs)
        self.add_class("nbengine-handle")
        self.view: HandleView | None = None

    def __repr__(self) -> str:
        return f"HandleWidget(request_id={self.request_id!r})"

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any] | None:
        data = super()._repr_mimebundle_(**kwargs)
        if data is not None:
            data["text/plain"] = stable_text(self.request_id)
        return data


class HandleView:
    """Binds a ``HandleWidget`` to its ``RequestHandle``; refreshed by the UI updater."""

    def __init__(self, handle: RequestHandle, widget: HandleWidget, updater: UIUpdater) -> None:
        self.handle = handle
        self.widget = widget
        self.updater = updater
        self.cancel_clicked = False
        self._traits = TraitWriter()
        widget.view = self
        widget.cancel_button.on_click(self._on_cancel)

    # ------------------------------------------------------------------ cancel

    def _on_cancel(self, _button: object = None) -> None:
        """Button callback (any thread): disable at once, show RELEASING, abort async.

        Never blocks: the abort is scheduled on the engine loop; the updater shows
        FINISHED_ABORTED once the core has confirmed it.
        """
        with self.updater.lock:
            if self.cancel_clicked or self.handle.done():
                return
            self.cancel_clicked = True
            self._set(self.widget.cancel_button, "disabled", True)
            self._set(self.widget.badge, "value", badge_html(RequestStatus.RELEASING))
        self.handle.cancel(wait=False)  # public, non-blocking: the abort is only scheduled

    # ----------------------------------------------------------------- refresh

    def _set(self, w: widgets.Widget, name: str, value: Any) -> None:
        self._traits.set(w, name, value)

    @property
    def trait_writes(self) -> int:
        """Trait values actually changed (the coalescing tests read this)."""
        return self._traits.writes

    def refresh(self) -> bool:
        """Show the handle's latest view; True once its final state is shown.

        One view (one delivery) gives everything shown, and the text is written before
        the count and the badge: the browser gets trait changes in the order they are
        written, so it never shows FINISHED with less than the whole text.
        """
        view = self.handle.view
        status = view.status
        if self.cancel_clicked and not RequestStatus.is_finished(status):
            status = RequestStatus.RELEASING
        n = view.num_output_tokens
        first, last = view.first_token_time, view.last_token_time
        rate: float | None = None
        if first is not None and last is not None and n > 1 and last > first:
            rate = (n - 1) / (last - first)  # decode rate: tokens after the first one
        w = self.widget
        comps = view.completions
        if len(comps) > 1:  # n > 1: every completion, one after the other
            text = "\n\n".join(f"── completion {c.index} ──\n{c.text}" for c in comps)
        else:
            text = view.text
        self._set(w.text, "value", _shown_text(text))
        self._set(w.stats, "value", _stats_html(n, rate))
        self._set(w.badge, "value", badge_html(status))
        if view.error and view.finished:
            self._set(w.title, "tooltip", view.error)
        done = view.finished
        self._set(w.cancel_button, "disabled", done or self.cancel_clicked)
        if done:
            self._set(w.cancel_button, "description", "Done")
            self._set(w.cancel_button, "button_style", "")
        return done


def _constraint(handle: RequestHandle) -> str | None:
    spec = handle.sampling_params.structured_outputs
    return None if spec is None else spec.describe()


def _lora_name(handle: RequestHandle) -> str | None:
    lora = handle.lora_request
    return None if lora is None else lora.lora_name


def make_handle_widget(handle: RequestHandle, updater: UIUpdater) -> HandleWidget:
    """Create (on the caller's thread) the widget of ``handle`` and register its view."""
    widget = HandleWidget(handle.request_id, _constraint(handle), _lora_name(handle))
    view = HandleView(handle, widget, updater)
    with updater.lock:
        done = view.refresh()  # the current state at once, before the first tick
    if not done:
        updater.add(view)
    return widget


class _NoUpdates:
    """Stands in for the UI updater of an engine that no longer exists."""

    def __init__(self) -> None:
        self.lock = threading.Lock()


def final_handle_widget(handle: RequestHandle) -> HandleWidget:
    """A widget of a finished handle whose engine is gone: its final state, no updates
    (``RequestHandle.widget()`` keeps one per handle)."""
    widget = HandleWidget(handle.request_id, _constraint(handle), _lora_name(handle))
    view = HandleView(handle, widget, cast("UIUpdater", _NoUpdates()))
    view.refresh()
    return widget


def handle_mimebundle(handle: RequestHandle, **kwargs: Any) -> dict[str, Any]:
    """The display data of a handle: its widget's view, with a stable text/plain.

    Outside a kernel (a terminal IPython) only the text form is given and no widget is
    created.
    """
    plain = stable_text(handle.request_id)
    if not _in_kernel():
        return {"text/plain": plain}
    widget = handle.widget()
    data = widgets.Widget._repr_mimebundle_(widget, **kwargs) or {}
    data["text/plain"] = plain
    return data
