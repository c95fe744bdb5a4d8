"""Decodes of very different lengths are split into groups; every group matches the reference."""

from __future__ import annotations

import random

import pytest
import torch

from nbengine.ops.attention import ChunkSpec, _length_groups, build_attention_metadata
from nbengine.ops.attention_kernels import paged_attention, paged_attention_ref


def _run_both(
    spec: list[tuple[int, int]], n_heads: int, n_kv: int, head_dim: int, block_size: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(reference, fast) attention outputs for chunks ``(start_pos, num_tokens)``."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    n_blocks = sum((s + n + block_size - 1) // block_size for s, n in spec) + 3
    free = list(range(n_blocks))
    rng.shuffle(free)
    k_cache = torch.randn(n_blocks, block_size, n_kv, head_dim, generator=g)
    v_cache = torch.randn(n_blocks, block_size, n_kv, head_dim, generator=g)
    chunks = [
        ChunkSpec(s, n, [free.pop() for _ in range((s + n + block_size - 1) // block_size)])
        for s, n in spec
    ]
    chunks.sort(key=lambda c: c.num_tokens != 1)
    t = sum(n for _, n in spec)
    q = torch.randn(t, n_heads, head_dim, generator=g)
    k = torch.randn(t, n_kv, head_dim, generator=g)
    v = torch.randn(t, n_kv, head_dim, generator=g)
    scale = head_dim**-0.5
    ref = paged_attention_ref(q, k, v, k_cache.clone(), v_cache.clone(), chunks, scale)
    meta = build_attention_metadata(chunks, block_size)
    fast = paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), meta, scale)
    return ref, fast


def test_length_groups_cover_every_decode_once() -> None:
    n_blocks = [1, 30, 2, 29, 15, 3, 16, 1, 28, 4, 5, 17, 6, 30, 2, 1, 9, 10, 11, 12]
    groups = _length_groups(n_blocks)
    assert sorted(i for g in groups for i in g) == list(range(len(n_blocks)))
    assert len(groups) > 1
    assert _length_groups([3, 3, 3]) == [[0, 1, 2]]  # one group keeps batch order


@pytest.mark.parametrize("seed", range(3))
def test_many_decodes_of_mixed_lengths(seed: int) -> None:
    rng = random.Random(seed)
    spec = [(rng.choice([rng.randrange(0, 6), rng.randrange(20, 90)]), 1) for _ in range(40)]
    spec += [(0, 5), (7, 3)]
    ref, fast = _run_both(spec, 6, 2, 8, block_size=4, seed=seed)
    torch.testing.assert_close(fast, ref, atol=1e-5, rtol=1e-5)


def test_metadata_groups_partition_the_decodes() -> None:
    chunks = [
        ChunkSpec(p, 1, list(range(b, b + p // 4 + 1)))
        for b, p in enumerate([2, 60, 3, 61, 1, 59, 2, 62, 3, 58, 1, 63, 2, 57, 3, 60, 1, 2])
    ]
    meta = build_attention_metadata(chunks, 4)
    rows = sorted(int(r) for g in meta.decode_groups for r in g.rows)
    assert rows == list(range(len(chunks))) and len(meta.decode_groups) == 2
