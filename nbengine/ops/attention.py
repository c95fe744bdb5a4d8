"""Paged attention over a block-structured KV cache.

Cache layout, per layer: ``k_cache`` and ``v_cache`` each ``[num_blocks, block_size,
num_kv_heads, head_dim]``. Position ``p`` of a request lives in block
``block_table[p // block_size]`` at offset ``p % block_size``; its flat slot is
``block * block_size + offset``.

A step's batch is flattened: the tokens of every scheduled chunk are concatenated.
Each chunk attends to its cached prefix ``[0, start_pos)`` plus, causally, to itself.
The fast path first writes the new K/V into their slots, then

- batches all single-token chunks (decodes) into one ``scaled_dot_product_attention``
  call: K/V are gathered through the slot table into a padded ``[B, L_max]`` tensor
  and a boolean length mask hides the padding;
- runs one SDPA call per multi-token chunk (prefill): ``is_causal`` on the fresh K/V
  when there is no cached prefix, else an explicit mask over gathered prefix + chunk.

GQA is handled without repeating K/V: the ``G = Hq // Hkv`` query heads that share
a KV head are folded into the query-length axis (decode) or handed to SDPA's
``enable_gqa`` (prefill). ``AttentionMetadata`` is built once per step and shared by
all layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class ChunkSpec:
    """One chunk of the flattened batch: positions ``[start_pos, start_pos + num_tokens)``."""

    start_pos: int
    num_tokens: int
    block_table: Sequence[int]


@dataclass(slots=True)
class PrefillMeta:
    """Per multi-token chunk: where its queries are and which cached K/V it reads."""

    q_start: int
    num_tokens: int
    start_pos: int
    ctx_slots: torch.Tensor | None  # [start_pos + num_tokens] slots, None when start_pos == 0
    mask: torch.Tensor | None  # [num_tokens, start_pos + num_tokens] bool, None when start_pos == 0


@dataclass(slots=True)
class AttentionMetadata:
    """Step-wide attention inputs. Invariant: the first ``num_decodes`` tokens are the
    single-token chunks, one token each; the prefill chunks follow in order."""

    slot_mapping: torch.Tensor  # [T] int64: where each new token's K/V is written
    num_decodes: int
    decode_slots: torch.Tensor | None  # [num_decodes, L_max] int64 (padding -> slot 0)
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, L_max] bool, True = attend
    prefills: list[PrefillMeta] = field(default_factory=list)


def _slots(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Flat cache slots of ``positions`` given a request's ``block_table`` (both int64)."""
    return block_table[positions // block_size] * block_size + positions % block_size


def build_attention_metadata(
    chunks: Sequence[ChunkSpec], block_size: int, device: torch.device | str = "cpu"
) -> AttentionMetadata:
    """Build the metadata for ``chunks`` in flattened order (single-token chunks first).

    Work is vectorised per chunk (no Python loop over positions); decode gather tables
    come from one padded block-table tensor.
    """
    num_decodes = 0
    for c in chunks:
        if c.num_tokens != 1:
            break
        num_decodes += 1
    assert all(c.num_tokens > 1 for c in chunks[num_decodes:]), "decodes must come first"
    for c in chunks:
        assert len(c.block_table) * block_size >= c.start_pos + c.num_tokens, "block table too short"

    decode_slots = decode_mask = None
    slot_parts: list[torch.Tensor] = []
    if num_decodes:
        dec = chunks[:num_decodes]
        lens = torch.tensor([c.start_pos + 1 for c in dec], dtype=torch.int64, device=device)
        l_max = int(lens.max())
        n_blk = (l_max + block_size - 1) // block_size
        tables = torch.tensor(
            [list(c.block_table[:n_blk]) + [0] * (n_blk - min(n_blk, len(c.block_table))) for c in dec],
            dtype=torch.int64, device=device,
        )
        pos = torch.arange(l_max, dtype=torch.int64, device=device)
        decode_slots = tables[:, pos // block_size] * block_size + pos % block_size  # [B, L_max]
        valid = pos[None, :] < lens[:, None]
        decode_slots = decode_slots.masked_fill(~valid, 0)
        decode_mask = valid[:, None, None, :]
        slot_parts.append(decode_slots.gather(1, (lens - 1)[:, None]).squeeze(1))

    prefills: list[PrefillMeta] = []
    q_start = num_decodes
    for c in chunks[num_decodes:]:
        total = c.start_pos + c.num_tokens
        table = torch.tensor(list(c.block_table), dtype=torch.int64, device=device)
        ctx = _slots(table, torch.arange(total, dtype=torch.int64, device=device), block_size)
        slot_parts.append(ctx[c.start_pos:])
        ctx_slots = mask = None
        if c.start_pos > 0:
            ctx_slots = ctx
            # Query i sits at position start_pos + i and sees keys 0..start_pos + i.
            mask = torch.ones(c.num_tokens, total, dtype=torch.bool, device=device).tril(c.start_pos)
        prefills.append(PrefillMeta(q_start, c.num_tokens, c.start_pos, ctx_slots, mask))
        q_start += c.num_tokens
    slot_mapping = (torch.cat(slot_parts) if slot_parts
                    else torch.empty(0, dtype=torch.int64, device=device))
    return AttentionMetadata(
        slot_mapping=slot_mapping,
        num_decodes=num_decodes,
        decode_slots=decode_slots,
        decode_mask=decode_mask,
        prefills=prefills,
    )


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store ``k, v [T, Hkv, D]`` into the cache slots ``slot_mapping [T]``."""
    n_kv, hd = k_cache.shape[-2], k_cache.shape[-1]
    k_cache.view(-1, n_kv, hd).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, n_kv, hd).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Fast path. ``q [T, Hq, D]``, ``k, v [T, Hkv, D]`` -> ``[T, Hq, D]``; writes K/V first."""
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    n_tokens, n_heads, hd = q.shape
    n_kv = k.shape[1]
    group = n_heads // n_kv
    out = torch.empty_like(q)
    flat_k = k_cache.view(-1, n_kv, hd)
    flat_v = v_cache.view(-1, n_kv, hd)

    nd = meta.num_decodes
    if nd:
        assert meta.decode_slots is not None and meta.decode_mask is not None
        b, l_max = meta.decode_slots.shape
        idx = meta.decode_slots.view(-1)  # index_select is several times faster than x[idx2d]
        kd = flat_k.index_select(0, idx).view(b, l_max, n_kv, hd).transpose(1, 2)  # [B, Hkv, L, D]
        vd = flat_v.index_select(0, idx).view(b, l_max, n_kv, hd).transpose(1, 2)
        qd = q[:nd].reshape(nd, n_kv, group, hd)  # the G heads of a KV head act as G queries
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, scale=scale)
        out[:nd] = od.reshape(nd, n_heads, hd)

    for pf in meta.prefills:
        s, n = pf.q_start, pf.num_tokens
        qp = q[s : s + n].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
        if pf.ctx_slots is None:
            kp = k[s : s + n].transpose(0, 1).unsqueeze(0)
            vp = v[s : s + n].transpose(0, 1).unsqueeze(0)
            op = F.scaled_dot_product_attention(
                qp, kp, vp, is_causal=True, scale=scale, enable_gqa=group > 1
            )
        else:
            kp = flat_k.index_select(0, pf.ctx_slots).transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, D]
            vp = flat_v.index_select(0, pf.ctx_slots).transpose(0, 1).unsqueeze(0)
            op = F.scaled_dot_product_attention(
                qp, kp, vp, attn_mask=pf.mask, scale=scale, enable_gqa=group > 1
            )
        out[s : s + n] = op[0].transpose(0, 1)
    return out


def paged_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    chunks: Sequence[ChunkSpec],
    scale: float,
) -> torch.Tensor:
    """Reference: token by token, softmax in float32, K/V read back slot by slot."""
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
            keys = torch.stack(
                [k_cache[c.block_table[j // block_size], j % block_size] for j in range(p + 1)]
            ).float()  # [p+1, Hkv, D]
            vals = torch.stack(
                [v_cache[c.block_table[j // block_size], j % block_size] for j in range(p + 1)]
            ).float()
            keys = keys.repeat_interleave(group, dim=1)
            vals = vals.repeat_interleave(group, dim=1)
            scores = torch.einsum("hd,jhd->hj", q[t].float(), keys) * scale
            probs = scores.softmax(dim=-1)
            out[t] = torch.einsum("hj,jhd->hd", probs, vals).to(q.dtype)
            t += 1
    return out
