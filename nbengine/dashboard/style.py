"""Colours and small HTML fragments shared by the widgets and the timeline."""

from __future__ import annotations

import html

from nbengine.request import RequestStatus

__all__ = ["STATUS_COLORS", "badge_html", "format_seconds"]

# One colour per lifecycle status; the timeline uses the same ones. Neighbours in the
# lifecycle and statuses of one family get different hues (not shades of one hue), so
# that WAITING/RELEASING, the three ends and ABORTED/ERROR are told apart at a glance;
# every colour is dark enough for the badges' white text.
STATUS_COLORS: dict[RequestStatus, str] = {
    RequestStatus.QUEUED: "#757575",  # grey
    RequestStatus.WAITING: "#b26a00",  # amber
    RequestStatus.RUNNING: "#1565c0",  # blue
    RequestStatus.PREEMPTED: "#6a1b9a",  # purple
    RequestStatus.RELEASING: "#d81b60",  # magenta
    RequestStatus.FINISHED_STOPPED: "#2e7d32",  # green
    RequestStatus.FINISHED_LENGTH_CAPPED: "#00838f",  # teal
    RequestStatus.FINISHED_ABORTED: "#c62828",  # red
    RequestStatus.FINISHED_IGNORED: "#795548",  # brown
    RequestStatus.FINISHED_ERROR: "#212121",  # black
}


def badge_html(status: RequestStatus) -> str:
    """A coloured pill with the status name (the name is the element's whole text)."""
    color = STATUS_COLORS[status]
    return (
        f'<span class="nbengine-badge-pill" data-status="{status.name}" '
        f'style="background:{color};color:white;border-radius:9px;padding:1px 8px;'
        f'font-family:monospace;font-size:11px;white-space:nowrap">'
        f"{html.escape(status.name)}</span>"
    )


def format_seconds(seconds: float | None) -> str:
    """``1.23 s`` / ``45 ms`` / an en dash for unknown."""
    if seconds is None or seconds != seconds:  # None or NaN
        return "–"
    if seconds < 1.0:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 120:
        return f"{seconds:.2f} s"
    return f"{seconds / 60:.1f} min"


def constraint_tag_html(constraint: str | None) -> str:
    """A small tag naming a structured-output constraint ("json", "regex", "choice",
    "grammar"), its full description as the tooltip; "" for an unconstrained request."""
    if not constraint:
        return ""
    import html

    kind = constraint.split(":", 1)[0]
    return (
        f' <span class="nbengine-constraint" title="{html.escape(constraint, quote=True)}" '
        'style="font-size:10px;padding:0 4px;border-radius:3px;background:#ede7f6;'
        f'color:#4527a0;font-family:monospace">{html.escape(kind)}</span>'
    )


def lora_tag_html(lora_name: str | None) -> str:
    """A small tag naming a request's LoRA adapter (docs/lora.md); "" for the base model."""
    if not lora_name:
        return ""
    import html

    name = html.escape(lora_name, quote=True)
    return (
        f' <span class="nbengine-lora" title="LoRA adapter {name}" '
        'style="font-size:10px;padding:0 4px;border-radius:3px;background:#e0f2f1;'
        f'color:#00695c;font-family:monospace">{name}</span>'
    )
