"""Where each parameter of our modules comes from in a Hugging Face checkpoint, and the
checked reading of a safetensors file's header.

``read_safetensors_header`` is the one reader of weight-file headers (the memory plan and
the loader both use it). A weight file is untrusted input (docs/errors.md lists what is
refused): the header is validated whole before safetensors or torch sees the file, so
that a hostile one is a ``ModelLoadError`` naming the file and the problem, never a hang
(a FIFO), a ``RecursionError`` (JSON nested 200,000 deep) or a bare ``ValueError`` or
``TypeError``.
"""

from __future__ import annotations

import math
import struct
from pathlib import Path
from typing import NamedTuple

from nbengine.model.errors import ModelLoadError
from nbengine.model.files import loads_bounded, open_regular
from nbengine.validation import is_int


class WeightSource(NamedTuple):
    """Rows ``[offset, offset + rows)`` (dim 0) of a parameter come from HF tensor ``name``.

    ``transpose`` marks GPT-2's Conv1D tensors, stored ``[in, out]``: they are transposed
    to ``nn.Linear``'s ``[out, in]`` before the rows are placed.
    """

    name: str
    offset: int
    rows: int
    transpose: bool = False


WeightMap = dict[str, list[WeightSource]]

MAX_HEADER_BYTES = 100_000_000  # the safetensors format's own limit on the JSON header

# Every dtype of the safetensors format, with its width in bits (F4 and F6 pack several
# elements per byte: a tensor of them must still fill whole bytes).
SAFETENSORS_DTYPE_BITS: dict[str, int] = {
    "BOOL": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "C64": 64,
    "F64": 64,
    "I64": 64,
    "U64": 64,
}


class TensorEntry(NamedTuple):
    """One tensor of a safetensors header: its bytes are ``[begin, end)`` of the data
    that follows the header."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def _short(value: object, limit: int = 60) -> str:
    """``repr(value)``, cut to ``limit`` characters (a hostile header may hold anything)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _entry(name: str, info: object) -> TensorEntry:
    """The checked entry of tensor ``name``; ``ValueError`` saying what is wrong."""
    if not isinstance(info, dict):
        raise ValueError(f"the entry of tensor {name!r} is not an object: {_short(info)}")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in SAFETENSORS_DTYPE_BITS:
        raise ValueError(
            f"tensor {name!r}: dtype {_short(dtype)} is not a safetensors dtype "
            f"({', '.join(SAFETENSORS_DTYPE_BITS)})"
        )
    if not isinstance(shape, list) or not all(is_int(d) and d >= 0 for d in shape):
        raise ValueError(
            f"tensor {name!r}: shape must be a list of non-negative integers, got {_short(shape)}"
        )
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(is_int(o) and o >= 0 for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise ValueError(
            f"tensor {name!r}: data_offsets must be two integers [begin, end] with "
            f"0 <= begin <= end, got {_short(offsets)}"
        )
    bits = math.prod(shape) * SAFETENSORS_DTYPE_BITS[dtype]
    if bits % 8:
        raise ValueError(f"tensor {name!r}: shape {shape} of {dtype} does not fill whole bytes")
    begin, end = offsets
    if end - begin != bits // 8:
        raise ValueError(
            f"tensor {name!r}: data_offsets [{begin}, {end}] hold {end - begin} bytes, but "
            f"shape {_short(shape)} of {dtype} needs {bits // 8}"
        )
    return TensorEntry(dtype, tuple(shape), begin, end)


def _check_layout(entries: dict[str, TensorEntry], data_bytes: int) -> None:
    """The tensors tile the data exactly, in offset order: no overlap, no gap, no bytes
    left over (the format's rule, which safetensors enforces too)."""
    at = 0
    for name, e in sorted(entries.items(), key=lambda item: (item[1].begin, item[1].end)):
        if e.end > data_bytes:
            raise ValueError(
                f"tensor {name!r}: data_offsets end at byte {e.end}, past the end of the "
                f"data ({data_bytes} bytes after the header: is the file truncated?)"
            )
        if e.begin != at:
            kind = "overlap the tensor before them" if e.begin < at else "leave a gap"
            raise ValueError(
                f"tensor {name!r}: data_offsets [{e.begin}, {e.end}] {kind} (the data "
                f"before them ends at byte {at})"
            )
        at = e.end
    if at != data_bytes:
        raise ValueError(
            f"the tensors cover {at} bytes of data, but the file holds {data_bytes} after "
            "its header"
        )


def _parse_header(raw: bytes, data_bytes: int) -> dict[str, TensorEntry]:
    """The checked tensors of the JSON header ``raw``; ``ValueError`` saying why not."""
    try:
        header = loads_bounded(raw)
    except ValueError as exc:
        raise ValueError(f"invalid safetensors header: {exc}") from exc
    if not isinstance(header, dict):
        raise ValueError("invalid safetensors header: it is not a JSON object")
    entries: dict[str, TensorEntry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
                raise ValueError("__metadata__ must be an object of strings")
            continue
        entries[name] = _entry(name, info)
    _check_layout(entries, data_bytes)
    return entries


def read_safetensors_header(path: Path) -> dict[str, TensorEntry]:
    """Tensor name -> entry, from the header of the safetensors file ``path``, all checked.

    Refused with a ``ModelLoadError`` naming ``path``: a path that is not a regular file
    (model/files.py), a header length beyond the file or the format's limit, a header that
    is not UTF-8 JSON nested within bounds, an unknown dtype, a shape that is not a list of
    non-negative integers, ``data_offsets`` that do not fit the shape and dtype or do not
    tile the data exactly. No tensor is read.
    """
    with open_regular(path) as f:
        try:
            size = f.seek(0, 2)
            f.seek(0)
            if size < 8:
                raise ValueError(f"the file is {size} bytes, too short for a safetensors header")
            (length,) = struct.unpack("<Q", f.read(8))
            # A garbage file would announce any length: check it before reading.
            if length > min(size - 8, MAX_HEADER_BYTES):
                raise ValueError(
                    f"header length {length} in a file of {size} bytes (the format allows at "
                    f"most {MAX_HEADER_BYTES})"
                )
            raw = f.read(length)
            if len(raw) != length:
                raise ValueError(f"the file ended inside its {length}-byte header")
            return _parse_header(raw, size - 8 - length)
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"Cannot open weight file {path}: {exc}.") from exc
