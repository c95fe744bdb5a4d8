"""``RequestView``: one immutable picture of a request, published once per delivery.

The loop thread builds a view each time it delivers to a handle (a token update, a
status change, the final output) and publishes it by one reference swap
(``RequestHandle._deliver``). Readers on any thread (``handle.text``, ``snapshot()``,
the widgets) read that one reference, so everything they show comes from the same
delivery: a view's text, token count, status and finish reasons agree, and a view whose
status is FINISHED_* is the final one, with the whole text (docs/architecture.md,
"The output path").

Cost per delivery is O(changed completions), whatever the length of the text: a view
holds each completion's current text string (immutable) with the length that may be
shown, and the completion's output id list (append-only on the loop thread) with the
count this view covers; completions a delivery did not change are the previous view's.
Nothing that grows is copied when a view is built; a reader that asks for ``token_ids``
or a held-back ``text`` copies the prefix it reads.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from nbengine.outputs import RequestOutput
from nbengine.request import RequestStatus

if TYPE_CHECKING:
    from nbengine.frontend.output_processor import ChildState, LiveRequest

__all__ = ["CompletionView", "RequestView", "final_view", "initial_view", "live_view"]


class CompletionView(NamedTuple):
    """One completion as of one delivery (a named tuple: immutable, and built at the
    cost of a tuple, which matters on the per-token path).

    Invariant: ``source_text[:text_len]`` and ``source_ids[:num_tokens]`` never change
    once the view is built (the string is immutable; the id list only grows, on the loop
    thread), so a view stays what it was when published.
    """

    # The completion's index, as ``CompletionOutput.index`` (it hides ``tuple.index``).
    index: int  # type: ignore[assignment]
    num_tokens: int
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    source_text: str = ""
    text_len: int = 0
    source_ids: Sequence[int] = ()

    @property
    def text(self) -> str:
        """The text that may be shown (held-back characters excluded while live)."""
        t = self.source_text
        return t if len(t) == self.text_len else t[: self.text_len]

    @property
    def token_ids(self) -> list[int]:
        """The output ids this view covers (a copy)."""
        return list(self.source_ids[: self.num_tokens])


class RequestView(NamedTuple):
    """A request as of one delivery (a named tuple, as ``CompletionView``); ``finished``
    iff its status is FINISHED_*."""

    request_id: str
    status: RequestStatus
    finished: bool
    completions: tuple[CompletionView, ...]
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    error: str | None = None

    @property
    def text(self) -> str:
        """The text of completion 0."""
        return self.completions[0].text if self.completions else ""

    @property
    def token_ids(self) -> list[int]:
        """The output ids of completion 0 (a copy)."""
        return self.completions[0].token_ids if self.completions else []

    @property
    def num_output_tokens(self) -> int:
        """Output tokens of all completions."""
        return sum(c.num_tokens for c in self.completions)

    def as_dict(self) -> dict[str, Any]:
        """The view as ``RequestHandle.snapshot()`` gives it (plain values, copies)."""
        outputs = [
            {
                "index": c.index,
                "text": c.text,
                "token_ids": c.token_ids,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            for c in self.completions
        ]
        return {
            "request_id": self.request_id,
            "status": self.status,
            "finished": self.finished,
            "text": outputs[0]["text"] if outputs else "",
            "token_ids": outputs[0]["token_ids"] if outputs else [],
            "num_output_tokens": self.num_output_tokens,
            "outputs": outputs,
            "arrival_time": self.arrival_time,
            "first_scheduled_time": self.first_scheduled_time,
            "first_token_time": self.first_token_time,
            "last_token_time": self.last_token_time,
            "finished_time": self.finished_time,
            "num_preemptions": self.num_preemptions,
            "error": self.error,
        }


def initial_view(request_id: str, n: int, arrival_time: float) -> RequestView:
    """The view of a request that no delivery has reached yet: QUEUED, ``n`` empty
    completions."""
    empty = tuple(CompletionView(i, 0) for i in range(n))
    return RequestView(request_id, RequestStatus.QUEUED, False, empty, arrival_time)


# The per-token path builds views with ``tuple.__new__`` (as ``NamedTuple._make`` does),
# skipping the generated ``__new__``'s argument binding: it halves a view's cost. Each
# call lists every field, in the class's order.
_tuple_new = tuple.__new__


def _live_completion(child: ChildState) -> CompletionView:
    detok = child.detok
    ids = detok.token_ids
    # index, num_tokens, finish_reason, stop_reason, source_text, text_len, source_ids
    fields = (
        child.index,
        len(ids),
        None,
        None,
        detok.text,
        detok.streamable_len(child.released),
        ids,
    )
    return _tuple_new(CompletionView, fields)


def live_view(live: LiveRequest, prev: RequestView, changed: Iterable[ChildState]) -> RequestView:
    """The view of a live request (loop thread): ``prev`` with the ``changed`` children's
    current state, and the request's current status and clock readings.

    The caller's invariant: ``live.status`` is a live one. A FINISHED_* status is
    published by the final view only (``final_view``, with the whole text), which the
    output processor delivers in the same step as the status is decided.
    """
    completions = prev.completions
    if len(completions) != len(live.children):  # not made for this request's n: all anew
        completions = tuple([_live_completion(c) for c in live.children])
    elif len(completions) == 1:
        for child in changed:  # completion 0, if it changed
            completions = (_live_completion(child),)
    else:
        by_index: list[CompletionView] | None = None
        for child in changed:
            if by_index is None:
                by_index = list(completions)
            by_index[child.index] = _live_completion(child)  # index: its position
        if by_index is not None:
            completions = tuple(by_index)
    m = live.metrics
    fields = (
        live.request_id,
        live.status,
        False,  # finished
        completions,
        prev.arrival_time,
        m.first_scheduled_time,
        m.first_token_time,
        m.last_token_time,
        None,  # finished_time
        m.num_preemptions,
        None,  # error
    )
    return _tuple_new(RequestView, fields)


def final_view(final: RequestOutput, prev: RequestView, error: str | None) -> RequestView:
    """The view of a request's full final output (all text and ids of all completions)."""
    m = final.metrics
    return RequestView(
        request_id=final.request_id,
        status=final.status,
        finished=True,
        completions=tuple(
            CompletionView(
                index=c.index,
                num_tokens=len(c.token_ids),
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
                source_text=c.text,
                text_len=len(c.text),
                source_ids=c.token_ids,
            )
            for c in final.outputs
        ),
        arrival_time=prev.arrival_time,
        first_scheduled_time=getattr(m, "first_scheduled_time", None),
        first_token_time=getattr(m, "first_token_time", None),
        last_token_time=getattr(m, "last_token_time", None),
        finished_time=getattr(m, "finished_time", None),
        num_preemptions=getattr(m, "num_preemptions", 0),
        error=error,
    )
