"""The native kernels (ops/kernels.c) against their plain-torch references.

bfloat16 results may differ from the reference by rounding (sums in another order), so
they are compared with bfloat16 tolerances; float32 outputs of the linear kernel are
compared tightly. Skipped where the kernels cannot be built (no AVX-512 BF16 or no C
compiler): the fallbacks are the reference paths the other tests cover.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nbengine.ops import attention, attention_kernels, native
from nbengine.ops.activation import silu_and_mul, silu_and_mul_ref
from nbengine.ops.arena import WeightArena
from nbengine.ops.attention import ChunkSpec, build_attention_metadata
from nbengine.ops.attention_kernels import paged_attention, paged_attention_ref
from nbengine.ops.linear import NativeLinear, pack_linears
from nbengine.ops.rms_norm import add_rms_norm, rms_norm, rms_norm_ref
from nbengine.ops.rotary import RotaryEmbedding, apply_rotary_ref

from support.cpu_features import amx_only

kernels = native.kernels()
# Required: a skip is reported loudly, and fails under NBENGINE_REQUIRE_ALL=1 (tests/conftest.py).
pytestmark = [
    pytest.mark.required,
    pytest.mark.skipif(kernels is None, reason=f"native kernels: {native.unavailable_reason()}"),
]
BF16 = torch.bfloat16


def _bf16(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(BF16)


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9, 33])
@pytest.mark.parametrize("n,k", [(64, 32), (37, 100), (200, 2), (960, 576)])
def test_linear_matches_f_linear(m: int, n: int, k: int) -> None:
    assert kernels is not None
    w, x, b = _bf16(n, k, seed=1), _bf16(m, k, seed=2), _bf16(n, seed=3)
    packed = native.pack_linear_weight(w)
    assert packed.numel() == native.packed_linear_numel(n, k)
    exact = x.double() @ w.double().T + b.double()
    got32 = kernels.linear(x, packed, n, b, out_dtype=torch.float32)
    torch.testing.assert_close(got32.double(), exact, rtol=1e-5, atol=1e-4)
    got = kernels.linear(x, packed, n, b)
    want = F.linear(x, w, b)
    assert got.dtype == BF16 and got.shape == (m, n)
    # At most one bfloat16 rounding step apart from torch's own product.
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)
    for threads in (1, 2):  # the split over threads does not change a single value
        again = kernels.linear(x, packed, n, b, num_threads=threads)
        assert torch.equal(again, got)


@pytest.mark.parametrize("n,k", [(64, 32), (37, 100), (960, 576), (688, 258)])
def test_linear_row_is_the_same_in_any_batch(n: int, k: int) -> None:
    # A row's product must not depend on the rows beside it (tiles of 4 rows, single
    # rows): a request's greedy tokens are then the same alone, in a batch, or with
    # speculative drafts beside it (docs/speculative-decoding.md, "Exactness").
    assert kernels is not None
    w, b = _bf16(n, k, seed=4), _bf16(n, seed=5)
    packed = native.pack_linear_weight(w)
    x = _bf16(13, k, seed=6)
    # Below BF16_AMX_ROWS; from there on only with the AMX tiles turned off.
    for m, amx in [(2, True), (3, True), (5, True), (8, True), (11, True), (13, False)]:
        assert amx is False or m < native.BF16_AMX_ROWS
        for out_dtype in (BF16, torch.float32):
            got = kernels.linear(x[:m].contiguous(), packed, n, b, out_dtype=out_dtype, amx=amx)
            for i in range(m):
                one = kernels.linear(x[i : i + 1].contiguous(), packed, n, b, out_dtype=out_dtype)
                assert torch.equal(got[i], one[0]), (m, i, out_dtype)


@amx_only
@pytest.mark.parametrize("n,k", [(64, 32), (37, 96), (960, 576), (200, 2048)])
@pytest.mark.parametrize("out_dtype", [BF16, torch.float32])
def test_amx_products_of_many_rows(n: int, k: int, out_dtype: torch.dtype) -> None:
    # From BF16_AMX_ROWS rows the product runs on AMX tiles: as close to the exact sums as
    # the dpbf16 kernels, and a row's result is the same in every batch that large (alone
    # in a tile with zero rows, among 70, on one thread or two).
    assert kernels is not None
    w, b = _bf16(n, k, seed=7), _bf16(n, seed=8)
    packed = native.pack_linear_weight(w)
    x = _bf16(70, k, seed=9)
    exact = x.double() @ w.double().T + b.double()
    first = None
    for m in (native.BF16_AMX_ROWS, 16, 17, 33, 70):
        for threads in (1, 2):
            got = kernels.linear(x[:m].contiguous(), packed, n, b, out_dtype, threads)
            assert got.shape == (m, n) and got.dtype == out_dtype
            if out_dtype == torch.float32:
                torch.testing.assert_close(got.double(), exact[:m], rtol=1e-5, atol=1e-4)
            else:
                torch.testing.assert_close(
                    got.float(), F.linear(x[:m], w, b).float(), rtol=1e-2, atol=1e-2
                )
            rows = got[: native.BF16_AMX_ROWS]
            first = rows if first is None else first
            assert torch.equal(rows, first), (m, threads)
    # The dpbf16 kernels' sums are in another order: where they differ, the tiles ran.
    dp = kernels.linear(x[:16].contiguous(), packed, n, b, torch.float32, amx=False)
    tiles = kernels.linear(x[:16].contiguous(), packed, n, b, torch.float32)
    assert k <= 32 or not torch.equal(dp, tiles)


def test_native_linear_module_and_arena() -> None:
    assert kernels is not None
    arena = WeightArena(1 << 20)
    lin = nn.Linear(48, 80, bias=True).to(BF16)
    mod = NativeLinear(lin, kernels, arena)
    x = _bf16(2, 3, 48, seed=4)
    with torch.inference_mode():
        torch.testing.assert_close(mod(x).float(), lin(x).float(), rtol=1e-2, atol=1e-2)
        # A non-contiguous input is handled (copied), not misread.
        xt = _bf16(48, 5, seed=5).T
        torch.testing.assert_close(mod(xt).float(), lin(xt).float(), rtol=1e-2, atol=1e-2)
    assert mod.packed_weight.data_ptr() % 64 == 0
    with pytest.raises(MemoryError):
        arena.take((1 << 20,), BF16)


def test_pack_linears_prefers_native_and_skips_float32() -> None:
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)).to(BF16)
    f32 = nn.Sequential(nn.Linear(16, 8))
    x = _bf16(2, 16, seed=6)
    with torch.inference_mode():
        before = model(x).float()
        assert pack_linears(model) == 2
        after = model(x).float()
        assert pack_linears(f32) == 0
    assert isinstance(model[0], NativeLinear) and isinstance(f32[0], nn.Linear)
    torch.testing.assert_close(after, before, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("rows,h", [(1, 48), (7, 576), (20, 2048)])
def test_rms_norm_and_fused_add(rows: int, h: int) -> None:
    x, r = _bf16(rows, h, seed=7, scale=3), _bf16(rows, h, seed=8, scale=3)
    w = (1 + 0.1 * torch.randn(h, generator=torch.Generator().manual_seed(9))).to(BF16)
    torch.testing.assert_close(
        rms_norm(x, w, 1e-6).float(), rms_norm_ref(x, w, 1e-6).float(), atol=2e-2, rtol=2e-2
    )
    out, res = add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(res, x + r), "the residual is the bfloat16 sum, as torch rounds it"
    torch.testing.assert_close(
        out.float(), rms_norm_ref(x + r, w, 1e-6).float(), atol=2e-2, rtol=2e-2
    )


@pytest.mark.parametrize("rows", [1, 5, 40])
def test_silu_and_mul(rows: int) -> None:
    gu = _bf16(rows, 2 * 96, seed=10, scale=4)
    got = silu_and_mul(gu)
    assert got.shape == (rows, 96)
    torch.testing.assert_close(got.float(), silu_and_mul_ref(gu).float(), atol=1e-2, rtol=1e-2)


def test_rotary_in_place_on_a_strided_slice() -> None:
    rope = RotaryEmbedding(64, 512, 10000.0)
    qkv = _bf16(6, (4 + 2 + 2) * 64, seed=11)
    positions = torch.tensor([0, 1, 7, 100, 300, 511])
    qk = qkv[:, : 6 * 64].view(6, 6, 64)  # q and k heads; rows strided by the v columns
    want_q, want_k = apply_rotary_ref(
        qk[:, :4].clone(), qk[:, 4:].clone(), positions, rope.inv_freq
    )
    v_before = qkv[:, 6 * 64 :].clone()
    out = rope.rotate(positions, qk)
    assert out.data_ptr() == qk.data_ptr(), "rotated in place"
    torch.testing.assert_close(out[:, :4].float(), want_q.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out[:, 4:].float(), want_k.float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(qkv[:, 6 * 64 :], v_before), "the v columns are untouched"


@pytest.mark.parametrize("prefill_limit", [1024, 8])
@pytest.mark.parametrize("seed", range(5))
def test_attention_reads_blocks_in_place(
    seed: int, prefill_limit: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # prefill_limit 8: prefill chunks count as long, so the native kernel does the decodes
    # and SDPA the prefills, in the same step.
    monkeypatch.setattr(attention, "NATIVE_PREFILL_MAX_KEYS", prefill_limit)
    rng = random.Random(seed)
    n_kv = rng.choice([1, 2, 3])
    n_heads = n_kv * rng.choice([1, 3, 4])
    head_dim, block_size = rng.choice([32, 64, 128]), rng.choice([1, 4, 16])
    spec = [(rng.randrange(0, 90), 1) for _ in range(rng.randrange(1, 7))]
    if seed % 2:
        spec.append((rng.randrange(0, 20), rng.randrange(2, 9)))  # a prefill in the same batch
    g = torch.Generator().manual_seed(seed)
    total = sum((s + n + block_size - 1) // block_size for s, n in spec) + 2
    free = list(range(total))
    rng.shuffle(free)
    chunks = [
        ChunkSpec(s, n, [free.pop() for _ in range((s + n + block_size - 1) // block_size)])
        for s, n in spec
    ]
    t = sum(n for _, n in spec)
    kc = torch.randn(total, block_size, n_kv, head_dim, generator=g).to(BF16)
    vc = torch.randn(total, block_size, n_kv, head_dim, generator=g).to(BF16)
    q = torch.randn(t, n_heads, head_dim, generator=g).to(BF16)
    k = torch.randn(t, n_kv, head_dim, generator=g).to(BF16)
    v = torch.randn(t, n_kv, head_dim, generator=g).to(BF16)
    scale = head_dim**-0.5
    kc1, vc1, kc2, vc2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    want = paged_attention_ref(q, k, v, kc1, vc1, chunks, scale)
    meta = build_attention_metadata(chunks, block_size)
    assert meta.token_block_tables is not None and meta.token_seq_lens is not None
    got = paged_attention(q, k, v, kc2, vc2, meta, scale)
    assert torch.equal(kc1, kc2) and torch.equal(vc1, vc2)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("seed", range(4))
def test_rope_attention_is_rotate_write_and_attend_bit_for_bit(
    seed: int, window: int | None
) -> None:
    """One native call (rope_paged_attention) = rotary.rotate + paged_attention, exactly:
    the cache it writes and the output, for decodes and prefill chunks in one step."""
    rng = random.Random(seed)
    n_kv, block_size, hd = rng.choice([1, 3]), rng.choice([4, 16]), 64
    n_heads = n_kv * 3
    spec = [(rng.randrange(0, 60), 1) for _ in range(rng.randrange(0, 5))]
    spec += [(rng.randrange(0, 30), rng.randrange(2, 20)) for _ in range(1 + seed % 2)]
    blocks = sum((s + n + block_size - 1) // block_size for s, n in spec)
    free = rng.sample(range(blocks + 3), blocks)
    chunks = [
        ChunkSpec(s, n, [free.pop() for _ in range((s + n + block_size - 1) // block_size)])
        for s, n in spec
    ]
    t = sum(n for _, n in spec)
    rope = RotaryEmbedding(hd, 512, 10000.0)
    positions = torch.tensor(
        [p for c in chunks for p in range(c.start_pos, c.start_pos + c.num_tokens)]
    )
    qkv = _bf16(t, (n_heads + 2 * n_kv) * hd, seed=seed)
    kc = _bf16(blocks + 3, block_size, n_kv, hd, seed=seed + 10)
    vc = _bf16(blocks + 3, block_size, n_kv, hd, seed=seed + 20)
    meta = build_attention_metadata(chunks, block_size)
    scale = hd**-0.5

    qkv1, kc1, vc1 = qkv.clone(), kc.clone(), vc.clone()
    qk = rope.rotate(positions, qkv1[:, : (n_heads + n_kv) * hd].view(t, n_heads + n_kv, hd))
    q, k = qk.split([n_heads, n_kv], dim=1)
    v = qkv1[:, (n_heads + n_kv) * hd :].view(t, n_kv, hd)
    want = paged_attention(q, k, v, kc1, vc1, meta, scale, window)

    qkv2, kc2, vc2 = qkv.clone(), kc.clone(), vc.clone()
    got = attention_kernels.rope_paged_attention(
        qkv2, n_heads, positions, rope, kc2, vc2, meta, scale, window
    )
    assert got is not None
    assert torch.equal(kc1, kc2) and torch.equal(vc1, vc2)
    assert torch.equal(got, want)


def test_rope_attention_leaves_long_prefills_to_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attention, "NATIVE_PREFILL_MAX_KEYS", 8)
    rope = RotaryEmbedding(64, 64, 10000.0)
    chunks = [ChunkSpec(0, 1, [0]), ChunkSpec(0, 9, [1, 2, 3])]
    qkv, kc = _bf16(10, 3 * 64, seed=1), _bf16(4, 4, 1, 64, seed=2)
    positions = torch.tensor([0, *range(9)])

    def fused() -> torch.Tensor | None:
        meta = build_attention_metadata(chunks, 4)
        return attention_kernels.rope_paged_attention(
            qkv, 1, positions, rope, kc, kc.clone(), meta, 0.125
        )

    assert fused() is None  # a 9-key prefill: SDPA's
    monkeypatch.setattr(attention, "NATIVE_PREFILL_MAX_KEYS", 16)
    assert fused() is not None


def test_disabled_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NBENGINE_NATIVE", "0")
    native.kernels.cache_clear()
    try:
        assert native.kernels() is None
        assert native.unavailable_reason() == "disabled by NBENGINE_NATIVE=0"
        x, w = _bf16(3, 48, seed=12), torch.ones(48, dtype=BF16)
        torch.testing.assert_close(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6))
    finally:
        monkeypatch.delenv("NBENGINE_NATIVE")
        native.kernels.cache_clear()
    assert native.kernels() is not None


def test_argmax_matches_torch_including_ties_and_nans() -> None:
    assert kernels is not None
    x = torch.randn(5, 1000, generator=torch.Generator().manual_seed(13))
    x[1, 10] = x[1, 700] = 50.0  # a tie: the first index wins
    x[2, 999] = 60.0  # in the row's masked tail
    x[3, 400] = float("nan")
    x[3, 500] = float("nan")
    x[4] = float("-inf")
    assert kernels.argmax(x) == x.argmax(dim=-1).tolist() == [x[0].argmax().item(), 10, 999, 400, 0]


def test_norm_and_swiglu_round_as_torch_does() -> None:
    # Same float32 formulas and round-to-nearest-even casts as the torch path: on random
    # inputs (nearly) every output is the very same bfloat16 value, not merely close.
    gu = _bf16(64, 2 * 1536, seed=14, scale=4)
    same = (silu_and_mul(gu) == silu_and_mul_ref(gu)).float().mean().item()
    assert same >= 0.999, same
    x = _bf16(64, 576, seed=15, scale=3)
    w = (1 + 0.1 * torch.randn(576, generator=torch.Generator().manual_seed(16))).to(BF16)
    same = (rms_norm(x, w, 1e-6) == rms_norm_ref(x, w, 1e-6)).float().mean().item()
    assert same >= 0.999, same
