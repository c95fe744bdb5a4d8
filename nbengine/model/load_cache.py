"""The load cache: what a load made from a checkpoint (quantized weights, or bfloat16
weights packed for the native kernels), kept on disk, so that the next load of the same
checkpoint with the same options maps it instead of making it again (docs/load-cache.md).

An entry is one safetensors file of named tensors (a quantized layer's
``<module>.qweight`` / ``<module>.scales``, a packed layer's ``<module>.packed``) and a
JSON file saying what it was made from. Every tensor's data starts on a 64-byte boundary
of the file (zero-filled ``__pad<i>__`` tensors between them keep the format's "no gaps"
rule), so its view in a mapping is as aligned as ``torch.empty``'s memory. Its key is a
hash of

- the checkpoint's identity: for each weight file its name, size, modification time
  (nanoseconds) and a hash of its safetensors header (``checkpoint_identity``), so a
  file rewritten, replaced or touched is a different checkpoint;
- the options that change the result (the caller's: quantization mode, dtype, packing
  layout and its tile size) and ``CACHE_FORMAT``.

A different checkpoint or different options is a different key: the old entry is never
read for it (and entries made from an older state of the same checkpoint with the same
options are deleted when the new one is stored). An entry that cannot be read, or whose
tensors do not have the dtypes and shapes the model needs, is a miss and is deleted.

A hit maps the entry's file copy-on-write (``mmap.ACCESS_COPY``) and hands out views of
it: nothing is read or copied at load, pages come from the page cache when first touched
and are shared with it (and with every other process that maps the same entry); the
mapping asks for them in 2 MiB folios (``_advise_huge_pages``). An entry
is written to a temporary name and renamed into place, so a crash or two loads at once
never leave a partial entry under its name; a file already mapped keeps its contents when
it is replaced or deleted.

Where: ``$NBENGINE_LOAD_CACHE`` if set (``0`` turns the cache off), else
``$NBENGINE_CACHE/load`` (``NBENGINE_CACHE`` defaults to ``~/.cache/nbengine``).
Delete the directory to clear it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import struct
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from nbengine.model.files import open_regular
from nbengine.model.weights import read_safetensors_header

__all__ = ["CACHE_FORMAT", "LoadCache", "cache_root", "checkpoint_identity", "wait_for_stores"]

logger = logging.getLogger(__name__)

# Bump when the quantized formats (ops/quant.py), the packed layout (ops/native.py) or
# what an entry holds change. 2: tensors 64-byte aligned, bfloat16 packed entries. 3: int4
# rows in windows of 16 groups. 4: int4 rows by blocks of four rows.
CACHE_FORMAT = 4

Quantized = dict[str, tuple[torch.Tensor, torch.Tensor]]

_ALIGN = 64  # every tensor's data starts on a cache line of the file (and of a mapping)


def cache_root() -> Path | None:
    """The cache directory, or None when ``NBENGINE_LOAD_CACHE=0`` turns it off."""
    where = os.environ.get("NBENGINE_LOAD_CACHE")
    if where == "0":
        return None
    if where:
        return Path(where).expanduser()
    base = os.environ.get("NBENGINE_CACHE") or Path.home() / ".cache" / "nbengine"
    return Path(base).expanduser() / "load"


# The dtypes of an entry's tensors, as safetensors names them.
_CODES = {
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float32: "F32",
}
_DTYPES = {code: dtype for dtype, code in _CODES.items()}


def _write(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """Write ``tensors`` as a safetensors file, each one's bytes straight from its memory
    (no serialised copy of the whole entry first), each starting 64-byte aligned."""
    header: dict[str, Any] = {"__metadata__": metadata}
    layout: list[tuple[int, torch.Tensor]] = []  # (zero bytes before it, tensor)
    at = 0
    for name, t in tensors.items():
        pad = -at % _ALIGN
        if pad:
            header[f"__pad{len(layout)}__"] = {
                "dtype": "U8",
                "shape": [pad],
                "data_offsets": [at, at + pad],
            }
            at += pad
        n = t.numel() * t.element_size()
        header[name] = {
            "dtype": _CODES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [at, at + n],
        }
        layout.append((pad, t))
        at += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % _ALIGN)  # the data starts aligned too
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for pad, t in layout:
            f.write(bytes(pad))
            if t.numel():
                f.write(t.contiguous().view(torch.uint8).view(-1).numpy().data)


def _advise_huge_pages(buf: mmap.mmap) -> None:
    """Ask for the entry's pages in 2 MiB folios (``MADV_HUGEPAGE``), before any is touched.

    Where the page cache does not hold the entry yet (a first map after a reboot, or after
    other work evicted it), the first decode step faults it in through this mapping; with
    the advice each fault reads a 2 MiB folio that maps with one TLB entry, without it the
    faults read small folios and map 4 KiB pages. The step reads every weight once, so
    the TLB misses cost it 4-6% on the 1B shape (decode step p50: bf16 92-95 -> 87-91 ms,
    int8 46-48 -> 43-46, int4 31-32 -> 29.3-29.5; docs/benchmarks.md, "Huge pages for the
    load cache"). Pages the page cache already holds keep their folios."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None:
        return
    try:
        buf.madvise(advice)
    except OSError:  # no transparent huge pages here: the mapping works as it is
        pass


# Entries being written by background threads (``LoadCache.store_tensors``).
_stores: list[threading.Thread] = []
_stores_lock = threading.Lock()


def wait_for_stores(timeout: float | None = None) -> bool:
    """Wait until every entry being written in the background is written (or
    ``timeout`` seconds pass); True when none is left. Process exit waits for them too."""
    deadline = None if timeout is None else time.monotonic() + timeout
    with _stores_lock:
        threads = list(_stores)
    for thread in threads:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        thread.join(left)
    with _stores_lock:
        _stores[:] = [t for t in _stores if t.is_alive()]
        return not _stores


def _lower_priority() -> None:
    """Lower this thread's CPU priority (Linux: nice is per thread), so a background store
    takes the cores only when the engine leaves them."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):
        pass


def _header_hash(path: Path) -> str:
    """sha256 of the safetensors header of ``path`` (the file was checked already)."""
    with open_regular(path) as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return hashlib.sha256(f.read(length)).hexdigest()


def checkpoint_identity(files: list[Path]) -> list[dict[str, Any]]:
    """What identifies the checkpoint made of ``files``: name, size, mtime, header hash."""
    out: list[dict[str, Any]] = []
    for f in files:
        st = os.stat(f)
        out.append(
            {
                "file": f.name,
                "size": st.st_size,
                "mtime_ns": st.st_mtime_ns,
                "header_sha256": _header_hash(f),
            }
        )
    return out


class LoadCache:
    """The cache entry for one checkpoint (``files`` of the model directory ``model``)
    with ``options``; ``root`` None: no cache (every lookup a miss, nothing stored)."""

    def __init__(
        self, root: Path | None, model: Path, files: list[Path], options: dict[str, Any]
    ) -> None:
        self.root = root
        self.model = str(model.resolve())
        self.options = {**options, "format": CACHE_FORMAT}
        self.identity = checkpoint_identity(files) if root is not None else []
        blob = json.dumps(
            {"model": self.model, "identity": self.identity, "options": self.options},
            sort_keys=True,
        )
        self.key = hashlib.sha256(blob.encode()).hexdigest()[:24]

    @property
    def weights_file(self) -> Path | None:
        """The entry's safetensors file (None without a cache)."""
        return None if self.root is None else self.root / f"{self.key}.safetensors"

    def _meta_file(self) -> Path:
        assert self.root is not None
        return self.root / f"{self.key}.json"

    def restore_tensors(
        self, wanted: dict[str, tuple[torch.Size, torch.dtype]]
    ) -> dict[str, torch.Tensor] | None:
        """Name -> a view of the mapped entry for every name of ``wanted`` (its expected
        shape and dtype), or None on a miss (no entry, or one that does not fit: then it
        is deleted). The views are copy-on-write: a write stays in this process."""
        target = self.weights_file
        if target is None or not target.is_file() or not self._meta_file().is_file():
            return None
        out: dict[str, torch.Tensor] = {}
        try:
            if sys.byteorder != "little":
                raise ValueError("entries are little-endian")
            entries = read_safetensors_header(target)  # checks the file's size too
            with open_regular(target) as f:
                (length,) = struct.unpack("<Q", f.read(8))
                buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            _advise_huge_pages(buf)
            for name, (shape, dtype) in wanted.items():
                entry = entries[name]
                if _DTYPES.get(entry.dtype) != dtype or torch.Size(entry.shape) != shape:
                    raise ValueError(
                        f"{name} is {entry.dtype} {list(entry.shape)}, expected "
                        f"{_CODES.get(dtype, dtype)} {list(shape)}"
                    )
                if not shape.numel():
                    out[name] = torch.empty(shape, dtype=dtype)
                    continue
                t = torch.frombuffer(
                    buf, dtype=dtype, count=shape.numel(), offset=8 + length + entry.begin
                )
                out[name] = t.view(shape)
        except Exception as exc:  # a damaged or foreign entry: a miss, and removed
            logger.warning("Load cache entry %s is unusable (%s); making it again.", target, exc)
            self._remove(self.key)
            return None
        logger.info("Mapped %d tensors from the load cache (%s).", len(out), target)
        return out

    def restore(self, shapes: dict[str, tuple[torch.Size, torch.Size]]) -> Quantized | None:
        """Module name -> ``(qweight, scales)`` for every module of ``shapes`` (their
        expected shapes), or None on a miss (no entry, or one that does not fit). Their
        dtypes are those the entry holds (ops/quant.py chose them when it was made)."""
        target = self.weights_file
        if target is None or not target.is_file():
            return None
        try:
            entries = read_safetensors_header(target)
        except Exception:  # restore_tensors says why, and deletes it
            entries = {}
        wanted: dict[str, tuple[torch.Size, torch.dtype]] = {}
        for name, (q_shape, s_shape) in shapes.items():
            for suffix, shape in ((".qweight", q_shape), (".scales", s_shape)):
                entry = entries.get(name + suffix)
                dtype = _DTYPES.get(entry.dtype, torch.uint8) if entry else torch.uint8
                wanted[name + suffix] = (torch.Size(shape), dtype)
        views = self.restore_tensors(wanted)
        if views is None:
            return None
        return {name: (views[f"{name}.qweight"], views[f"{name}.scales"]) for name in shapes}

    def store(self, quantized: Quantized, background: bool = False) -> None:
        """Store the quantized layers ``quantized`` (``store_tensors``)."""
        tensors: dict[str, torch.Tensor] = {}
        for name, (q, s) in quantized.items():
            tensors[f"{name}.qweight"], tensors[f"{name}.scales"] = q, s
        self.store_tensors(tensors, background)

    def store_tensors(self, tensors: dict[str, torch.Tensor], background: bool = False) -> None:
        """Write the entry (atomically: a temporary file renamed), and delete entries made
        from an older state of the same checkpoint with the same options. A failure to
        write (disk full, read-only) is logged, never raised: the cache only saves time.

        ``background``: in a thread of lower priority, so the load does not wait for the
        write (writing 2.5 GB took seconds here: fresh page-cache pages); ``tensors`` must
        not change meanwhile. ``wait_for_stores`` waits for it, and so does process exit
        (a killed process leaves a temporary file, deleted by a later store)."""
        if self.root is None:
            return
        if background:

            def write() -> None:
                _lower_priority()
                self.store_tensors(tensors)

            thread = threading.Thread(target=write, name="nbengine-load-cache-store")
            with _stores_lock:
                _stores[:] = [t for t in _stores if t.is_alive()]
                _stores.append(thread)
            thread.start()
            return
        target = self.weights_file
        assert target is not None
        tmp: Path | None = None
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            # A name of its own (two threads or processes may store the same entry).
            fd, name = tempfile.mkstemp(dir=self.root, prefix=f".{self.key}.", suffix=".tmp")
            os.close(fd)
            tmp = Path(name)
            _write(tmp, tensors, {"key": self.key})
            tmp.replace(target)
            meta = {"model": self.model, "identity": self.identity, "options": self.options}
            tmp = tmp.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(meta, indent=1))
            tmp.replace(self._meta_file())
        except OSError as exc:
            logger.warning("Cannot write the load cache entry %s: %s", target, exc)
            if tmp is not None:
                tmp.unlink(missing_ok=True)
            return
        self._prune()

    def _prune(self) -> None:
        assert self.root is not None
        for tmp in self.root.glob(".*.tmp"):  # left by a crash an hour ago or more
            try:
                if time.time() - tmp.stat().st_mtime > 3600:
                    tmp.unlink()
            except OSError:
                continue
        for meta_file in self.root.glob("*.json"):
            key = meta_file.stem
            if key == self.key:
                continue
            try:
                meta = json.loads(meta_file.read_text())
            except (OSError, ValueError):
                continue
            if meta.get("model") == self.model and meta.get("options") == self.options:
                self._remove(key)  # the same checkpoint and options, an older state

    def _remove(self, key: str) -> None:
        assert self.root is not None
        for suffix in (".safetensors", ".json"):
            (self.root / f"{key}{suffix}").unlink(missing_ok=True)
