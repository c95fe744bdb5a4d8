"""``nbengine serve MODEL``: a script starts it, talks to it, and stops it with SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")


def test_serve_command_serves_until_sigterm(chat_model: Path) -> None:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "nbengine",
            "serve",
            str(chat_model),
            "--port",
            "0",
            "--served-model-name",
            "tiny",
            "--api-key",
            "k",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()  # printed once the server listens
        assert line.startswith("nbengine: serving 'tiny' at http://127.0.0.1:"), (
            line + proc.stderr.read() if not line else line
        )
        url = line.rsplit(" ", 1)[1].strip()
        assert httpx.get(url + "/models").status_code == 401
        r = httpx.post(
            url + "/chat/completions",
            headers={"Authorization": "Bearer k"},
            timeout=60,
            json={
                "model": "tiny",
                "max_tokens": 3,
                "ignore_eos": True,
                "messages": [{"role": "user", "content": "hi"}],
            },
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_command_refuses_a_public_bind_without_a_key() -> None:
    env = {k: v for k, v in os.environ.items() if k != "NBENGINE_API_KEY"}
    r = subprocess.run(
        [sys.executable, "-m", "nbengine", "serve", "--host", "0.0.0.0"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "nbengine: error: binding '0.0.0.0' needs --api-key (or $NBENGINE_API_KEY)."
    ]


def test_serve_command_takes_a_tool_call_parser(chat_model: Path) -> None:
    """The tiny model's template shows no tool format: tool_choice "auto" works only
    with --tool-call-parser (docs/serving.md, "Tools")."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "nbengine", "serve", str(chat_model), "--port", "0"]
        + ["--served-model-name", "tiny", "--tool-call-parser", "hermes"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("nbengine: serving"), line + proc.stderr.read() if not line else line
        url = line.rsplit(" ", 1)[1].strip()
        tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
        r = httpx.post(
            url + "/chat/completions",
            timeout=60,
            json={
                "model": "tiny",
                "max_tokens": 3,
                "messages": [{"role": "user", "content": "hi"}],
                "tools": [tool],
                "tool_choice": "auto",
            },
        )
        assert r.status_code == 200, r.text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    bad = subprocess.run(
        [sys.executable, "-m", "nbengine", "serve", "--tool-call-parser", "qwen"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "--tool-call-parser: invalid choice: 'qwen'" in bad.stderr
