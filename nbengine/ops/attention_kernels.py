"""Paged attention over a block-structured KV cache (layout and metadata: ops/attention.py).

The fast path first writes the new K/V into their slots, then

- batches the single-token chunks (decodes) into a few ``scaled_dot_product_attention``
  calls, one per decode group (``DecodeGroup``): whole KV blocks are gathered through the
  padded block tables into a ``[B, n_blocks * block_size]`` tensor (one contiguous copy
  per block, not per slot) and the group's length mask hides the padding;
- runs one SDPA call per multi-token chunk (prefill): ``is_causal`` on the fresh K/V
  when there is no cached prefix, else an explicit mask over gathered prefix + chunk.

Where the native kernels are available (bfloat16), one kernel call (ops/kernels.c)
replaces the decode groups and the prefill chunks over short contexts: each of those
tokens attends to the first ``position + 1`` keys of its request, read where they lie in
the cache through ``token_block_tables`` and ``token_seq_lens`` (one row per token).
Chunks over long contexts (``NATIVE_PREFILL_MAX_KEYS``) keep SDPA.

GQA is handled without repeating K/V: the ``G = Hq // Hkv`` query heads that share
a KV head are folded into the query-length axis (decode) or handed to SDPA's
``enable_gqa`` (prefill).

Sliding-window layers read only the blocks their metadata gathers; the native kernel
starts each token's keys at its window. Logit soft-capping (``softcap=c``: scores become
``c * tanh(s / c)`` before the mask, Gemma 2) runs the same gathers through an explicit
softmax instead of SDPA.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from nbengine.ops import native
from nbengine.ops.attention import AttentionMetadata, ChunkSpec

if TYPE_CHECKING:
    from nbengine.ops.rotary import RotaryEmbedding


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store ``k, v [T, Hkv, D]`` into the cache slots ``slot_mapping [T]``."""
    n_kv, hd = k_cache.shape[-2], k_cache.shape[-1]
    k_cache.view(-1, n_kv, hd).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, n_kv, hd).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def rope_paged_attention(
    qkv: torch.Tensor,
    num_heads: int,
    positions: torch.Tensor,
    rotary: RotaryEmbedding,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
) -> torch.Tensor | None:
    """Rotary, K/V write and attention for a fused ``qkv [T, (Hq + 2 Hkv) D]`` in one
    native call, where the native kernels can run the whole step; else None (the caller
    then takes ``rotary.rotate`` and ``paged_attention``, which give the same values).

    Each call between kernels costs this machine tens of microseconds of interpreter
    time with caches the kernels have just flushed; this saves three per layer.
    """
    if not meta.use_native or meta.long_prefill:  # long prefill chunks take SDPA
        return None
    if (
        rotary.rotary_dim != rotary.head_dim
        or rotary.cos.dtype != torch.float32
        or not native.is_bf16_rows(qkv, k_cache, v_cache)
        or not (qkv.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous())
        or positions.dtype != torch.int64
    ):
        return None
    kernels = native.kernels()
    if kernels is None:
        return None
    n_kv, hd = k_cache.shape[2], k_cache.shape[3]
    if not native.NativeKernels.cached_attention_supports(num_heads, n_kv, hd):
        return None
    tables, seq_lens = meta.token_block_tables, meta.token_seq_lens
    if tables is None or seq_lens is None:
        return None
    return kernels.rope_attention(
        qkv,
        num_heads,
        positions,
        rotary.cos,
        rotary.sin,
        meta.slot_mapping,
        k_cache,
        v_cache,
        tables,
        seq_lens,
        scale,
        meta.effective_window(window),
    )


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Fast path. ``q [T, Hq, D]``, ``k, v [T, Hkv, D]`` -> ``[T, Hq, D]``; writes K/V first.

    ``window``: sliding-window attention over the last ``window`` positions (None: full);
    ``softcap``: attention-logit soft-capping (None: none). See the module docstring.
    """
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    window = meta.effective_window(window)
    n_tokens, n_heads, hd = q.shape
    n_kv = k.shape[1]
    group = n_heads // n_kv
    out = torch.empty(n_tokens, n_heads, hd, dtype=q.dtype, device=q.device)
    flat_k = k_cache.view(-1, n_kv, hd)
    flat_v = v_cache.view(-1, n_kv, hd)

    nd = meta.num_decodes
    # The native kernel does full and sliding-window attention, without soft-capping.
    kernels = _native_attention(q, k_cache, meta) if softcap is None else None
    if kernels is not None:
        # Decodes, and prefill chunks over short contexts, in one call. Past
        # NATIVE_PREFILL_MAX_KEYS keys SDPA's matmuls beat re-reading the keys per query.
        long_prefill = meta.long_prefill
        rows = nd if long_prefill else n_tokens
        assert meta.token_block_tables is not None and meta.token_seq_lens is not None
        if rows:
            kernels.cached_attention(
                q[:rows],
                k_cache,
                v_cache,
                meta.token_block_tables[:rows],
                meta.token_seq_lens[:rows],
                scale,
                out[:rows],
                window,
            )
        if not long_prefill:
            return out
    elif nd:
        block_size = k_cache.shape[1]
        qd_all = q[:nd].reshape(nd, n_kv, group, hd)  # the G heads of a KV head act as G queries
        od_all = out[:nd].view(nd, n_kv, group, hd)
        decode_groups = meta.decode_groups_for(window)
        single = len(decode_groups) == 1
        for g in decode_groups:
            b, nb = g.block_tables.shape
            idx = g.block_tables.view(-1)  # whole blocks: one contiguous copy per block
            kd = k_cache.index_select(0, idx).view(b, nb * block_size, n_kv, hd).transpose(1, 2)
            vd = v_cache.index_select(0, idx).view(b, nb * block_size, n_kv, hd).transpose(1, 2)
            qd = qd_all if single else qd_all.index_select(0, g.rows)
            od = _attend(qd, kd, vd, g.mask, scale, softcap)
            if single:
                od_all.copy_(od)
            else:
                od_all.index_copy_(0, g.rows, od)

    for pf in meta.prefills_for(window):
        s, n = pf.q_start, pf.num_tokens
        qp = q[s : s + n].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
        if pf.ctx_slots is None:
            kp = k[s : s + n].transpose(0, 1).unsqueeze(0)
            vp = v[s : s + n].transpose(0, 1).unsqueeze(0)
        else:
            kp = flat_k.index_select(0, pf.ctx_slots).transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, D]
            vp = flat_v.index_select(0, pf.ctx_slots).transpose(0, 1).unsqueeze(0)
        if pf.mask is None and softcap is None:
            op = F.scaled_dot_product_attention(
                qp, kp, vp, is_causal=True, scale=scale, enable_gqa=group > 1
            )
        elif softcap is None:
            op = F.scaled_dot_product_attention(
                qp, kp, vp, attn_mask=pf.mask, scale=scale, enable_gqa=group > 1
            )
        else:
            mask = pf.mask
            if mask is None:
                mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
            # [1, Hkv, G, n, D] queries against [1, Hkv, 1, L, D] keys: GQA by broadcasting.
            qg = qp.reshape(1, n_kv, group, n, hd)
            op = _attend(qg, kp.unsqueeze(2), vp.unsqueeze(2), mask, scale, softcap)
            op = op.reshape(1, n_heads, n, hd)
        out[s : s + n] = op[0].transpose(0, 1)
    return out


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """``softmax(mask(cap(q k^T * scale))) v`` over the last two dims (SDPA when uncapped).

    ``mask`` is boolean (True = attend) and broadcasts against the scores; the softmax is
    taken in float32, as transformers' eager attention does.
    """
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


def _native_attention(
    q: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata
) -> native.NativeKernels | None:
    """The native kernels if they can run this step's attention, else None."""
    if not meta.use_native or q.shape[0] == 0 or meta.token_block_tables is None:
        return None
    if not (
        native.is_bf16_rows(q, k_cache) and k_cache.is_contiguous() and q.stride(1) == q.shape[2]
    ):
        return None
    n_heads, n_kv, hd = q.shape[1], k_cache.shape[2], q.shape[2]
    if not native.NativeKernels.cached_attention_supports(n_heads, n_kv, hd):
        return None
    return native.kernels()


def paged_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    chunks: Sequence[ChunkSpec],
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Reference: token by token, softmax in float32, K/V read back slot by slot.

    With ``window`` the query at ``p`` reads keys ``max(0, p - window + 1) .. p``; with
    ``softcap`` the scores are ``softcap * tanh(s / softcap)``.
    """
    block_size = k_cache.shape[1]
    n_heads, n_kv = q.shape[1], k.shape[1]
    group = n_heads // n_kv
    t = 0
    for c in chunks:  # write every new K/V first (chunks of one batch never overlap)
        for p in range(c.start_pos, c.start_pos + c.num_tokens):
            b, off = c.block_table[p // block_size], p % block_size
            k_cache[b, off] = k[t]
            v_cache[b, off] = v[t]
            t += 1
    out = torch.empty_like(q)
    t = 0
    for c in chunks:
        for p in range(c.start_pos, c.start_pos + c.num_tokens):
            lo = 0 if window is None else max(0, p - window + 1)
            keys = torch.stack(
                [k_cache[c.block_table[j // block_size], j % block_size] for j in range(lo, p + 1)]
            ).float()  # [keys, Hkv, D]
            vals = torch.stack(
                [v_cache[c.block_table[j // block_size], j % block_size] for j in range(lo, p + 1)]
            ).float()
            keys = keys.repeat_interleave(group, dim=1)
            vals = vals.repeat_interleave(group, dim=1)
            scores = torch.einsum("hd,jhd->hj", q[t].float(), keys) * scale
            if softcap is not None:
                scores = torch.tanh(scores / softcap) * softcap
            probs = scores.softmax(dim=-1)
            out[t] = torch.einsum("hj,jhd->hd", probs, vals).to(q.dtype)
            t += 1
    return out
