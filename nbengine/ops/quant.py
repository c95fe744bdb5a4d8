"""Weight-only quantization: int8 per output channel, int4 in groups (docs/quantization.md).

Formats (the native kernels in ops/kernels.c read exactly these tensors):

``int8``: ``W[n, k] ~ q[n, k] * scale[n]``, symmetric, ``q`` int8 in -127..127 and
``scale = max_k |W[n, k]| / 127`` (float32). Rows are zero-padded to a multiple of 32
inputs.

``int4`` (``int4-g32``): ``W[n, k] ~ q[n, k] * s[n, g] + z[n, g]`` for each group ``g`` of
``G`` consecutive inputs (G = 64, or 32), asymmetric: ``z`` is the group's minimum and
``s`` its range / 15, both float16, ``q`` in 0..15. Two values per byte: byte ``b`` of a
group's ``G / 2`` bytes holds element ``b`` in its low nibble and element ``G / 2 + b``
in its high nibble (the kernel unpacks 32 consecutive values from 16 bytes without a
shuffle). Rows are zero-padded to a multiple of ``G``. Within a row the groups' bytes are
interleaved in windows of 16 groups (the last window: the groups left over): each group's
bytes are ``G / 8`` dwords of four, and dword ``j`` of the window's group ``l`` lies at
dword ``j * c + l`` of a window of ``c`` groups. So each 64 bytes of a full window hold
one dword of each of 16 groups, and the kernel's 16 int32 lanes sum one group each over
the whole window, scaling once per window instead of once per 64 bytes
(``interleave_groups``; docs/quantization.md, "Kernels"). Rows then go by blocks of four
(``interleave_rows``): within each block of ``R`` rows ``4 b ..`` (``R = 4``; the last
block: the rows left over), the rows' chunks (the 64-byte runs of full windows, the
``4 c``-byte runs of a last window of ``c`` groups) take turns, so the chunk that starts at
byte ``off`` of row ``4 b + i`` starts at byte ``R * off + i * size`` of the block (``size``:
the chunk's). The four rows a kernel
multiplies together are then one stream in address order. The tensor keeps its shape
``[N, Kp / 2]``; a slice of rows is a valid int4 tensor when it starts at a multiple of 4.

The torch functions here are the reference of the native kernels (tests/ops/test_quant.py
checks one against the other) and the path taken where the kernels are unavailable.
The reference product dequantizes a slice of output rows at a time, so it too never holds
the whole weight dequantized.

Products, as the kernels compute them (bfloat16 inputs):

- int8: each row of ``x`` is scaled to int16 (``round(x * 32767 / max|x|)``; the error
  is at most 1/65534 of the row's largest value, below bfloat16's own rounding of
  ``x``), and the dot products with the integer weights are exact integer sums, scaled
  afterwards: one AVX-512 VNNI instruction per 32 products below ``native.AMX_ROWS``
  rows, and from there on, on CPUs with AMX, AMX int8 tile products of the weights as
  they lie in memory (the int16 inputs split into a high and a low byte): the same
  integer sums, so the same values to float32 rounding, at a fraction of the cost;
  without AMX, from ``INT8_TILE_ROWS`` rows on, bfloat16 tiles (below).
- int4 below ``native.AMX_ROWS`` rows (at any number of rows without AMX): each group of ``G``
  inputs of a row (the weights' groups) is scaled to int8 on its own (``round(x * 127 /
  max|x|)`` over the group: an error of at most 1/254 of the group's largest value), and
  the dot products are exact integer sums, scaled by the group's two scales afterwards:
  one VNNI instruction per 64 products, which keeps int4 decode at memory speed where
  int16 inputs left it compute bound (docs/quantization.md, "Kernels").
- int4 from ``native.AMX_ROWS`` rows on CPUs with AMX: the weights are dequantized to
  bfloat16, 16 output rows at a time into a buffer that stays in cache, and multiplied on
  AMX bfloat16 tiles by ``x`` as it is; elsewhere int8 from ``INT8_TILE_ROWS`` rows on
  (batched decode, prefill), one tile of 64 output rows at a time with the bfloat16
  kernel. Either way the products see the weights rounded to bfloat16, as a bfloat16
  model's are. (int4's row kernel stays ahead of those tiles at every row count, so
  without AMX it takes every product, and a row's int4 product never depends on the
  batch.)
- On CPUs where oneDNN multiplies bfloat16 on AMX tiles (ops/linear.py), products of
  ``dense_min_rows()`` rows or more (long prefill chunks) take none of these: the
  weight is dequantized to bfloat16 (``_DENSE_TILE_BYTES`` at a time, into one buffer per
  thread that is reused from call to call) and multiplied in oneDNN, whose AMX kernels
  do many rows faster than the tile kernels above (their crossover: ``DENSE_MIN_ROWS``).
  Those products, too, see the weights rounded to bfloat16.

float32 inputs (float32 models: the kernels are not used) are multiplied in float32.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from nbengine.ops import native
from nbengine.ops.linear import onednn_amx_supported

logger = logging.getLogger(__name__)

# mode -> group size (None: int8 per output channel)
QUANTIZATION_MODES: dict[str, int | None] = {"int8": None, "int4": 64, "int4-g32": 32}
_INT8_ALIGN = 32
_REF_ROWS = 4096  # output rows the torch reference dequantizes at a time
# From this many input rows on (and with an even K), the native kernels multiply int8
# weights dequantized to bfloat16 tile by tile (NB_Q8_TILE_ROWS in ops/kernels.c), except
# where the AMX tile kernels take those rows; the reference rounds the weights the same
# way there. int4 keeps its row kernel at every row count where AMX is not used.
INT8_TILE_ROWS = 64
_WINDOW = 16  # groups per window of the int4 rows (module docstring)
_ROW_BLOCK = 4  # int4 rows whose chunks take turns (module docstring)


# bfloat16 bytes of weight the dense path (module docstring) dequantizes at a time: a
# layer of the default model's size at once, a large lm_head in slices.
_DENSE_TILE_BYTES = 32 << 20

# Products of this many rows or more take the dense path. Dequantizing costs the same
# whatever the rows (a write of the bfloat16 weight, then oneDNN's own re-layout of it),
# while the kernels cost in proportion to the rows. Below it the AMX tile kernels
# (native.AMX_ROWS rows on) win: 16 layers of the Llama-3.2-1B shape plus its head, two
# threads, 2026-12-03, load ~1, AMX kernel against dense: int8 147 against 330 ms at 96
# rows, 473 against 507 at 256, 1130 against 828 at 512 (int4: 175/320, 477/476,
# 1017/836). Where the AMX kernels cannot run (the OS refused the tile state) the VNNI
# row kernels do, and those lose to the dense path from about 96 rows (2026-12-02: 1.3-2x
# faster than it at 16-64 rows, up to 2.3x slower from 128 on). Below it, decode steps
# stay on the decode plan too (model/runner.py).
DENSE_MIN_ROWS = 256
_DENSE_MIN_ROWS_WITHOUT_AMX = 96


def dense_min_rows() -> int:
    """The rows from which quantized products take the dense path, where it exists
    (``dense_supported``): ``DENSE_MIN_ROWS``, or fewer where the AMX kernels cannot run."""
    kernels = native.kernels()
    if kernels is not None and kernels.amx:
        return DENSE_MIN_ROWS
    return min(DENSE_MIN_ROWS, _DENSE_MIN_ROWS_WITHOUT_AMX)


class _DenseScratch(threading.local):
    """One bfloat16 buffer per thread for the dense path's dequantized weights.

    A fresh buffer per product would be fresh memory each time (glibc maps allocations
    this large anew and unmaps them on free), and first writes to fresh memory run at
    0.2-1 GB/s on this project's VMs: the dequantization of a 1B model's weights then
    took longer than the products. One buffer per thread, because engines in one process
    run their steps on separate threads at once."""

    buffer: torch.Tensor | None = None

    def take(self, rows: int, cols: int) -> torch.Tensor:
        """A ``[rows, cols]`` bfloat16 view of this thread's buffer (grown as needed);
        valid until the thread's next ``take``."""
        need = rows * cols
        if self.buffer is None or self.buffer.numel() < need:
            self.buffer = torch.empty(need, dtype=torch.bfloat16)
        return self.buffer[:need].view(rows, cols)


_scratch = _DenseScratch()


def dense_supported() -> bool:
    """True when quantized products of ``DENSE_MIN_ROWS`` rows or more take the dense path
    (dequantized bfloat16 weights in oneDNN): where oneDNN has AMX kernels."""
    return _native_enabled() and onednn_amx_supported(torch.bfloat16)


def bytes_per_weight(mode: str) -> float:
    """Bytes one weight takes in ``mode`` (scales included; row padding not)."""
    group = QUANTIZATION_MODES[mode]
    if group is None:
        return 1.0  # plus 4 bytes of scale per output row
    return 0.5 + 4.0 / group  # two float16 (scale, zero) per group


def _padded(k: int, multiple: int) -> int:
    return -(-k // multiple) * multiple


# Weights quantized at a time (a slice of whole output rows): the float32 temporaries of
# a slice take tens of MiB where a whole 128k-vocabulary head would take over 1 GiB each.
# Not much smaller: every torch op on a slice pays a fixed cost (its parallel region),
# which on a loaded machine outweighs any gain of staying in the caches.
QUANT_ELEMENTS = 1 << 22


def quant_rows(in_features: int) -> int:
    """Output rows per slice of ``quantize_weight`` for rows of ``in_features`` inputs (a
    multiple of int4's blocks of four rows)."""
    return max(_ROW_BLOCK, QUANT_ELEMENTS // max(1, in_features) // _ROW_BLOCK * _ROW_BLOCK)


def quantized_shapes(
    out_features: int, in_features: int, mode: str
) -> tuple[torch.Size, torch.Size]:
    """The shapes of ``(q, scales)`` that ``quantize_weight`` makes for such a weight."""
    group = QUANTIZATION_MODES[mode]
    if group is None:
        return torch.Size((out_features, _padded(in_features, _INT8_ALIGN))), torch.Size(
            (out_features,)
        )
    kp = _padded(in_features, group)
    return torch.Size((out_features, kp // 2)), torch.Size((out_features, kp // group, 2))


def quantize_weight(
    rows: Iterable[torch.Tensor], out_features: int, in_features: int, mode: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scales)`` of a weight ``[out_features, in_features]`` given as consecutive
    slices of its rows (``rows``, any float dtype), quantized slice by slice in ``mode``
    (row by row, so the result equals quantizing the whole weight at once). Only one
    slice and the result are held: a weight read from a mapped checkpoint a slice at a
    time is never whole in memory (model/loader.py)."""
    group = QUANTIZATION_MODES[mode]
    if group is None:
        q = torch.empty(out_features, _padded(in_features, _INT8_ALIGN), dtype=torch.int8)
        s = torch.empty(out_features, dtype=torch.float32)
    else:
        kp = _padded(in_features, group)
        q = torch.empty(out_features, kp // 2, dtype=torch.uint8)
        s = torch.empty(out_features, kp // group, 2, dtype=torch.float16)
    at = 0
    for chunk in _row_chunks(rows, quant_rows(in_features)):
        qc, sc = quantize_int8(chunk) if group is None else quantize_int4(chunk, group)
        q[at : at + chunk.shape[0]] = qc
        s[at : at + chunk.shape[0]] = sc
        at += chunk.shape[0]
    if at != out_features:
        raise ValueError(f"rows add up to {at} output rows, expected {out_features}")
    return q, s


def _row_chunks(rows: Iterable[torch.Tensor], step: int) -> Iterator[torch.Tensor]:
    """Slices of ``rows`` (consecutive slices of any sizes) re-cut to ``step`` rows each, a
    multiple of 4 (the last one shorter), so int4's blocks of four rows (module docstring)
    never straddle two slices. A slice crossing two given ones is the one copy made."""
    step = -(-step // _ROW_BLOCK) * _ROW_BLOCK
    carry: torch.Tensor | None = None
    for part in rows:
        if carry is not None:
            need = step - carry.shape[0]
            carry = torch.cat([carry, part[:need]])
            part = part[need:]
            if carry.shape[0] < step:
                continue
            yield carry
            carry = None
        whole = part.shape[0] // step * step
        for start in range(0, whole, step):
            yield part[start : start + step]
        if whole < part.shape[0]:
            carry = part[whole:]
    if carry is not None:
        yield carry


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``W [N, K]`` -> ``(q int8 [N, Kp], scale float32 [N])`` (module docstring)."""
    w = weight.detach().float()
    n, k = w.shape
    scale = w.abs().amax(dim=1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.zeros(n, _padded(k, _INT8_ALIGN), dtype=torch.int8)
    q[:, :k] = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale.contiguous()


def quantize_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``W [N, K]`` -> ``(q uint8 [N, Kp / 2], (scale, zero) float16 [N, Kp / G, 2])``."""
    if group_size % 32 or group_size <= 0:
        raise ValueError(f"group_size must be a positive multiple of 32, got {group_size}.")
    w = weight.detach().float()
    n, k = w.shape
    kp = _padded(k, group_size)
    if kp != k:
        w = torch.cat([w, torch.zeros(n, kp - k)], dim=1)
    groups = w.view(n, kp // group_size, group_size)
    lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)
    zero = lo.to(torch.float16)
    scale = ((hi - zero.float()) / 15.0).to(torch.float16)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((groups - zero.float()[..., None]) / scale.float()[..., None])
    q = q.clamp_(0, 15).to(torch.uint8)
    half = group_size // 2
    packed = interleave_rows(interleave_groups(q[..., :half] | (q[..., half:] << 4)), group_size)
    return packed, torch.stack([scale, zero], dim=-1).contiguous()


def _row_regions(row_bytes: int, group_size: int) -> list[tuple[int, int, int]]:
    """``(start, stop, chunk)``: the byte ranges of an int4 row in windows and the size of
    their chunks: 64 bytes over the full windows, ``4 c`` over a last window of ``c``."""
    half = group_size // 2
    ng = row_bytes // half
    full = ng // _WINDOW * _WINDOW
    regions = [(0, full * half, 4 * _WINDOW)] if full else []
    if full < ng:
        regions.append((full * half, row_bytes, 4 * (ng - full)))
    return regions


def _permute_row_blocks(rows: torch.Tensor, group_size: int, forward: bool) -> torch.Tensor:
    """``interleave_rows`` (``forward``) or its inverse, into a new tensor."""
    rows = rows.contiguous()
    n, row_bytes = rows.shape
    out = torch.empty_like(rows)
    whole = n // _ROW_BLOCK * _ROW_BLOCK
    for b0, b1 in ((0, whole), (whole, n)):  # the blocks of four, then a last shorter one
        r = min(_ROW_BLOCK, b1 - b0)
        if r == 0:
            continue
        by_row = (rows if forward else out)[b0:b1].view(-1, r, row_bytes)
        by_block = (out if forward else rows)[b0:b1].view(-1, r * row_bytes)
        for start, stop, chunk in _row_regions(row_bytes, group_size):
            # Bytes [start, stop) of a block's R rows are bytes [R start, R stop) of the
            # block: [R rows, chunks, chunk] there, [chunks, R rows, chunk] here.
            per_row = (-1, r, (stop - start) // chunk, chunk)
            if forward:
                part = by_row[:, :, start:stop].reshape(per_row).transpose(1, 2)
                by_block[:, r * start : r * stop] = part.reshape(-1, r * (stop - start))
            else:
                part = by_block[:, r * start : r * stop].reshape(
                    -1, (stop - start) // chunk, r, chunk
                )
                by_row[:, :, start:stop] = part.transpose(1, 2).reshape(-1, r, stop - start)
    return out


def interleave_rows(rows: torch.Tensor, group_size: int) -> torch.Tensor:
    """``[N, Kp / 2]`` int4 rows in windows, row by row -> the rows by blocks of four,
    their chunks taking turns (module docstring). ``deinterleave_rows`` undoes it."""
    return _permute_row_blocks(rows, group_size, forward=True)


def deinterleave_rows(rows: torch.Tensor, group_size: int) -> torch.Tensor:
    """The inverse of ``interleave_rows`` (``rows`` from a multiple of 4 on)."""
    return _permute_row_blocks(rows, group_size, forward=False)


def interleave_groups(groups: torch.Tensor) -> torch.Tensor:
    """``[N, ng, G / 2]`` bytes, group by group -> ``[N, ng * G / 2]`` rows in windows of
    16 groups, dword ``j`` of a window's group ``l`` at dword ``j * c + l`` (module
    docstring). ``deinterleave_groups`` undoes it."""
    n, ng, half = groups.shape
    full = ng // _WINDOW * _WINDOW
    parts = []
    if full:
        w = groups[:, :full].reshape(n, full // _WINDOW, _WINDOW, half // 4, 4)
        parts.append(w.transpose(2, 3).reshape(n, full * half))
    if full < ng:
        t = groups[:, full:].reshape(n, ng - full, half // 4, 4)
        parts.append(t.transpose(1, 2).reshape(n, (ng - full) * half))
    return torch.cat(parts, dim=1).contiguous() if len(parts) > 1 else parts[0].contiguous()


def deinterleave_groups(rows: torch.Tensor, group_size: int) -> torch.Tensor:
    """``[N, Kp / 2]`` int4 rows (in windows) -> their bytes ``[N, ng, G / 2]`` group by
    group: the inverse of ``interleave_groups``."""
    n, half_row = rows.shape
    half = group_size // 2
    ng = half_row // half
    full = ng // _WINDOW * _WINDOW
    parts = []
    if full:
        w = rows[:, : full * half].reshape(n, full // _WINDOW, half // 4, _WINDOW, 4)
        parts.append(w.transpose(2, 3).reshape(n, full, half))
    if full < ng:
        t = rows[:, full * half :].reshape(n, half // 4, ng - full, 4)
        parts.append(t.transpose(1, 2).reshape(n, ng - full, half))
    return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]


def dequantize(
    qweight: torch.Tensor, scales: torch.Tensor, in_features: int, group_size: int | None
) -> torch.Tensor:
    """The float32 ``[N, in_features]`` weight that ``qweight`` and ``scales`` stand for
    (int4: rows from a multiple of 4 on, module docstring)."""
    if group_size is None:
        return qweight[:, :in_features].float() * scales[:, None]
    b = deinterleave_groups(deinterleave_rows(qweight, group_size), group_size)
    n = b.shape[0]
    q = torch.cat([b & 15, b >> 4], dim=-1).float()
    s, z = scales[..., 0].float(), scales[..., 1].float()
    return (q * s[..., None] + z[..., None]).view(n, -1)[:, :in_features]


def quantize_rows_int16(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``x [M, K]`` -> ``(xq, sx)``: ``x ~ xq * sx[:, None]``, ``xq`` integers in
    -32767..32767 (as float32), ``sx = max|x| / 32767`` per row (float32, as the kernel)."""
    amax = x.abs().amax(dim=1)
    inv = torch.where(amax > 0, torch.tensor(32767.0) / amax, torch.zeros_like(amax))
    return torch.round(x * inv[:, None]).clamp_(-32768, 32767), amax / 32767.0


def quantize_groups_int8(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``x [M, K]`` -> ``(xq, sx)``: over each group ``g`` of ``group_size``
    inputs, ``x ~ xq * sx[:, g]``, ``xq`` integers in -127..127 (as float32 ``[M, Kp]``,
    zero-padded to the groups), ``sx = max|x| / 127`` of the group (float32, as the kernel).
    """
    m, k = x.shape
    kp = _padded(k, group_size)
    if kp != k:
        x = torch.cat([x, torch.zeros(m, kp - k)], dim=1)
    groups = x.view(m, kp // group_size, group_size)
    amax = groups.abs().amax(dim=-1)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    xq = torch.round(groups * inv[..., None]).clamp_(-127, 127)
    return xq.view(m, kp), amax / 127.0


def linear_quantized_reference(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    in_features: int,
    group_size: int | None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    bf16_rows: int | None = None,
    amx: bool = False,
) -> torch.Tensor:
    """``x [..., K] @ dequant(W).T (+ bias)`` in float32, rounded to ``out_dtype``.

    ``out_dtype`` None: the dtype of ``x``. Dequantizes ``_REF_ROWS`` output rows at a time.
    bfloat16 ``x`` is multiplied as the kernels do (module docstring), with exact sums:
    scaled to int16 per row (int8), to int8 per group (int4), or by the weights rounded
    to bfloat16: int8 from ``INT8_TILE_ROWS`` rows on with an even K, any mode from
    ``bf16_rows`` rows on (the dense path's threshold where it runs). With ``amx``, as
    the kernels multiply on an AMX CPU, from ``native.AMX_ROWS`` rows on int8 keeps its
    exact sums and int4 takes the rounded weights.
    """
    lead = x.shape[:-1]
    xf = x.reshape(-1, in_features).float()
    n = qweight.shape[0]
    y = torch.empty(xf.shape[0], n, dtype=torch.float32)
    bf16 = x.dtype == torch.bfloat16
    rows = xf.shape[0]
    on_amx = amx and rows >= native.AMX_ROWS  # int8: exact integer sums; int4: tiled
    tiled = bf16 and (
        (not on_amx and group_size is None and rows >= INT8_TILE_ROWS and in_features % 2 == 0)
        or (bf16_rows is not None and rows >= bf16_rows)
        or (on_amx and group_size is not None)
    )
    x_int16 = bf16 and group_size is None and not tiled
    x_int8 = bf16 and group_size is not None and not tiled
    if x_int16:
        xq, sx = quantize_rows_int16(xf)
        xd = xq.double()
    if x_int8:
        assert group_size is not None
        xq, sx = quantize_groups_int8(xf, group_size)
        # Exact in float64: each group's integers times its scale.
        xd = xq.double().view(xf.shape[0], -1, group_size) * sx.double()[..., None]
        xd = xd.view(xf.shape[0], -1)[:, :in_features]
    for start in range(0, n, _REF_ROWS):
        stop = min(n, start + _REF_ROWS)
        w = dequantize(qweight[start:stop], scales[start:stop], in_features, group_size)
        if x_int16:
            y[:, start:stop] = ((xd @ w.double().T) * sx.double()[:, None]).float()
            continue
        if x_int8:
            y[:, start:stop] = (xd @ w.double().T).float()
            continue
        if tiled:
            w = w.to(torch.bfloat16).float()
        y[:, start:stop] = xf @ w.T
    if bias is not None:
        y += bias.float()
    return y.to(out_dtype or x.dtype).view(*lead, n)


def _native_enabled() -> bool:
    return os.environ.get("NBENGINE_QUANT_NATIVE", "1") != "0"


class QuantLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` held quantized (inference only; module docstring)."""

    qweight: torch.Tensor
    scales: torch.Tensor
    bias: torch.Tensor | None
    _q: torch.Tensor
    _s: torch.Tensor
    _b: torch.Tensor | None

    def __init__(
        self,
        linear: nn.Linear,
        mode: str,
        quantized: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """``linear`` quantized in ``mode``; ``quantized`` (the ``(q, scales)`` of
        ``quantize_weight``, read from a checkpoint or the load cache) stands for its
        weight, which is then not read (only its dtype counts)."""
        super().__init__()
        if mode not in QUANTIZATION_MODES:
            raise ValueError(
                f"quantization must be one of {tuple(QUANTIZATION_MODES)}, got {mode!r}."
            )
        self.mode = mode
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.group_size = QUANTIZATION_MODES[mode]
        w = linear.weight.detach()
        if quantized is not None:
            q, s = quantized
        else:
            q, s = quantize_weight((w,), self.out_features, self.in_features, mode)
        self.register_buffer("qweight", q, persistent=False)
        self.register_buffer("scales", s, persistent=False)
        b = linear.bias
        self.register_buffer(
            "bias", None if b is None else b.detach().contiguous().clone(), persistent=False
        )
        # The native kernels take bfloat16 inputs; float32 models use the torch reference.
        self._kernels = (
            native.kernels() if w.dtype == torch.bfloat16 and _native_enabled() else None
        )
        self._q, self._s, self._b = self.qweight, self.scales, self.bias
        # Products of this many rows or more take the dense path (module docstring).
        self.dense_rows = (
            dense_min_rows() if self._kernels is not None and dense_supported() else None
        )

    @property
    def is_native(self) -> bool:
        """True when products run in the native kernels (else in the torch reference)."""
        return self._kernels is not None

    @property
    def weight_bytes(self) -> int:
        """Bytes of the quantized weight and its scales."""
        return self._q.numel() * self._q.element_size() + self._s.numel() * self._s.element_size()

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """``x [..., in_features]`` -> ``[..., out_features]`` (``out_dtype`` None: x's)."""
        kernels = self._kernels
        if kernels is None or x.dtype != torch.bfloat16:
            return linear_quantized_reference(
                x, self._q, self._s, self.in_features, self.group_size, self._b, out_dtype
            )
        out = out_dtype or torch.bfloat16
        if x.dim() != 2 or not x.is_contiguous():
            lead = x.shape[:-1]
            y = self.forward(x.reshape(-1, self.in_features).contiguous(), out_dtype)
            return y.view(*lead, self.out_features)
        if self.dense_rows is not None and x.shape[0] >= self.dense_rows:
            y = self._dense(kernels, x)
            return y if out == torch.bfloat16 else y.to(out)
        return kernels.linear_quantized(
            x, self._q, self._s, self.in_features, self.group_size, self._b, out
        )

    def _dense(self, kernels: native.NativeKernels, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T (+ b)`` with ``W`` dequantized to bfloat16, in oneDNN (bfloat16 out)."""
        n, k, b = self.out_features, self.in_features, self._b
        step = min(n, max(1, _DENSE_TILE_BYTES // (2 * k)))
        if n == step:
            w = kernels.dequantize(self._q, self._s, k, self.group_size, out=_scratch.take(n, k))
            return F.linear(x, w, b)
        y = torch.empty(x.shape[0], n, dtype=torch.bfloat16)
        for n0 in range(0, n, step):
            n1 = min(n, n0 + step)
            w = kernels.dequantize(
                self._q, self._s, k, self.group_size, (n0, n1), out=_scratch.take(n1 - n0, k)
            )
            # The slice's product is done before the next slice overwrites the buffer.
            y[:, n0:n1] = F.linear(x, w, None if b is None else b[n0:n1])
        return y

    def extra_repr(self) -> str:
        path = "native" if self.is_native else "torch reference"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, {self.mode}, {path}"
        )


def quantize_linears(model: nn.Module, mode: str) -> int:
    """Replace every ``nn.Linear`` of ``model`` by a ``QuantLinear`` in ``mode``; returns how many.

    Each layer's full-precision weight is released once its quantized copy exists (a tied
    ``lm_head`` gets its own quantized copy; the embedding it shares stays as it is).
    """
    if mode not in QUANTIZATION_MODES:
        raise ValueError(f"quantization must be one of {tuple(QUANTIZATION_MODES)}, got {mode!r}.")
    targets = [
        (parent, name, child)
        for parent in list(model.modules())
        for name, child in list(parent.named_children())
        if type(child) is nn.Linear
    ]
    for parent, name, child in targets:
        setattr(parent, name, QuantLinear(child, mode))
    logger.info("Quantized %d linear layers to %s.", len(targets), mode)
    return len(targets)
