"""The async waiter never drops a cancellation, on every Python nbengine supports.

The test command runs one interpreter, but asyncio's cancellation semantics differ
between versions (``asyncio.wait_for`` could swallow a cancellation before 3.12). So the
stress harness (waiter_harness.py) runs under this interpreter and under every other
CPython 3.10+ found on the machine (pyenv's versions, ``python3.N`` on PATH).
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import sniffio

import nbengine.frontend.waiter as waiter

HARNESS = Path(__file__).with_name("waiter_harness.py")
SUPPORTED_MINORS = range(10, 15)


def _interpreters() -> dict[str, str]:
    found: dict[str, str] = {}
    for minor in SUPPORTED_MINORS:
        candidates = sorted(
            glob.glob(os.path.expanduser(f"~/.pyenv/versions/3.{minor}.*/bin/python"))
        )
        candidates.append(shutil.which(f"python3.{minor}") or "")
        for path in candidates:
            # pyenv's shims answer for versions that are not selected: skip them.
            if path and "/shims/" not in path and os.access(path, os.X_OK):
                found[f"3.{minor}"] = path
                break
    return found


def _run(python: str, *extra: str) -> int:
    # The harness needs sniffio only: put just that package on the other interpreter's path.
    sniffio_root = str(Path(sniffio.__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": sniffio_root}
    done = subprocess.run(
        [python, str(HARNESS), waiter.__file__, *extra],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return int(done.stdout.split("swallowed")[1].split()[0])


def test_waiter_on_every_interpreter_found() -> None:
    pythons = {f"{sys.version_info[0]}.{sys.version_info[1]}": sys.executable, **_interpreters()}
    swallowed = {version: _run(python) for version, python in sorted(pythons.items())}
    assert swallowed == dict.fromkeys(swallowed, 0)


def test_harness_catches_the_wait_for_race() -> None:
    """Control: on a Python where ``wait_for`` drops cancellations, the harness sees it."""
    olds = [p for v, p in _interpreters().items() if v in ("3.10", "3.11")]
    if sys.version_info < (3, 12):
        olds.insert(0, sys.executable)
    if not olds:
        pytest.skip("no CPython before 3.12 here, where asyncio.wait_for drops cancellations")
    assert _run(olds[0], "--wait-for") > 0
