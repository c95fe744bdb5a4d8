"""Paged attention fast path == the token-by-token reference."""

from __future__ import annotations

import random

import pytest
import torch

from nbengine.ops.attention import ChunkSpec, build_attention_metadata
from nbengine.ops.attention_kernels import paged_attention, paged_attention_ref


def _run_both(
    chunks_spec: list[tuple[int, int]],
    n_heads: int,
    n_kv: int,
    head_dim: int,
    block_size: int,
    seed: int,
    dtype: torch.dtype = torch.float32,
    window: int | None = None,
    softcap: float | None = None,
):
    """chunks_spec: (start_pos, num_tokens) per chunk; prefixes are pre-filled with random K/V."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    total_blocks = sum((s + n + block_size - 1) // block_size for s, n in chunks_spec) + 3
    free = list(range(total_blocks))
    rng.shuffle(free)  # block tables are not contiguous
    k_cache = torch.randn(total_blocks, block_size, n_kv, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(total_blocks, block_size, n_kv, head_dim, generator=g).to(dtype)
    chunks = []
    for s, n in chunks_spec:
        nb = (s + n + block_size - 1) // block_size
        chunks.append(ChunkSpec(s, n, [free.pop() for _ in range(nb)]))
    chunks.sort(key=lambda c: c.num_tokens != 1)
    t = sum(n for _, n in chunks_spec)
    q = torch.randn(t, n_heads, head_dim, generator=g).to(dtype)
    k = torch.randn(t, n_kv, head_dim, generator=g).to(dtype)
    v = torch.randn(t, n_kv, head_dim, generator=g).to(dtype)
    scale = head_dim**-0.5
    kc1, vc1 = k_cache.clone(), v_cache.clone()
    ref = paged_attention_ref(q, k, v, kc1, vc1, chunks, scale, window, softcap)
    kc2, vc2 = k_cache.clone(), v_cache.clone()
    meta = build_attention_metadata(chunks, block_size)
    fast = paged_attention(q, k, v, kc2, vc2, meta, scale, window, softcap)
    assert torch.equal(kc1, kc2) and torch.equal(vc1, vc2), "K/V written to different slots"
    return ref, fast


@pytest.mark.parametrize("n_heads,n_kv", [(4, 4), (4, 2), (8, 1)])
def test_decode_batch_mixed_lengths(n_heads: int, n_kv: int) -> None:
    spec = [(0, 1), (5, 1), (16, 1), (37, 1), (3, 1)]
    ref, fast = _run_both(spec, n_heads, n_kv, 16, block_size=4, seed=1)
    torch.testing.assert_close(fast, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("n_heads,n_kv", [(4, 4), (6, 2)])
def test_prefill_fresh_and_over_cached_prefix(n_heads: int, n_kv: int) -> None:
    # A fresh prompt, a chunk continuing from 8 cached tokens (block-aligned), one from 5
    # cached tokens (mid-block), plus decodes in the same batch.
    spec = [(0, 7), (8, 5), (5, 9), (11, 1), (2, 1)]
    ref, fast = _run_both(spec, n_heads, n_kv, 8, block_size=4, seed=2)
    torch.testing.assert_close(fast, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seed", range(6))
def test_random_batches(seed: int) -> None:
    rng = random.Random(seed)
    n_kv = rng.choice([1, 2, 4])
    n_heads = n_kv * rng.choice([1, 2, 3])
    spec = [(rng.randrange(0, 40), 1) for _ in range(rng.randrange(0, 5))]
    spec += [
        (rng.choice([0, rng.randrange(0, 30)]), rng.randrange(2, 12))
        for _ in range(rng.randrange(1, 4))
    ]
    ref, fast = _run_both(spec, n_heads, n_kv, rng.choice([8, 16]), rng.choice([1, 4, 16]), seed)
    torch.testing.assert_close(fast, ref, atol=1e-5, rtol=1e-5)


def test_bfloat16_close_to_reference() -> None:
    ref, fast = _run_both([(0, 6), (9, 1), (4, 3)], 4, 2, 16, 4, seed=3, dtype=torch.bfloat16)
    torch.testing.assert_close(fast.float(), ref.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("window", [1, 3, 4, 9, 64])
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_sliding_window_and_softcap(window: int, softcap: float | None) -> None:
    # Decodes and chunks before, across and past the window, fresh and over a cached prefix.
    spec = [(0, 1), (2, 1), (12, 1), (30, 1), (0, 11), (8, 5), (21, 7), (3, 2)]
    ref, fast = _run_both(spec, 6, 2, 8, block_size=4, seed=5, window=window, softcap=softcap)
    torch.testing.assert_close(fast, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [1, 5, 17, 40])
def test_sliding_window_bfloat16_close_to_reference(window: int) -> None:
    # The native kernel (where available) starts each token's keys at its window.
    spec = [(0, 1), (13, 1), (37, 1), (0, 12), (9, 6), (20, 3)]
    ref, fast = _run_both(spec, 4, 2, 32, 4, seed=4, dtype=torch.bfloat16, window=window)
    torch.testing.assert_close(fast.float(), ref.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sliding_window_never_reads_blocks_before_the_window(dtype: torch.dtype) -> None:
    # Blocks wholly before every window may already be reused: poison them, same result
    # (bfloat16: the native kernel where available, else SDPA).
    g = torch.Generator().manual_seed(0)
    bs, n_kv, hd, window = 4, 2, 32, 5
    k_cache = torch.randn(16, bs, n_kv, hd, generator=g).to(dtype)
    v_cache = torch.randn(16, bs, n_kv, hd, generator=g).to(dtype)
    chunks = [ChunkSpec(19, 1, list(range(5))), ChunkSpec(12, 6, list(range(5, 10)))]
    q = torch.randn(7, 4, hd, generator=g).to(dtype)
    k = torch.randn(7, n_kv, hd, generator=g).to(dtype)
    v = torch.randn(7, n_kv, hd, generator=g).to(dtype)
    outs = []
    for poison in (False, True):
        kc, vc = k_cache.clone(), v_cache.clone()
        if poison:  # decode at 19 sees 15..19 (blocks 3, 4); chunk 12..17 sees 8.. (blocks 7+)
            for b in (0, 1, 2, 5, 6):
                kc[b] = float("nan")
                vc[b] = float("nan")
        meta = build_attention_metadata(chunks, bs)
        outs.append(paged_attention(q, k, v, kc, vc, meta, hd**-0.5, window))
    assert torch.equal(outs[0], outs[1])
