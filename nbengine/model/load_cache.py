"""The load cache: a quantized model kept on disk, so that the next load of the same
checkpoint with the same options reads the quantized weights instead of quantizing
again (docs/quantization.md, "The load cache").

An entry is one safetensors file of every quantized layer's ``qweight`` and ``scales``
(named ``<module>.qweight`` / ``<module>.scales``) and a JSON file saying what it was made
from. Its key is a hash of

- the checkpoint's identity: for each weight file its name, size, modification time
  (nanoseconds) and a hash of its safetensors header (``checkpoint_identity``), so a
  file rewritten, replaced or touched is a different checkpoint;
- the options that change the result: the quantization mode, the dtype the weights are
  rounded to before quantizing, and ``CACHE_FORMAT``.

A different checkpoint or different options is a different key: the old entry is never
read for it (and entries made from an older state of the same checkpoint with the same
options are deleted when the new one is stored). An entry that cannot be read, or whose
tensors do not have the shapes the model needs, is a miss and is deleted.

Where: ``$NBENGINE_LOAD_CACHE`` if set (``0`` turns the cache off), else
``$NBENGINE_CACHE/quantized`` (``NBENGINE_CACHE`` defaults to ``~/.cache/nbengine``).
Delete the directory to clear it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
from pathlib import Path
from typing import Any, BinaryIO

import torch

from nbengine.model.files import open_regular
from nbengine.model.weights import TensorEntry, read_safetensors_header

__all__ = ["CACHE_FORMAT", "LoadCache", "cache_root", "checkpoint_identity"]

logger = logging.getLogger(__name__)

# Bump when the quantized formats (ops/quant.py) or what an entry holds change.
CACHE_FORMAT = 1

Quantized = dict[str, tuple[torch.Tensor, torch.Tensor]]


def cache_root() -> Path | None:
    """The cache directory, or None when ``NBENGINE_LOAD_CACHE=0`` turns it off."""
    where = os.environ.get("NBENGINE_LOAD_CACHE")
    if where == "0":
        return None
    if where:
        return Path(where).expanduser()
    base = os.environ.get("NBENGINE_CACHE") or Path.home() / ".cache" / "nbengine"
    return Path(base).expanduser() / "quantized"


# The dtypes of an entry's tensors, as safetensors names them.
_CODES = {torch.int8: "I8", torch.uint8: "U8", torch.float16: "F16", torch.float32: "F32"}
_DTYPES = {code: dtype for dtype, code in _CODES.items()}


def _write(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """Write ``tensors`` as a safetensors file, each one's bytes straight from its memory
    (no serialised copy of the whole entry first)."""
    header: dict[str, Any] = {"__metadata__": metadata}
    at = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        header[name] = {
            "dtype": _CODES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [at, at + n],
        }
        at += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for t in tensors.values():
            if t.numel():
                f.write(t.contiguous().view(torch.uint8).view(-1).numpy().data)


def _read(f: BinaryIO, data_start: int, entry: TensorEntry, shape: torch.Size) -> torch.Tensor:
    """The tensor of ``entry`` read from the open entry file ``f``, checked to be ``shape``."""
    dtype = _DTYPES.get(entry.dtype)
    if dtype is None or torch.Size(entry.shape) != shape:
        raise ValueError(f"a tensor is {entry.dtype} {list(entry.shape)}, expected {list(shape)}")
    t = torch.empty(shape, dtype=dtype)
    view = t.view(torch.uint8).view(-1).numpy().data
    f.seek(data_start + entry.begin)
    done = 0
    while done < len(view):
        n = f.readinto(view[done:])  # type: ignore[attr-defined]
        if not n:
            raise ValueError("the file ends early")
        done += n
    return t


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

    def restore(self, shapes: dict[str, tuple[torch.Size, torch.Size]]) -> Quantized | None:
        """Module name -> ``(qweight, scales)`` for every module of ``shapes`` (their
        expected shapes), or None on a miss (no entry, or one that does not fit)."""
        target = self.weights_file
        if target is None or not target.is_file() or not self._meta_file().is_file():
            return None
        out: Quantized = {}
        try:
            entries = read_safetensors_header(target)
            with open_regular(target) as f:
                (length,) = struct.unpack("<Q", f.read(8))
                for name, (q_shape, s_shape) in shapes.items():
                    q = _read(f, 8 + length, entries[f"{name}.qweight"], q_shape)
                    s = _read(f, 8 + length, entries[f"{name}.scales"], s_shape)
                    out[name] = (q, s)
        except Exception as exc:  # a damaged or foreign entry: a miss, and removed
            logger.warning("Load cache entry %s is unusable (%s); quantizing again.", target, exc)
            self._remove(self.key)
            return None
        logger.info("Read the quantized weights from the load cache (%s).", target)
        return out

    def store(self, quantized: Quantized) -> None:
        """Write the entry (atomically: a temporary file renamed), and delete entries made
        from an older state of the same checkpoint with the same options. A failure to
        write (disk full, read-only) is logged, never raised: the cache only saves time."""
        if self.root is None:
            return
        target = self.weights_file
        assert target is not None
        tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            tensors: dict[str, torch.Tensor] = {}
            for name, (q, s) in quantized.items():
                tensors[f"{name}.qweight"], tensors[f"{name}.scales"] = q, s
            _write(tmp, tensors, {"key": self.key})
            tmp.replace(target)
            meta = {"model": self.model, "identity": self.identity, "options": self.options}
            self._meta_file().write_text(json.dumps(meta, indent=1))
        except OSError as exc:
            logger.warning("Cannot write the load cache entry %s: %s", target, exc)
            tmp.unlink(missing_ok=True)
            return
        self._prune()

    def _prune(self) -> None:
        assert self.root is not None
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
