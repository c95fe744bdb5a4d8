"""What the server holds per connection: an idle or stalled client is let go, a request
head cannot grow without bound, and a client that leaves mid-stream frees its request
(docs/serving.md, "Connections")."""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlsplit

import pytest

import nbengine as nb
from nbengine.server.connections import IDLE_TIMEOUT_S, MAX_HEAD_BYTES

from support.requests import wait_until

httpx = pytest.importorskip("httpx")


def _connect(server: object) -> socket.socket:
    where = urlsplit(server.url)  # type: ignore[attr-defined]
    sock = socket.create_connection((where.hostname, where.port), timeout=60)
    return sock


def _closed_by_server(sock: socket.socket, within_s: float) -> bool:
    """True if the server closes ``sock`` (EOF or reset) within ``within_s`` seconds;
    whatever it sends first (an error response) is read and dropped."""
    sock.settimeout(within_s)
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True
    return True


def test_a_connection_that_never_sends_a_request_is_closed(server: object) -> None:
    socks = [_connect(server) for _ in range(16)]
    try:
        # A hang-guard several times the idle timeout, not a timing assertion.
        assert all(_closed_by_server(s, IDLE_TIMEOUT_S * 6 + 30) for s in socks)
    finally:
        for s in socks:
            s.close()


def test_a_request_head_dripped_forever_is_cut_off(server: object) -> None:
    sock = _connect(server)
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        deadline = time.monotonic() + IDLE_TIMEOUT_S * 6 + 30
        closed = False
        while time.monotonic() < deadline and not closed:
            try:
                sock.sendall(b"X-Slow: a\r\n")  # a header line now and then, never the end
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
            time.sleep(0.5)
        assert closed or _closed_by_server(sock, 5), "the stalled head was never cut off"
    finally:
        sock.close()


def test_an_endless_request_head_is_refused_not_buffered(server: object) -> None:
    sock = _connect(server)
    line = b"X-Pad: " + b"a" * 1000 + b"\r\n"
    sent = 0
    try:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")
        while sent < 64 * MAX_HEAD_BYTES:  # far past the bound: the server must stop us
            sock.sendall(line)
            sent += len(line)
    except (BrokenPipeError, ConnectionResetError):
        return  # cut off
    else:
        assert _closed_by_server(sock, 5), f"the server buffered {sent} bytes of one head"
    finally:
        sock.close()


def test_a_normal_head_and_keep_alive_requests_still_work(server: object) -> None:
    with httpx.Client(timeout=60) as client:
        headers = {"X-Note": "n" * 4000}
        for _ in range(3):  # the same connection, kept alive between requests
            r = client.post(
                server.url + "/completions",  # type: ignore[attr-defined]
                json={"prompt": "Once", "max_tokens": 2},
                headers=headers,
            )
            assert r.status_code == 200, r.text


def test_a_slow_stream_outlives_the_idle_timeout(server: object) -> None:
    """A connection busy with a long request is not idle, however long it takes."""
    body = {"prompt": "Once", "max_tokens": 3, "stream": True, "ignore_eos": True}
    sock = _connect(server)
    try:
        payload = json.dumps(body).encode()
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(payload)}\r\n\r\n".encode()
        )
        time.sleep(IDLE_TIMEOUT_S * 2.5)  # the body comes late: the request has begun
        sock.sendall(payload)
        got = b""
        sock.settimeout(60)
        while b"data: [DONE]" not in got:
            chunk = sock.recv(65536)
            assert chunk, f"the connection was closed mid-request: {got[:200]!r}"
            got += chunk
        assert got.startswith(b"HTTP/1.1 200")
    finally:
        sock.close()


def test_idle_and_disconnected_clients_leave_no_state(server: object, engine: nb.Engine) -> None:
    app_state = server.app.state.nbengine  # type: ignore[attr-defined]
    uv_state = server._uvicorn.server_state  # type: ignore[attr-defined]
    # Streams whose clients leave after the first chunk, and idle keep-alive connections.
    for i in range(8):
        with httpx.stream(
            "POST",
            server.url + "/completions",  # type: ignore[attr-defined]
            timeout=60,
            headers={"X-Request-Id": f"left-{i}"},
            json={"prompt": "Once", "max_tokens": 4000, "ignore_eos": True, "stream": True},
        ) as r:
            assert next(r.iter_lines()).startswith("data: ")
    idle = [httpx.Client(timeout=60) for _ in range(8)]
    try:
        for c in idle:
            assert c.get(server.url + "/models").status_code == 200  # type: ignore[attr-defined]
        wait_until(lambda: not app_state.live, what="the left streams' handles released")
        wait_until(lambda: engine.num_unfinished_requests() == 0, what="their aborts")
        # The server lets the idle keep-alive connections go: nothing stays per client.
        wait_until(
            lambda: len(uv_state.connections) == 0,
            timeout=IDLE_TIMEOUT_S * 6 + 30,
            what="idle connections closed",
        )
    finally:
        for c in idle:
            c.close()
