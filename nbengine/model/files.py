"""Reading a model directory's small files, which may come from anyone (a Hub repo).

A model directory is untrusted input (docs/errors.md lists what is refused), and two
kinds of file in it would otherwise hang or crash the caller instead of raising a
``ModelLoadError``:

- a path that is not a regular file: ``open()`` of a FIFO blocks until a writer comes
  (forever), a character device never ends. Every file is opened with ``O_NONBLOCK``
  (which regular files ignore) and checked with ``fstat`` before it is read, so even a
  file swapped for a FIFO after a check is refused;
- JSON nested thousands of levels deep: ``json.loads`` recurses once per level and
  raises ``RecursionError``. The nesting is measured without recursion first, and
  refused beyond ``MAX_JSON_DEPTH`` (a real config nests a handful of levels).

Every error names the file and the problem.
"""

from __future__ import annotations

import json
import os
import re
import stat
from itertools import accumulate
from pathlib import Path
from typing import Any, BinaryIO

from nbengine.model.errors import ModelLoadError

__all__ = [
    "MAX_JSON_DEPTH",
    "is_regular_file",
    "json_depth_problem",
    "loads_bounded",
    "open_regular",
    "parse_json",
    "read_json",
    "read_json_object",
]

MAX_JSON_DEPTH = 64
"""The deepest nesting of arrays and objects accepted in a model's JSON file."""

# An escape inside a JSON string: a backslash and the byte after it ("\\u00e9" leaves
# plain hex digits). With escapes removed, the quotes of a valid JSON text alternate
# open, close, so the text outside strings is every other piece between quotes.
_ESCAPE = re.compile(rb"\\.", re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
# +1 for an opening bracket, -1 for a closing one (indexed by byte value).
_STEP = [1 if b in b"[{" else -1 for b in range(256)]


def _kind(mode: int) -> str:
    """What a non-regular file is, in words."""
    for test, name in (
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a plain file"


def _not_regular(path: Path, mode: int, error: type[ModelLoadError]) -> ModelLoadError:
    return error(
        f"{path} is not a regular file but {_kind(mode)}; nbengine reads model files only "
        "from regular files (or links to them)."
    )


def is_regular_file(path: Path, error: type[ModelLoadError] = ModelLoadError) -> bool:
    """True if ``path`` (links followed) is a regular file, False if nothing is there;
    ``error`` if something else is (a FIFO, a directory, a device)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise error(f"Cannot read {path}: {exc}") from exc
    if not stat.S_ISREG(mode):
        raise _not_regular(path, mode, error)
    return True


def open_regular(path: Path, error: type[ModelLoadError] = ModelLoadError) -> BinaryIO:
    """``path`` opened for binary reading, refused (``error``) unless it is a regular file.

    The open itself cannot block: ``O_NONBLOCK`` makes it return at once on a FIFO, whose
    kind ``fstat`` then tells.
    """
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        raise error(f"Cannot read {path}: {exc}") from exc
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise _not_regular(path, mode, error)
        if flags & getattr(os, "O_NONBLOCK", 0):
            os.set_blocking(fd, True)  # a regular file ignores it; clear it all the same
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def json_depth_problem(data: bytes, limit: int = MAX_JSON_DEPTH) -> str | None:
    """Why the JSON text ``data`` is refused for its nesting (arrays and objects deeper
    than ``limit`` levels), or None; measured without recursion, strings skipped."""
    if data.count(b"[") + data.count(b"{") <= limit:
        return None  # too few openers to nest that deep (most configs: no work at all)
    unescaped = _ESCAPE.sub(b"", data) if b"\\" in data else data
    outside_strings = b"".join(unescaped.split(b'"')[::2])
    brackets = outside_strings.translate(None, _NOT_BRACKETS)
    if max(accumulate(map(_STEP.__getitem__, brackets)), default=0) > limit:
        return f"its JSON nests arrays and objects deeper than {limit} levels"
    return None


def loads_bounded(data: bytes, limit: int = MAX_JSON_DEPTH) -> Any:
    """The JSON value of the UTF-8 text ``data``; ``ValueError`` saying why for text that
    is not UTF-8, not JSON, or nested deeper than ``limit`` levels."""
    problem = json_depth_problem(data, limit)
    if problem is not None:
        raise ValueError(problem)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"it is not UTF-8 text ({exc})") from exc
    try:
        return json.loads(text)
    except RecursionError as exc:  # unreachable below the depth bound; kept as a backstop
        raise ValueError("its JSON nests too deeply") from exc


def parse_json(
    data: bytes,
    source: Path,
    limit: int = MAX_JSON_DEPTH,
    error: type[ModelLoadError] = ModelLoadError,
) -> Any:
    """``loads_bounded(data)`` for text read from ``source``; ``error`` naming ``source``."""
    try:
        return loads_bounded(data, limit)
    except ValueError as exc:
        raise error(f"Cannot parse {source}: {exc}") from exc


def read_json(
    path: Path, limit: int = MAX_JSON_DEPTH, error: type[ModelLoadError] = ModelLoadError
) -> Any:
    """The JSON value in the regular file ``path`` (``open_regular``, ``parse_json``)."""
    with open_regular(path, error) as f:
        try:
            data = f.read()
        except OSError as exc:
            raise error(f"Cannot read {path}: {exc}") from exc
    return parse_json(data, path, limit, error)


def read_json_object(path: Path, error: type[ModelLoadError] = ModelLoadError) -> dict[str, Any]:
    """The JSON object in ``path``: {} if nothing is there or its value is not an object;
    ``error`` (naming ``path``) for what ``read_json`` refuses."""
    if not is_regular_file(path, error):
        return {}
    data = read_json(path, error=error)
    return data if isinstance(data, dict) else {}
