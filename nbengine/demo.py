"""``nbengine demo``: several prompts stream at once from one engine; one is cancelled
mid-stream through the confirmed abort and its id reused at once.

On a terminal the requests' lines are redrawn in place as they stream; elsewhere they
are printed once at the end. A summary table follows: each request's finish reason,
tokens, time to first token and rate.
"""

from __future__ import annotations

import sys
import textwrap
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TextIO

__all__ = ["CANCEL_ID", "DEMO_PROMPTS", "run_demo"]

DEMO_PROMPTS: dict[str, str] = {
    "for-loop": "The for statement",
    "lists": "A list is",
    "imports": "The import system",
    "dicts": "A dictionary",
    "errors": "An exception is raised when",
}
CANCEL_ID = "imports"  # the demo cancels this one mid-stream, then reuses its id


@dataclass(slots=True)
class _Track:
    """What the demo's terminal view knows about one request."""

    request_id: str
    prompt: str
    start: float
    status: str = "QUEUED"
    text: str = ""
    num_tokens: int = 0
    first_token_at: float | None = None
    end: float | None = None
    finish_reason: str | None = None
    attempt: int = 1
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def label(self) -> str:
        """The request id, marked when it is a reuse of a cancelled request's id."""
        return self.request_id if self.attempt == 1 else f"{self.request_id}#{self.attempt}"


def _consume(handle: object, track: _Track) -> None:
    """Stream one handle (sync iteration on its own thread) into ``track``."""
    for out in handle:  # type: ignore[attr-defined]
        comp = out.outputs[0]
        with track.lock:
            if comp.token_ids and track.first_token_at is None:
                track.first_token_at = time.monotonic()
            track.text = comp.text
            track.num_tokens = len(comp.token_ids)
            track.status = out.status.name
            if out.finished:
                track.end = time.monotonic()
                track.finish_reason = comp.finish_reason


ELLIPSIS = "..."


def _head_words(text: str, width: int) -> str:
    """The start of ``text`` (whitespace collapsed) in at most ``width`` characters, cut
    after a whole word and marked with an ellipsis where it was cut."""
    return textwrap.shorten(text, width, placeholder=" " + ELLIPSIS)


def _tail_words(text: str, width: int) -> str:
    """The end of ``text`` (whitespace collapsed) in at most ``width`` characters, from the
    start of a whole word and marked with a leading ellipsis where it was cut. Only a
    single word wider than ``width`` is cut inside the word."""
    words = text.split()
    whole = " ".join(words)
    if len(whole) <= width:
        return whole
    budget = width - len(ELLIPSIS) - 1
    kept: list[str] = []
    used = -1  # no space before the first word kept
    for word in reversed(words):
        if used + 1 + len(word) > budget:
            break
        kept.append(word)
        used += 1 + len(word)
    if not kept:  # the last word alone is wider than the line
        return whole[-width:]
    return ELLIPSIS + " " + " ".join(reversed(kept))


def _status_lines(tracks: Sequence[_Track], width: int) -> list[str]:
    """The demo's live view: one line per request, its id, status, tokens and the end of
    its text (whole words), at most ``width`` characters."""
    lines = []
    for t in tracks:
        with t.lock:
            head = f"{t.label:<11} {t.status:<22} {t.num_tokens:>4} tok  "
            lines.append(head + _tail_words(t.text, max(10, width - len(head))))
    return lines


def _render(out: TextIO, tracks: Sequence[_Track], previous: int) -> int:
    """Redraw the status block in place on a terminal; returns the lines drawn."""
    lines = _status_lines(tracks, width=100)
    if previous:
        out.write(f"\x1b[{previous}F")
    for line in lines:
        out.write("\x1b[2K" + line + "\n")
    out.flush()
    return len(lines)


def run_demo(model: str | None = None, max_tokens: int = 48, out: TextIO = sys.stdout) -> int:
    """Stream several prompts at once, cancel one through the confirmed abort, reuse its id."""
    import nbengine as nb

    live = out.isatty()
    out.write("Loading the model... ")
    out.flush()
    t0 = time.monotonic()
    try:
        engine = nb.Engine(model)
    except BaseException:
        out.write("failed.\n")  # end the line; the error follows on stderr
        out.flush()
        raise
    with engine:
        out.write(f"ready in {time.monotonic() - t0:.1f}s\n\n")
        params = nb.SamplingParams(temperature=0.0, max_tokens=max_tokens)
        tracks: list[_Track] = []
        threads: list[threading.Thread] = []

        def start(request_id: str, prompt: str, sp: nb.SamplingParams, attempt: int) -> _Track:
            track = _Track(request_id, prompt, time.monotonic(), attempt=attempt)
            handle = engine.generate(prompt, sp, request_id=request_id)
            thread = threading.Thread(target=_consume, args=(handle, track), daemon=True)
            thread.start()
            tracks.append(track)
            threads.append(thread)
            return track

        # The one we cancel may write at length (the shipped model decodes about a thousand
        # tokens a second, so with the others' budget it could finish before the abort).
        long_params = nb.SamplingParams(temperature=0.0, max_tokens=8 * max_tokens)
        for rid, prompt in DEMO_PROMPTS.items():
            start(rid, prompt, long_params if rid == CANCEL_ID else params, attempt=1)
        # Let the one we cancel produce some text, then abort it through the protocol:
        # engine.abort() returns only once the core has freed the request.
        victim = next(t for t in tracks if t.request_id == CANCEL_ID)
        drawn = 0
        last_drawn = 0.0
        while True:
            with victim.lock:
                if victim.num_tokens >= 8 or victim.end is not None:
                    break
            if live and time.monotonic() - last_drawn >= 0.05:
                drawn = _render(out, tracks, drawn)
                last_drawn = time.monotonic()
            time.sleep(0.002)
        t_abort = time.monotonic()
        engine.abort(CANCEL_ID)
        abort_ms = (time.monotonic() - t_abort) * 1000
        # The id is free the moment abort() returns.
        start(CANCEL_ID, "Cancelled requests", params, attempt=2)
        while any(t.is_alive() for t in threads):
            if live:
                drawn = _render(out, tracks, drawn)
            time.sleep(0.1)
        if live:
            _render(out, tracks, drawn)
        else:
            for line in _status_lines(tracks, width=100):
                out.write(line + "\n")

    if victim.finish_reason == "abort":
        out.write(
            f"\nCancelled {CANCEL_ID!r} after {victim.num_tokens} tokens: abort() returned after "
            f"{abort_ms:.1f} ms, once the core had confirmed the release; the id was reused "
            "at once.\n\n"
        )
    else:  # it ended on its own first: abort() of a finished request returns at once
        out.write(
            f"\n{CANCEL_ID!r} finished ({victim.finish_reason}) before the abort reached it; "
            f"abort() returned after {abort_ms:.1f} ms and the id was reused at once.\n\n"
        )
    out.write(f"{'request':<12}{'finish':<8}{'tokens':>7}{'TTFT ms':>10}{'tok/s':>8}  text\n")
    for t in tracks:
        out.write(_summary_line(t) + "\n")
    return 0


def _summary_line(t: _Track) -> str:
    """One row of the demo's closing table: finish, tokens, TTFT, rate, the text's start."""
    ttft = (t.first_token_at - t.start) * 1000 if t.first_token_at else float("nan")
    dur = (t.end or time.monotonic()) - (t.first_token_at or t.start)
    rate = (t.num_tokens - 1) / dur if t.num_tokens > 1 and dur > 0 else float("nan")
    text = _head_words(t.prompt + t.text, 80)
    return (
        f"{t.label:<12}{t.finish_reason or '-':<8}{t.num_tokens:>7}{ttft:>10.1f}{rate:>8.1f}  "
        f"{text}"
    )
