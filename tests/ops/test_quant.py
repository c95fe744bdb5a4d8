"""Weight-only quantization (ops/quant.py): the formats, and the native kernels against
their torch reference.

The reference (``linear_quantized_reference``) computes what the kernels compute (inputs
scaled to int16 per row with int8 weights, to int8 per group with int4 weights; weights
rounded to bfloat16 for many rows of int8 and on the AMX and dense paths), in float64 or
float32; the kernels sum in another order, so float32 results are compared tightly and
bfloat16 ones within a rounding step.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nbengine.ops import native
from nbengine.ops.quant import (
    INT8_TILE_ROWS,
    QUANTIZATION_MODES,
    QuantLinear,
    deinterleave_groups,
    deinterleave_rows,
    dequantize,
    interleave_groups,
    interleave_rows,
    linear_quantized_reference,
    quantize_int4,
    quantize_int8,
    quantize_linears,
    quantize_weight,
)

from support.cpu_features import amx_only

BF16 = torch.bfloat16
kernels = native.kernels()
# Marks the native-kernel tests: required (a skip is reported loudly; tests/conftest.py).
needs_native = pytest.mark.skipif(
    kernels is None, reason=f"native kernels: {native.unavailable_reason()}"
)


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _quantize(w: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor, int | None]:
    group = QUANTIZATION_MODES[mode]
    q, s = quantize_int8(w) if group is None else quantize_int4(w, group)
    return q, s, group


@pytest.mark.parametrize("k", [1, 16, 77, 256])
def test_int8_round_trip_within_half_a_step(k: int) -> None:
    w = _randn(9, k, seed=k)
    w[3] = 0.0  # an all-zero row keeps a usable scale
    q, s = quantize_int8(w)
    assert q.dtype == torch.int8 and q.shape == (9, -(-k // 32) * 32) and s.shape == (9,)
    assert not q[:, k:].any()
    err = (dequantize(q, s, k, None) - w).abs()
    assert bool((err <= s[:, None] / 2 + 1e-7).all())
    assert not dequantize(q, s, k, None)[3].any()


@pytest.mark.parametrize("group", [32, 64])
@pytest.mark.parametrize("k", [32, 64, 96, 100])
def test_int4_round_trip_within_half_a_step(group: int, k: int) -> None:
    w = _randn(5, k, seed=group + k)
    q, sz = quantize_int4(w, group)
    kp = -(-k // group) * group
    assert q.dtype == torch.uint8 and q.shape == (5, kp // 2)
    assert sz.dtype == torch.float16 and sz.shape == (5, kp // group, 2)
    step = sz[..., 0].float().repeat_interleave(group, dim=1)[:, :k]
    err = (dequantize(q, sz, k, group) - w).abs()
    # Half a step, plus the float16 rounding of the group's zero (its minimum).
    assert bool((err <= step / 2 + 1e-3 * w.abs().amax()).all())


def test_int4_nibble_layout() -> None:
    # Byte b of a group holds element b (low nibble) and element G/2 + b (high nibble);
    # one group alone is one window, its bytes in order.
    w = torch.arange(32, dtype=torch.float32)[None, :] % 16  # values 0..15, step 1, min 0
    q, sz = quantize_int4(w, 32)
    assert sz[0, 0].tolist() == [1.0, 0.0]
    b = q[0].tolist()
    assert [v & 15 for v in b] == list(range(16)) and [v >> 4 for v in b] == list(range(16))


@pytest.mark.parametrize("group", [32, 64, 96])
def test_int4_rows_in_windows_of_16_groups_by_blocks_of_four_rows(group: int) -> None:
    # Dword j of group l of a window of c groups is dword l of the row's chunk j (4 c
    # bytes), and chunk j of row i of a block of R rows lies at R (window start + 4 c j) +
    # 4 c i of the block: 37 groups are two full windows and one of 5, 7 rows a block of
    # four and a last one of three.
    torch.manual_seed(3)
    n, ng, half = 7, 37, group // 2
    w = torch.randn(n, ng * group)
    q, sz = quantize_int4(w, group)
    s, z = sz[..., 0].float(), sz[..., 1].float()
    v = torch.round((w.view(n, ng, group) - z[..., None]) / s[..., None])
    v = v.clamp(0, 15).to(torch.uint8)
    in_order = v[..., :half] | (v[..., half:] << 4)  # [n, ng, half], group by group
    flat = q.view(-1)
    for row in range(n):
        b0 = row // 4 * 4
        r, i = min(4, n - b0), row - b0
        for g in range(ng):
            g0 = g // 16 * 16
            c, lane = min(16, ng - g0), g - g0
            for b in range(half):
                j = b // 4  # the chunk
                at = b0 * q.shape[1] + r * (g0 * half + 4 * c * j) + 4 * c * i + 4 * lane + b % 4
                assert int(flat[at]) == int(in_order[row, g, b]), (row, g, b)
    windows = deinterleave_rows(q, group)
    assert torch.equal(deinterleave_groups(windows, group), in_order)
    assert torch.equal(interleave_rows(interleave_groups(in_order), group), q)
    # A slice of whole blocks is the same int4 tensor as those rows quantized alone.
    assert torch.equal(quantize_int4(w[4:], group)[0], q[4:])


def test_int4_quantized_in_slices_of_any_rows_equals_at_once() -> None:
    """A checkpoint's weight comes in slices (its files, read a slice at a time): whatever
    their sizes, int4's blocks of four rows come out whole."""
    w = torch.randn(37, 200)
    at_once = quantize_int4(w, 64)
    parts = (w[:5], w[5:6], w[6:30], w[30:])
    in_slices = quantize_weight(parts, 37, 200, "int4")
    assert torch.equal(in_slices[0], at_once[0]) and torch.equal(in_slices[1], at_once[1])
    with pytest.raises(ValueError, match="36 output rows, expected 37"):
        quantize_weight((w[:36],), 37, 200, "int4")


def test_bad_group_and_mode() -> None:
    with pytest.raises(ValueError, match="group_size"):
        quantize_int4(torch.zeros(2, 64), 48)
    with pytest.raises(ValueError, match="quantization"):
        QuantLinear(nn.Linear(4, 4), "int3")
    with pytest.raises(ValueError, match="quantization"):
        quantize_linears(nn.Sequential(nn.Linear(4, 4)), "fp8")


def test_int16_rows_keep_bfloat16_inputs_almost_exactly() -> None:
    from nbengine.ops.quant import quantize_rows_int16

    x = _randn(3, 300, seed=7).to(BF16).float()
    x[1] = 0.0
    xq, sx = quantize_rows_int16(x)
    assert float(xq.abs().max()) == 32767 and not xq[1].any() and float(sx[1]) == 0
    err = (xq * sx[:, None] - x).abs().amax(dim=1)
    assert bool((err <= x.abs().amax(dim=1) / 65534 * 1.001).all())


def test_int8_groups_keep_each_group_within_half_a_step() -> None:
    from nbengine.ops.quant import quantize_groups_int8

    x = _randn(3, 100, seed=8).to(BF16).float()
    x[1] = 0.0
    x[2, :64] *= 1000.0  # one loud group does not coarsen its neighbour
    xq, sx = quantize_groups_int8(x, 64)
    assert xq.shape == (3, 128) and sx.shape == (3, 2)
    assert not xq[:, 100:].any() and not xq[1].any() and not sx[1].any()
    assert float(xq.abs().max()) == 127
    back = (xq.view(3, 2, 64) * sx[..., None]).view(3, 128)[:, :100]
    step = sx.repeat_interleave(64, dim=1)[:, :100]
    assert bool(((back - x).abs() <= step / 2 * 1.001 + 1e-30).all())
    assert float(sx[2, 1]) < float(sx[2, 0]) / 100


def test_reference_matches_dequantized_f_linear() -> None:
    w, x, b = _randn(70, 40, seed=1), _randn(3, 2, 40, seed=2), _randn(70, seed=3)
    for mode in QUANTIZATION_MODES:
        q, s, g = _quantize(w, mode)
        got = linear_quantized_reference(x, q, s, 40, g, b)
        want = nn.functional.linear(x, dequantize(q, s, 40, g), b)
        assert got.shape == (3, 2, 70)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_float32_model_uses_reference_and_stays_close_to_full_precision() -> None:
    lin = nn.Linear(128, 48)
    x = _randn(4, 128, seed=5)
    for mode in QUANTIZATION_MODES:
        ql = QuantLinear(lin, mode)
        assert not ql.is_native  # native kernels take bfloat16 inputs only
        with torch.no_grad():
            got, want = ql(x), lin(x)
        tol = 0.02 if mode == "int8" else 0.15
        assert float((got - want).norm() / want.norm()) < tol, mode


@pytest.mark.parametrize("mode", list(QUANTIZATION_MODES))
@pytest.mark.parametrize("m", [1, 2, 3, 7, 16, 17, 31, 32, 40, 63, 64, 130])
# K = 4100: past the int8 kernel's int32 flush every 2048 inputs, with a tail. K = 77 and
# 4100 leave int8 rows of Kp = 32 mod 64 (half an AMX int8 step), N = 37, 130, 5 and 9
# a last AMX block of fewer than 16 features.
@pytest.mark.parametrize("n,k", [(64, 64), (37, 100), (130, 96), (5, 77), (200, 576), (9, 4100)])
# amx: the AMX tile kernels from native.AMX_ROWS rows on, where the CPU has them (else,
# and with amx False, the row kernels and the int8 bf16 tiles).
@pytest.mark.parametrize("amx", [True, False])
@pytest.mark.required
@needs_native
def test_native_matches_reference(mode: str, m: int, n: int, k: int, amx: bool) -> None:
    assert kernels is not None
    w, x, b = (
        _randn(n, k, seed=n + k).to(BF16),
        _randn(m, k, seed=m).to(BF16),
        _randn(n, seed=9).to(BF16),
    )
    if m == 3:
        x[1] = 0.0  # a zero row (scale 0 in the int16 path)
    q, s, g = _quantize(w, mode)
    want = linear_quantized_reference(x, q, s, k, g, b, torch.float32, amx=amx and kernels.amx)
    got = kernels.linear_quantized(x, q, s, k, g, b, torch.float32, amx=amx)
    assert got.shape == (m, n) and got.dtype == torch.float32
    scale = float(want.abs().max())
    # float32 sums in another order (the reference rounds the weights to bfloat16 where
    # the kernel's many-row and AMX paths do).
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * scale)
    got16 = kernels.linear_quantized(x, q, s, k, g, b, BF16, amx=amx)
    assert got16.dtype == BF16
    torch.testing.assert_close(got16.float(), want, rtol=2e-2, atol=2e-2 * scale)
    # Splitting the rows over threads changes no value.
    two = kernels.linear_quantized(x, q, s, k, g, b, torch.float32, num_threads=2, amx=amx)
    assert torch.equal(two, got)


@pytest.mark.parametrize("mode", list(QUANTIZATION_MODES))
@pytest.mark.required
@needs_native
@amx_only
def test_amx_rows_do_not_depend_on_the_batch(mode: str) -> None:
    """On the AMX path a row's product is the same whatever rows share its call: alone in
    a 16-row call, among 70, in another row tile, on one thread or two."""
    assert kernels is not None
    w, x = _randn(50, 200, seed=11).to(BF16), _randn(70, 200, seed=12).to(BF16)
    q, s, g = _quantize(w, mode)
    full = kernels.linear_quantized(x, q, s, 200, g, None, torch.float32, num_threads=2)
    for lo, hi in [(0, 16), (30, 46), (54, 70), (10, 50)]:
        part = kernels.linear_quantized(x[lo:hi].contiguous(), q, s, 200, g, None, torch.float32)
        assert torch.equal(part, full[lo:hi]), (lo, hi)


@pytest.mark.parametrize("mode", list(QUANTIZATION_MODES))
@pytest.mark.required
@needs_native
def test_row_kernel_rows_do_not_depend_on_the_batch(mode: str) -> None:
    """Without AMX the row kernels take rows of x several at a time: int8 below
    INT8_TILE_ROWS (batched decode), int4 at every row count (prefill chunks too). A
    row's product is bit for bit the same whatever rows share its call and wherever it
    falls in that call's blocks (K = 4100: past int8's int32 flush, with a tail)."""
    assert kernels is not None
    m = INT8_TILE_ROWS - 1 if mode == "int8" else 130
    w, x = _randn(37, 4100, seed=15).to(BF16), _randn(m, 4100, seed=16).to(BF16)
    q, s, g = _quantize(w, mode)

    def product(rows: torch.Tensor) -> torch.Tensor:
        return kernels.linear_quantized(rows, q, s, 4100, g, None, torch.float32, amx=False)

    full = product(x)
    for lo, hi in [(0, 1), (5, 6), (1, 4), (3, 10), (2, 29), (30, 31), (m - 1, m)]:
        assert torch.equal(product(x[lo:hi].contiguous()), full[lo:hi]), (lo, hi)


@pytest.mark.required
@needs_native
def test_int8_amx_keeps_the_row_kernels_int16_sums() -> None:
    """int8 weights on AMX tiles multiply the same int16-scaled inputs as the row
    kernels, with exact integer sums: the two agree to float32 rounding, far closer than
    the bfloat16-rounded weights of the dense path would (a loud input column makes the
    difference)."""
    assert kernels is not None
    m = 24  # from native.AMX_ROWS on, below INT8_TILE_ROWS: the row kernels without amx
    assert native.AMX_ROWS <= m < INT8_TILE_ROWS
    w, x = _randn(64, 4096, seed=13).to(BF16), _randn(m, 4096, seed=14).to(BF16)
    x[:, 7] = 300.0
    q, s = quantize_int8(w)
    amx = kernels.linear_quantized(x, q, s, 4096, None, None, torch.float32, amx=True)
    rows = kernels.linear_quantized(x, q, s, 4096, None, None, torch.float32, amx=False)
    dense = linear_quantized_reference(x, q, s, 4096, None, None, torch.float32, bf16_rows=1)
    scale = float(rows.abs().max())
    torch.testing.assert_close(amx, rows, rtol=0, atol=1e-6 * scale)
    assert float((dense - rows).abs().max()) > 1e-4 * scale


@pytest.mark.parametrize("group", [96, 128])  # groups the modes do not use, as the kernel allows
@pytest.mark.parametrize("m", [1, 5])
@pytest.mark.parametrize("k", [96, 200, 576])
@pytest.mark.required
@needs_native
def test_native_int4_other_group_sizes_match_reference(group: int, m: int, k: int) -> None:
    assert kernels is not None
    w, x = _randn(70, k, seed=k).to(BF16), _randn(m, k, seed=m + 1).to(BF16)
    q, s = quantize_int4(w, group)
    want = linear_quantized_reference(x, q, s, k, group, None, torch.float32)
    got = kernels.linear_quantized(x, q, s, k, group, None, torch.float32)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


@pytest.mark.parametrize("mode", list(QUANTIZATION_MODES))
@pytest.mark.required
@needs_native
def test_dequantize_kernel_is_the_reference_rounded_to_bfloat16(mode: str) -> None:
    assert kernels is not None
    w = _randn(70, 100, seed=3)
    q, s, g = _quantize(w, mode)
    want = dequantize(q, s, 100, g).to(BF16)
    assert torch.equal(kernels.dequantize(q, s, 100, g), want)
    assert torch.equal(kernels.dequantize(q, s, 100, g, (5, 40)), want[5:40])


@pytest.mark.parametrize("mode", list(QUANTIZATION_MODES))
@pytest.mark.parametrize("tile_bytes", [32 << 20, 2 * 100 * 16])  # one slice; 16 rows a slice
@pytest.mark.required
@needs_native
def test_dense_path_for_many_rows(
    mode: str, tile_bytes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From ``dense_rows`` rows on (AMX CPUs): bfloat16-rounded weights in oneDNN, sliced
    by output rows when large; fewer rows keep the row kernels."""
    from nbengine.ops import quant

    monkeypatch.setattr(quant, "_DENSE_TILE_BYTES", tile_bytes)
    slices: list[tuple[int, int] | None] = []
    real = native.NativeKernels.dequantize

    def spy(self: native.NativeKernels, *args: object, **kw: object) -> torch.Tensor:
        slices.append(args[4] if len(args) > 4 else None)  # type: ignore[arg-type]
        return real(self, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(native.NativeKernels, "dequantize", spy)
    lin = nn.Linear(100, 70, bias=True).to(BF16)
    ql = QuantLinear(lin, mode)
    ql.dense_rows = 12  # as on an AMX CPU, whatever this one is
    x = _randn(30, 100, seed=6).to(BF16)
    args = (ql.qweight, ql.scales, 100, ql.group_size, ql.bias)
    got = ql(x, out_dtype=torch.float32)
    want = linear_quantized_reference(x, *args, torch.float32, bf16_rows=12)
    scale = float(want.abs().max())
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2 * scale)  # bfloat16 output
    assert slices == (
        [None] if tile_bytes > 2 * 100 * 70 else [(n, min(70, n + 16)) for n in range(0, 70, 16)]
    )
    few = ql(x[:11], out_dtype=torch.float32)  # below the threshold: the row kernels
    assert torch.equal(few, kernels.linear_quantized(x[:11], *args, torch.float32))
    assert len(slices) == (1 if tile_bytes > 2 * 100 * 70 else 5)


@pytest.mark.required
@needs_native
def test_dense_path_on_two_threads_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The dense path's dequantized weights live in a buffer reused from call to call:
    two engines' core threads multiplying at once (different layers, different slices)
    still get each their own layer's product, equal to the same call made alone."""
    import threading

    from nbengine.ops import quant

    monkeypatch.setattr(quant, "_DENSE_TILE_BYTES", 2 * 96 * 16)  # slices of 16 rows
    layers = [QuantLinear(nn.Linear(96, 80 + 16 * i).to(BF16), "int8") for i in range(2)]
    for ql in layers:
        ql.dense_rows = 12
    xs = [_randn(40, 96, seed=20 + i).to(BF16) for i in range(2)]
    alone = [ql(x) for ql, x in zip(layers, xs)]
    errors: list[str] = []
    start = threading.Barrier(2)

    def run(i: int) -> None:
        start.wait()
        for _ in range(50):
            if not torch.equal(layers[i](xs[i]), alone[i]):
                errors.append(f"thread {i} got another product")
                return

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


@needs_native
def test_dequantize_into_a_wrong_buffer_is_refused() -> None:
    ql = QuantLinear(nn.Linear(64, 32).to(BF16), "int8")
    assert kernels is not None
    with pytest.raises(ValueError, match=r"out must be a contiguous bfloat16 \[32, 64\]"):
        kernels.dequantize(ql.qweight, ql.scales, 64, None, out=torch.empty(32, 65, dtype=BF16))
    got = kernels.dequantize(ql.qweight, ql.scales, 64, None, out=torch.empty(32, 64, dtype=BF16))
    assert torch.equal(got, kernels.dequantize(ql.qweight, ql.scales, 64, None))


@pytest.mark.parametrize("mode", list(QUANTIZATION_MODES))
@pytest.mark.required
@needs_native
def test_quant_linear_native_forward(mode: str) -> None:
    lin = nn.Linear(96, 50, bias=True).to(BF16)
    ql = QuantLinear(lin, mode)
    assert ql.is_native and "native" in repr(ql)
    x = _randn(2, 3, 96, seed=4).to(BF16)  # leading dims are kept
    got = ql(x)
    assert got.shape == (2, 3, 50) and got.dtype == BF16
    want = linear_quantized_reference(x, ql.qweight, ql.scales, 96, ql.group_size, ql.bias)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    logits = ql(x[0], out_dtype=torch.float32)
    assert logits.dtype == torch.float32


def test_quantize_linears_replaces_every_linear_and_shrinks_weights() -> None:
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64)).to(BF16)
    full = sum(p.numel() * 2 for p in model.parameters() if p.dim() == 2)
    assert quantize_linears(model, "int4") == 2
    assert all(isinstance(model[i], QuantLinear) for i in (0, 2))
    quantized = sum(model[i].weight_bytes for i in (0, 2))
    assert quantized < full / 3
