"""A port in use: ``engine.serve()`` raises an OSError that names host and port, and
``nbengine serve`` says so in one line, before it loads a model, and exits 2."""

from __future__ import annotations

import errno
import re
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

import nbengine as nb


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port another program listens on (127.0.0.1)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as other:
        other.bind(("127.0.0.1", 0))
        other.listen(1)
        yield other.getsockname()[1]


def test_engine_serve_names_the_address_in_use(engine: nb.Engine, busy_port: int) -> None:
    with pytest.raises(OSError) as info:
        engine.serve(port=busy_port)
    assert info.value.errno == errno.EADDRINUSE  # still told apart by errno
    message = str(info.value)
    assert f"127.0.0.1:{busy_port}" in message and "port=0" in message, message
    # Nothing is left behind: the engine serves on a free port right after.
    with engine.serve(port=0) as server:
        assert server.running


def test_serve_command_names_the_port_in_use(busy_port: int) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "nbengine", "serve", "--port", str(busy_port)],
        capture_output=True,
        text=True,
        timeout=120,  # a hang-guard; the port is checked before the model loads
    )
    assert r.returncode == 2, r
    assert r.stdout == "", r.stdout  # never "serving"
    assert r.stderr.strip().splitlines() == [
        f"nbengine: error: port {busy_port} is in use on 127.0.0.1: pass --port N "
        "(or 0 for a free one)"
    ], r.stderr


def test_serve_command_refuses_a_port_out_of_range() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "nbengine", "serve", "--port", "70000"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2, r
    (line,) = r.stderr.strip().splitlines()
    assert re.search(r"--port: must be 0-65535 .*got 70000", line), line
