"""Native CPU kernels: ``kernels.c``, called through ctypes (built by ops/native_build.py).

Why native code: a decode step of a small model is a few hundred tiny operations and a
stream of weights through matrix-vector products. torch's bfloat16 paths for these
(``F.linear``, even oneDNN's prepacked ``_linear_pointwise``) read weights at about half
of the machine's memory bandwidth here, and each torch call costs microseconds of
dispatch. ``kernels.c`` holds a few kernels written for exactly these shapes.

This module holds the bindings: ``NativeKernels``, one typed method per kernel (ctypes
releases the GIL during every call), the VNNI weight layout the linear kernels read
(``pack_linear_weight``), and the entry points ``kernels()`` and ``loaded()``. How and
where the library is compiled and cached, and which CPUs can run it, is
ops/native_build.py.

Only on use: nothing is compiled or loaded until a bfloat16 path asks for a kernel, so a
float32 engine never builds the library (``loaded()`` serves optional uses, such as the
sampler's argmax, without triggering a build).

When not: the kernels need x86-64 with AVX-512 BF16 and VNNI. Without it, without a compiler, with
``NBENGINE_NATIVE=0``, or if the build fails, ``kernels()`` returns ``None`` and callers
keep their torch paths; ``unavailable_reason()`` says why. Every kernel has a plain-torch
reference it is tested against (tests/ops/test_native.py).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import subprocess
from pathlib import Path

import torch

from nbengine.ops import native_build

logger = logging.getLogger(__name__)

VNNI_TILE = 64  # output features per packed tile (NB_TILE in kernels.c)

_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_INT = ctypes.c_int
_F32 = ctypes.c_float
_SIGNATURES: dict[str, list[type]] = {
    "nb_linear_bf16": [_P, _P, _P, _P, _I64, _I64, _I64, _INT, _INT, _INT],
    "nb_rms_norm_bf16": [_P, _P, _P, _P, _P, _I64, _I64, _F32, _INT],
    "nb_silu_mul_bf16": [_P, _P, _I64, _I64, _INT],
    "nb_rotary_bf16": [_P, _P, _P, _P, _I64, _I64, _I64, _I64, _INT],
    "nb_cached_attention_bf16": [
        _P,
        _I64,
        _P,
        _P,
        _P,
        _P,
        _P,
        _I64,
        _I64,
        _I64,
        _I64,
        _I64,
        _I64,
        _F32,
        _INT,
        _I64,
    ],
    "nb_rope_attention_bf16": [
        *([_P, _I64] + [_P] * 9 + [_I64] * 6),
        _F32,
        _I64,
        _INT,
        _INT,
    ],
    "nb_decoder_decode": [_P, _P, _P, _P, _P, _P, _P, _P, _I64, _I64, _INT, _P, _P],
    "nb_argmax_f32": [_P, _I64, _I64, _P, _INT],
    "nb_lora_bf16": [_P, _P, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _INT, _INT],
    "nb_amx_usable": [],
    "nb_linear_q8": [_P, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _INT, _INT, _INT],
    "nb_dequantize_bf16": [_INT, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _I64, _INT],
    "nb_linear_q4": [_P, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _INT, _INT, _INT],
}
# Below this many rows (tokens) an elementwise kernel runs on the calling thread alone:
# waking an OpenMP worker costs more than the work (tens of microseconds when idle
# workers sleep, as OMP_WAIT_POLICY=PASSIVE makes them).
SMALL_ROWS = 16
# From this many rows on, quantized products run on AMX tiles where ``NativeKernels.amx``
# (NB_Q_AMX_ROWS in kernels.c).
AMX_ROWS = 16
# From this many rows on, bfloat16 products run on AMX tiles where ``NativeKernels.amx``
# (NB_BF16_AMX_ROWS in kernels.c). Below it a row's product does not depend on the rows
# beside it (docs/speculative-decoding.md, "Exactness"); from it on, neither, but it is
# rounded otherwise than alone.
BF16_AMX_ROWS = 12


class NativeKernels:
    """The loaded library, with one typed method per kernel (inputs are not copied)."""

    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.path = path
        self._lib = lib
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes = argtypes
            fn.restype = None
        self._linear = lib.nb_linear_bf16
        self._rms_norm = lib.nb_rms_norm_bf16
        self._silu_mul = lib.nb_silu_mul_bf16
        self._rotary = lib.nb_rotary_bf16
        self._cached_attention = lib.nb_cached_attention_bf16
        self._rope_attention = lib.nb_rope_attention_bf16
        self._argmax = lib.nb_argmax_f32
        # Raw entry point of the LoRA deltas (``lora_`` checks its arguments; the per-linear
        # hook of nbengine/lora/layers.py calls this with arguments built once per step);
        # it returns -1, writing nothing, for a slot or part out of range.
        self.lora_raw = lib.nb_lora_bf16
        self.lora_raw.restype = ctypes.c_int
        lib.nb_amx_usable.restype = ctypes.c_int
        # Whether the kernels that take ``amx`` run on AMX tiles when asked (the LoRA deltas,
        # quantized products of ``AMX_ROWS`` rows or more): the CPU has them and Linux
        # granted this process their state (asked on the first call).
        self.amx = bool(lib.nb_amx_usable())
        self._linear_q8 = lib.nb_linear_q8
        self._linear_q4 = lib.nb_linear_q4
        self._dequantize = lib.nb_dequantize_bf16
        # Raw entry point of the whole-stack decode (model/decode_plan.py builds its arguments);
        # it returns -1 for a token id outside the vocabulary.
        self.decoder_decode = lib.nb_decoder_decode
        self.decoder_decode.restype = ctypes.c_int

    @staticmethod
    def _threads(rows: int) -> int:
        return 1 if rows < SMALL_ROWS else torch.get_num_threads()

    @staticmethod
    def _attention_threads(block_tables: torch.Tensor, block_size: int, kv_heads: int) -> int:
        """One thread below 8192 (query row, key, KV head) triples to read, else all."""
        keys = block_tables.shape[0] * block_tables.shape[1] * block_size * kv_heads
        return 1 if keys < 8192 else torch.get_num_threads()

    def linear(
        self,
        x: torch.Tensor,
        w_packed: torch.Tensor,
        out_features: int,
        bias: torch.Tensor | None = None,
        out_dtype: torch.dtype = torch.bfloat16,
        num_threads: int | None = None,
        amx: bool = True,
    ) -> torch.Tensor:
        """``x [M, K] @ W.T (+ bias)`` for a ``W [N, K]`` packed by ``pack_linear_weight``.

        ``x`` must be a contiguous bfloat16 matrix with even ``K``; the result is
        ``[M, N]`` in ``out_dtype`` (bfloat16 or float32). ``amx``: from ``BF16_AMX_ROWS``
        rows on, where ``self.amx`` is True and ``K`` is a multiple of 32, the product
        runs on AMX tiles (the same float32 sums of bfloat16 products, in another order;
        each row's result depends on that row alone).
        """
        m, k = x.shape
        y = torch.empty(m, out_features, dtype=out_dtype)
        if num_threads is None:
            # A row or two is a stream of weights: splitting one layer's stream saves less
            # than waking a sleeping OpenMP worker costs (OMP_WAIT_POLICY=PASSIVE). The
            # decode plan splits a whole step's weights inside one parallel region instead.
            num_threads = 1 if m <= 2 else torch.get_num_threads()
        self._linear(
            x.data_ptr(),
            w_packed.data_ptr(),
            None if bias is None else bias.data_ptr(),
            y.data_ptr(),
            m,
            out_features,
            k,
            int(out_dtype == torch.float32),
            num_threads,
            int(amx),
        )
        return y

    def linear_quantized(
        self,
        x: torch.Tensor,
        qweight: torch.Tensor,
        scales: torch.Tensor,
        in_features: int,
        group_size: int | None,
        bias: torch.Tensor | None = None,
        out_dtype: torch.dtype = torch.bfloat16,
        num_threads: int | None = None,
        amx: bool = True,
    ) -> torch.Tensor:
        """``x [M, K] @ dequant(W).T (+ bias)`` for weights quantized by ops/quant.py.

        int8 (``group_size`` None): ``qweight`` int8 ``[N, Kp]``, ``scales`` float32 ``[N]``.
        int4: ``qweight`` uint8 ``[N, Kp / 2]``, ``scales`` float16 ``[N, Kp / G, 2]``
        (scale, zero). ``x`` contiguous bfloat16 with ``K = in_features``; the result is
        ``[M, N]`` in ``out_dtype`` (bfloat16 or float32). ``amx``: from ``AMX_ROWS`` rows
        on, where ``self.amx`` is True, the product runs on AMX tiles: int8 with the row
        kernels' integer sums, int4 by the weights rounded to bfloat16 (ops/quant.py,
        "Products"; ``linear_quantized_reference(..., amx=True)`` computes the same).
        """
        m = x.shape[0]
        n = qweight.shape[0]
        kp = qweight.shape[1] if group_size is None else 2 * qweight.shape[1]
        y = torch.empty(m, n, dtype=out_dtype)
        if num_threads is None:
            num_threads = 1 if m <= 2 else torch.get_num_threads()  # as linear()
        b = None if bias is None else bias.data_ptr()
        f32 = int(out_dtype == torch.float32)
        if group_size is None:
            self._linear_q8(
                x.data_ptr(),
                qweight.data_ptr(),
                scales.data_ptr(),
                b,
                y.data_ptr(),
                m,
                n,
                in_features,
                kp,
                f32,
                num_threads,
                int(amx),
            )
        else:
            self._linear_q4(
                x.data_ptr(),
                qweight.data_ptr(),
                scales.data_ptr(),
                b,
                y.data_ptr(),
                m,
                n,
                in_features,
                kp,
                group_size,
                f32,
                num_threads,
                int(amx),
            )
        return y

    def dequantize(
        self,
        qweight: torch.Tensor,
        scales: torch.Tensor,
        in_features: int,
        group_size: int | None,
        rows: tuple[int, int] | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Output rows ``[n0, n1)`` (default: all) of a weight quantized by ops/quant.py as
        a bfloat16 ``[n1 - n0, in_features]`` matrix (the values of ``dequantize`` there,
        rounded to bfloat16), written into ``out`` if given (contiguous, that shape)."""
        n0, n1 = rows if rows is not None else (0, qweight.shape[0])
        kp = qweight.shape[1] if group_size is None else 2 * qweight.shape[1]
        if out is None:
            out = torch.empty(n1 - n0, in_features, dtype=torch.bfloat16)
        elif (
            out.shape != (n1 - n0, in_features)
            or out.dtype != torch.bfloat16
            or not out.is_contiguous()
        ):
            raise ValueError(
                f"out must be a contiguous bfloat16 [{n1 - n0}, {in_features}] tensor, "
                f"got {out.dtype} {tuple(out.shape)}."
            )
        self._dequantize(
            8 if group_size is None else 4,
            qweight.data_ptr(),
            scales.data_ptr(),
            out.data_ptr(),
            n0,
            n1,
            qweight.shape[0],
            in_features,
            kp,
            group_size or 0,
            self._threads(n1 - n0),
        )
        return out

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, add: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """RMSNorm of ``x [M, H]`` (or of ``x + add``): returns ``(normed, residual)``.

        ``residual`` is ``x + add`` rounded to bfloat16 (``x`` itself when ``add`` is None).
        All inputs contiguous bfloat16.
        """
        m, h = x.shape
        out = torch.empty_like(x)
        residual = x if add is None else torch.empty_like(x)
        self._rms_norm(
            x.data_ptr(),
            None if add is None else add.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            residual.data_ptr(),
            m,
            h,
            eps,
            self._threads(m),
        )
        return out, residual

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(g) * u`` for ``gate_up = [g | u]`` of shape ``[M, 2I]`` (contiguous bf16)."""
        m, two_i = gate_up.shape
        out = torch.empty(m, two_i // 2, dtype=gate_up.dtype)
        self._silu_mul(gate_up.data_ptr(), out.data_ptr(), m, two_i // 2, self._threads(m))
        return out

    def rotary_(
        self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """Rotate ``x [T, H, D]`` in place (rows may be strided; heads contiguous)."""
        t, h, d = x.shape
        self._rotary(
            x.data_ptr(),
            positions.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            t,
            h,
            d,
            x.stride(0),
            self._threads(t),
        )
        return x

    def cached_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        out: torch.Tensor,
        window: int | None = None,
    ) -> None:
        """Attention of ``B`` query tokens over the paged cache into ``out [B, Hq, D]``.

        Row ``b`` attends to the first ``seq_lens[b]`` keys of the blocks in
        ``block_tables[b]`` (a decode, or a prefill token whose K/V are already written);
        with a ``window``, to the last ``window`` of them only (blocks before are not read).
        ``q [B, Hq, D]`` (rows may be strided), caches ``[blocks, block_size, Hkv, D]``,
        ``block_tables [B, max_blocks]`` and ``seq_lens [B]`` int32.
        """
        b, hq, d = q.shape
        _, block_size, hkv, _ = k_cache.shape
        threads = self._attention_threads(block_tables, block_size, hkv)
        self._cached_attention(
            q.data_ptr(),
            q.stride(0),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            block_tables.data_ptr(),
            seq_lens.data_ptr(),
            out.data_ptr(),
            b,
            hq,
            hkv,
            d,
            block_size,
            block_tables.shape[1],
            scale,
            threads,
            window or 0,
        )

    def rope_attention(
        self,
        qkv: torch.Tensor,
        num_heads: int,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slot_mapping: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        """Rotary on q and k, K/V into the cache, then ``cached_attention``: one call.

        ``qkv [T, (Hq + 2 Hkv) D]`` contiguous bfloat16 (q and k are rotated in place);
        ``positions`` and ``slot_mapping [T]`` int64; the rest as ``rotary_`` and
        ``cached_attention``, whose thread choices it keeps, so the result is theirs
        bit for bit. Returns the attention output ``[T, Hq, D]``.
        """
        t = qkv.shape[0]
        _, block_size, hkv, d = k_cache.shape
        out = torch.empty(t, num_heads, d, dtype=qkv.dtype)
        self._rope_attention(
            qkv.data_ptr(),
            qkv.shape[1],
            positions.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            slot_mapping.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            block_tables.data_ptr(),
            seq_lens.data_ptr(),
            out.data_ptr(),
            t,
            num_heads,
            hkv,
            d,
            block_size,
            block_tables.shape[1],
            scale,
            window or 0,
            self._threads(t),
            self._attention_threads(block_tables, block_size, hkv),
        )
        return out

    def argmax(self, x: torch.Tensor) -> list[int]:
        """``x.argmax(dim=-1).tolist()`` for a contiguous float32 ``[N, V]`` (same ties, NaNs)."""
        n, v = x.shape
        out = torch.empty(n, dtype=torch.int64)
        self._argmax(x.data_ptr(), n, v, out.data_ptr(), self._threads(n))
        return out.tolist()

    def lora_(
        self,
        x: torch.Tensor,
        out: torch.Tensor,
        slots: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        parts: torch.Tensor,
        num_threads: int = 1,
        amx: bool = True,
    ) -> None:
        """LoRA deltas in place: for each row ``m`` with ``s = slots[m] >= 0``, part ``p``
        of ``parts`` (``(c, r, o, n)``: rank columns ``c .. c+r-1``, outputs ``o .. o+n-1``)
        adds ``B_p[s].T @ (A[s] @ x[m])[c : c + r]`` to ``out[m, o : o + n]``.

        ``x`` bfloat16 ``[M, K]``, ``out`` bfloat16 ``[M, N]``, ``slots`` int32 ``[M]``
        (-1: the row is left as it is), ``a`` and ``b`` the factors as
        ``pack_lora_factors`` lays them out, ``parts`` int64 ``[P, 4]``, all contiguous;
        the sums are float32 and ``out`` is rounded to bfloat16 once; ``amx``: both products
        on AMX tiles where ``amx`` is True (else dpbf16 and float32 FMAs; the results
        differ in float32 rounding order only). Raises ValueError on shapes, dtypes, slots
        or parts that do not fit (the kernel reads no memory outside its arguments);
        ``out`` is then unchanged.
        """
        m, k = x.shape
        s, n = a.shape[0], out.shape[-1]
        if not (
            x.dtype == out.dtype == a.dtype == b.dtype == torch.bfloat16
            and slots.dtype == torch.int32
            and parts.dtype == torch.int64
            and out.shape == (m, n)
            and a.dim() == 6
            and a.shape[2:] == ((k + 31) // 32, 16, 16, 2)
            and b.dim() == 2
            and b.shape[0] == s
            and parts.dim() == 2
            and parts.shape[1] == 4
            and slots.shape == (m,)
            and all(t.is_contiguous() for t in (x, out, slots, a, b, parts))
        ):
            raise ValueError(
                f"lora_: x {tuple(x.shape)} {x.dtype}, out {tuple(out.shape)} {out.dtype}, "
                f"slots {tuple(slots.shape)} {slots.dtype}, a {tuple(a.shape)} {a.dtype}, "
                f"b {tuple(b.shape)} {b.dtype}, parts {tuple(parts.shape)} {parts.dtype} "
                "do not fit (see the docstring)."
            )
        r16 = a.shape[1] * 16
        status = self.lora_raw(
            x.data_ptr(),
            out.data_ptr(),
            slots.data_ptr(),
            a.data_ptr(),
            b.data_ptr(),
            parts.data_ptr(),
            m,
            k,
            n,
            s,
            r16,
            parts.shape[0],
            b.shape[1],
            num_threads,
            int(amx),
        )
        if status:
            raise ValueError(
                f"lora_: slots holds a slot outside -1 .. {s - 1}, or parts a part outside "
                f"the {r16} rank columns, {n} outputs or {b.shape[1]} values of b; out is "
                "unchanged."
            )

    @staticmethod
    def cached_attention_supports(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
        """The kernel's shape limits: head_dim a multiple of 32 up to 128, at most 8 heads
        per KV head."""
        return head_dim % 32 == 0 and head_dim <= 128 and num_heads // num_kv_heads <= 8


def pack_lora_factors(
    a: torch.Tensor, b_parts: list[torch.Tensor] | tuple[torch.Tensor, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """LoRA factors in the layout ``nb_lora_bf16`` reads (kernels.c, "LoRA deltas"):
    ``a`` ``[S, R, K]`` (the parts' shrinks stacked) as bfloat16 ``[S, ceil(R/16),
    ceil(K/32), 16, 16, 2]`` (blocks of 16 ranks by 16 input pairs), and each part's
    expand ``[S, r, n]`` (transposed) as ``[S, ceil(n/16), ceil(r/2), 16, 2]`` (blocks of
    16 outputs by rank pairs), part after part, in one bfloat16 ``[S, BS]``: AMX's
    "VNNI" tiles, zero-padded."""
    s, r, k = a.shape
    r16, k32 = -(-r // 16) * 16, -(-k // 32) * 32
    pa = torch.zeros(s, r16, k32, dtype=torch.bfloat16)
    pa[:, :r, :k] = a
    # [s, rank group, 16 ranks, block, 16 pairs, 2] -> [s, group, block, pair, rank, 2]
    pa = pa.view(s, r16 // 16, 16, k32 // 32, 16, 2).permute(0, 1, 3, 4, 2, 5).contiguous()
    blocks: list[torch.Tensor] = []
    for bp in b_parts:
        pr, pn = bp.shape[1], bp.shape[2]
        r2, n16 = pr + pr % 2, -(-pn // 16) * 16
        padded = torch.zeros(s, r2, n16, dtype=torch.bfloat16)
        padded[:, :pr, :pn] = bp
        # [s, pair, 2, block, 16] -> [s, block, pair, 16, 2]
        blocks.append(
            padded.view(s, r2 // 2, 2, n16 // 16, 16).permute(0, 3, 1, 4, 2).reshape(s, -1)
        )
    pb = torch.cat(blocks, dim=1).contiguous() if blocks else torch.zeros(s, 0)
    return pa, pb.to(torch.bfloat16)


def is_bf16_rows(*tensors: torch.Tensor) -> bool:
    """True if every tensor is a CPU bfloat16 tensor with a contiguous last dimension."""
    return all(
        t.dtype == torch.bfloat16 and t.device.type == "cpu" and t.stride(-1) == 1 for t in tensors
    )


def pack_linear_weight(weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``W [N, K]`` (bfloat16, K even) in the kernels' VNNI layout ``[ceil(N/64), K/2, 64, 2]``.

    Written into ``out`` when given (e.g. a view of a ``WeightArena``), else a new tensor.
    """
    n, k = weight.shape
    if k % 2:
        raise ValueError(f"packing needs an even number of input features, got {k}")
    n_pad = -(-n // VNNI_TILE) * VNNI_TILE
    given = out is not None
    if out is None:
        out = torch.empty(n_pad * k, dtype=weight.dtype)
    # Each pair of inputs moves as one 32-bit word: a transpose of [64, K/2] words per
    # tile, in one copy (twice as fast as moving 16-bit elements; no padded copy of the
    # whole weight first).
    words = out.view(torch.int32).view(n_pad // VNNI_TILE, k // 2, VNNI_TILE)
    src = weight.contiguous().view(torch.int32)
    full = n // VNNI_TILE
    if full:
        rows = src[: full * VNNI_TILE].view(full, VNNI_TILE, k // 2)
        words[:full].copy_(rows.transpose(1, 2))
    if full * VNNI_TILE < n:  # the last, partial tile: zero-padded rows
        tail = torch.zeros(VNNI_TILE, k // 2, dtype=torch.int32)
        tail[: n - full * VNNI_TILE] = src[full * VNNI_TILE :]
        words[full].copy_(tail.t())
    return out if given else out.view(n_pad // VNNI_TILE, k // 2, VNNI_TILE, 2)


def packed_linear_numel(out_features: int, in_features: int) -> int:
    """Elements of the packed layout of an ``[out_features, in_features]`` weight."""
    return -(-out_features // VNNI_TILE) * VNNI_TILE * in_features


def unavailable_reason() -> str | None:
    """Why the native kernels cannot be used here, or ``None`` if they can."""
    reason = native_build.unsupported()
    if reason is None and kernels() is None:
        return "the kernel library could not be built (see the log of nbengine.ops.native)"
    return reason


def loaded() -> NativeKernels | None:
    """The kernels if an earlier ``kernels()`` call built and loaded them; never builds."""
    return kernels() if kernels.cache_info().currsize else None


@functools.lru_cache(maxsize=1)
def kernels() -> NativeKernels | None:
    """The native kernels, built on first use; ``None`` where they are unavailable."""
    if native_build.unsupported() is not None:
        return None
    try:
        path = native_build.build()
        return NativeKernels(ctypes.CDLL(str(path)), path)
    except (OSError, subprocess.SubprocessError, AttributeError) as exc:
        logger.warning("nbengine's native kernels are unavailable (%s); using torch ops.", exc)
        return None
