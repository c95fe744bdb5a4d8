"""What one HTTP connection may hold on the server (docs/serving.md, "Connections").

uvicorn closes a keep-alive connection left idle after a response, but not one that
never sends a request, nor one that drips a request head a line at a time, and its
httptools protocol buffers a request head (URL and headers) without a bound. The
protocol classes here add both bounds to uvicorn's own:

- a connection with no request in progress that has not begun one within
  ``IDLE_TIMEOUT_S`` to ``2 * IDLE_TIMEOUT_S`` seconds is closed (a request in progress,
  however long its body or its stream, is never cut by this);
- a request head over ``MAX_HEAD_BYTES`` is answered 431 and its connection closed.

So what a connection holds is bounded in size and in time, and an abandoned one is
released. (A client that leaves mid-request is noticed by the routes, which abort its
request with confirmation: app.py.)
"""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["IDLE_TIMEOUT_S", "MAX_HEAD_BYTES", "http_protocol", "uvicorn_options"]

IDLE_TIMEOUT_S = 5.0  # uvicorn's own keep-alive timeout
MAX_HEAD_BYTES = 64 * 1024  # a request line and headers; OpenAI clients send under 2 KiB

_TOO_LARGE = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
    b"content-type: text/plain; charset=utf-8\r\n"
    b"content-length: 32\r\nconnection: close\r\n\r\n"
    b"The request head is too large.\r\n"
)


class _IdleGuard:
    """Closes the connection when no request is in progress and none began since the
    last check (checked every ``IDLE_TIMEOUT_S``). Mixed into a uvicorn protocol class:
    it reads uvicorn's ``loop``, ``cycle`` (the current request) and ``transport``."""

    loop: asyncio.AbstractEventLoop
    cycle: Any
    transport: asyncio.Transport

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._nb_seen: object = None  # the request seen at the last check
        self._nb_timer: asyncio.TimerHandle | None = self.loop.call_later(
            IDLE_TIMEOUT_S, self._nb_check
        )

    def _nb_check(self) -> None:
        cycle = self.cycle
        busy = cycle is not None and not cycle.response_complete
        if not busy and cycle is self._nb_seen:  # idle for a whole period
            self._nb_timer = None
            if not self.transport.is_closing():
                self.transport.close()
            return
        self._nb_seen = cycle
        self._nb_timer = self.loop.call_later(IDLE_TIMEOUT_S, self._nb_check)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._nb_timer is not None:
            self._nb_timer.cancel()
            self._nb_timer = None
        super().connection_lost(exc)  # type: ignore[misc]


def _httptools_protocol() -> type[asyncio.Protocol]:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class BoundedHttpTools(_IdleGuard, HttpToolsProtocol):
        """uvicorn's httptools protocol with the idle guard and a bounded request head."""

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._nb_head = 0  # bytes of this request's URL and headers so far

        def _nb_count(self, n: int) -> bool:
            self._nb_head += n
            if self._nb_head <= MAX_HEAD_BYTES:
                return True
            if not self.transport.is_closing():
                self.transport.write(_TOO_LARGE)
                self.transport.close()
            return False

        def on_url(self, url: bytes) -> None:
            if self._nb_count(len(url)):
                super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            if self._nb_count(len(name) + len(value) + 4):
                super().on_header(name, value)

        def on_headers_complete(self) -> None:
            if not self.transport.is_closing():
                super().on_headers_complete()

    return BoundedHttpTools


def _h11_protocol() -> type[asyncio.Protocol]:
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class BoundedH11(_IdleGuard, H11Protocol):
        """uvicorn's h11 protocol with the idle guard (h11 bounds the head itself:
        ``uvicorn_options``)."""

    return BoundedH11


def http_protocol() -> type[asyncio.Protocol]:
    """The protocol class for ``uvicorn.Config(http=...)``: httptools' where it is
    installed (uvicorn's own choice, the faster), else h11's."""
    try:
        import httptools  # noqa: F401
    except ImportError:
        return _h11_protocol()
    return _httptools_protocol()


def uvicorn_options() -> dict[str, Any]:
    """The ``uvicorn.Config`` options that go with ``http_protocol()``."""
    return {
        "http": http_protocol(),
        "timeout_keep_alive": IDLE_TIMEOUT_S,
        "h11_max_incomplete_event_size": MAX_HEAD_BYTES,
    }
