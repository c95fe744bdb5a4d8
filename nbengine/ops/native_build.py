"""Building and caching the native kernel library (ops/kernels.c; bindings: ops/native.py).

How: the C file is compiled once per machine with the system C compiler (``cc``, or
``$CC``) into ``$NBENGINE_CACHE/native/`` (default ``~/.cache/nbengine/native/``), named
by a hash of the source, the flags and the compiler's version, so a changed file or
compiler builds anew and concurrent processes never see a half-written library (it is
written to a temporary name and renamed).

Integrity: next to each library a ``.sha256`` file records that key and the library's
own SHA-256, written when it was built. A cached library is loaded only if both match
and neither file is writable by other users; otherwise it is built again.

Which CPUs: x86-64 with the AVX-512 flags of ``CPU_FLAGS``; ``unsupported()`` says why a
process or CPU rules the kernels out before any build.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels.c")
CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni")
CFLAGS = (
    "-O3",
    "-std=gnu11",
    "-shared",
    "-fPIC",
    "-fopenmp",
    "-ffp-contract=off",
    "-mavx512f",
    "-mavx512bw",
    "-mavx512vl",
    "-mavx512bf16",
    "-mavx512vnni",
    "-mfma",
    "-mf16c",
)
LIBS = ("-lm",)


def unsupported() -> str | None:
    """Why this process or CPU rules the kernels out before any build, or None."""
    if os.environ.get("NBENGINE_NATIVE", "1") == "0":
        return "disabled by NBENGINE_NATIVE=0"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"the kernels are written for x86-64, this is {platform.machine()}"
    missing = [f for f in CPU_FLAGS if f not in _cpu_flags()]
    if missing:
        return f"this CPU lacks {', '.join(missing)}"
    return None


def has_amx() -> bool:
    """Whether this CPU has AMX bfloat16 tiles (``amx_bf16``; ops/linear.py's oneDNN twin)."""
    return "amx_bf16" in _cpu_flags()


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def _cache_dir() -> Path:
    root = os.environ.get("NBENGINE_CACHE") or Path.home() / ".cache" / "nbengine"
    return Path(root) / "native"


def build() -> Path:
    """The compiled library's path: the cached one if it passes its integrity check, else
    a fresh build (raises ``OSError`` or ``subprocess.SubprocessError`` if it fails)."""
    compiler = os.environ.get("CC", "cc")
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, timeout=30, check=True
    ).stdout
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join(CFLAGS + LIBS).encode() + version.encode()).hexdigest()[
        :16
    ]
    target = _cache_dir() / f"nbengine_kernels_{key}.so"
    if target.exists():
        problem = _cached_library_problem(target, key)
        if problem is None:
            return target
        logger.warning("Rebuilding nbengine's native kernels: the cached %s %s.", target, problem)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    fd, tmp_sum = tempfile.mkstemp(suffix=".sha256", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run(
            [compiler, *CFLAGS, str(SOURCE), *LIBS, "-o", tmp],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if done.returncode != 0:
            raise OSError(f"{compiler} failed: {done.stderr.strip()[-2000:]}")
        os.chmod(tmp, 0o755)
        Path(tmp_sum).write_text(f"{key} {_sha256(Path(tmp))}\n")
        # Atomic renames: other processes see the old names or whole files. The record
        # goes first; a library that does not match it is simply built again.
        os.replace(tmp_sum, _record_path(target))
        os.replace(tmp, target)
    finally:
        for leftover in (tmp, tmp_sum):
            if os.path.exists(leftover):
                os.unlink(leftover)
    logger.info("Built nbengine's native kernels: %s", target)
    return target


def _record_path(library: Path) -> Path:
    return library.with_suffix(".sha256")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _cached_library_problem(library: Path, key: str) -> str | None:
    """Why the cached ``library`` must not be loaded, or None if it is the one we built."""
    record = _record_path(library)
    for path in (library, record):
        try:
            mode = path.stat().st_mode
        except OSError:
            return f"has no integrity record ({record.name})"
        if mode & 0o022:
            return f"({path.name}) is writable by other users"
    try:
        recorded_key, digest = record.read_text().split()
    except (OSError, ValueError):
        return "has an unreadable integrity record"
    if recorded_key != key or digest != _sha256(library):
        return "does not match its integrity record"
    return None
