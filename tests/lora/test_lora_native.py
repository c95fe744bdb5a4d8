"""LoRA deltas on a bfloat16 base by the native kernel (docs/lora.md, "How the deltas run"):
``nb_lora_bf16`` against a float32 torch reference (of the factors rounded to bfloat16, as
they are kept on a bfloat16 base), and ``LoRALayers`` using it."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from torch import nn

from nbengine.lora.adapter import AdapterWeights
from nbengine.lora.layers import LoRALayers
from nbengine.ops import native

from support.cpu_features import amx_marks

kernels = native.kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason=str(native.unavailable_reason()))
# The shrink on AMX tiles (where this CPU has them) and by dpbf16: the same sums but for
# their float32 order, so both meet the same reference.
SHRINKS = [
    pytest.param(
        True,
        id="amx",
        marks=amx_marks,
    ),
    pytest.param(False, id="dpbf16"),
]


def _reference(
    x: torch.Tensor,
    out: torch.Tensor,
    slots: Sequence[int],
    factors: Sequence[tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """``out[r] + B_s A_s x[r]`` in float32 per row with an adapter (unpadded factors),
    and the same sum of absolute values (the scale of float32 rounding; ``_assert_...``)."""
    ref, mag = out.float().clone(), out.float().abs()
    for r, s in enumerate(slots):
        if s >= 0:
            a, b = factors[s]
            ref[r] += b @ (a @ x[r].float())
            mag[r] += b.abs() @ (a.abs() @ x[r].float().abs())
    return ref, mag


def _assert_rounded_once(got: torch.Tensor, ref: tuple[torch.Tensor, torch.Tensor]) -> None:
    """``got`` is ``ref`` rounded to bfloat16: within one bf16 step of it, plus a few
    float32 steps of the summands' magnitude (float32 sums in another order differ by
    that much, which decides the rounding where the delta cancels the base)."""
    want, mag = ref
    tol = torch.finfo(torch.bfloat16).eps * want.abs() + 4 * torch.finfo(torch.float32).eps * mag
    err = (got.float() - want).abs()
    assert (err <= tol).all(), (err - tol).max()


def _packed(
    factors: Sequence[tuple[torch.Tensor, torch.Tensor]], k: int, n: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One part covering every output, in the kernel's layout (``pack_lora_factors``):
    A [S, R, K], B [S, R, N] (B transposed), ranks zero-padded; parts [[0, R, 0, N]]."""
    rank = max(a.shape[0] for a, _ in factors)
    big_a = torch.zeros(len(factors), rank, k)
    big_b = torch.zeros(len(factors), rank, n)
    for s, (a, b) in enumerate(factors):
        big_a[s, : a.shape[0]] = a
        big_b[s, : a.shape[0]] = b.t()
    pa, pb = native.pack_lora_factors(big_a.bfloat16(), [big_b.bfloat16()])
    return pa, pb, torch.tensor([[0, rank, 0, n]])


def _bf16(
    factors: Sequence[tuple[torch.Tensor, torch.Tensor]],
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The factors as the kernel reads them: rounded to bfloat16 (back in float32)."""
    return [(a.bfloat16().float(), b.bfloat16().float()) for a, b in factors]


@pytest.mark.parametrize("amx", SHRINKS)
@pytest.mark.parametrize(
    ("m", "k", "n"),
    [(1, 576, 960), (3, 40, 24), (17, 100, 37), (64, 1536, 576), (5, 7, 3), (40, 64, 33)],
)
def test_kernel_matches_the_float32_reference(m: int, k: int, n: int, amx: bool) -> None:
    assert kernels is not None
    gen = torch.Generator().manual_seed(m * 1000 + k)
    # two adapters of different ranks (16 and 5, zero-padded to 16) and rows of neither
    factors = [
        (torch.randn(16, k, generator=gen) / k**0.5, torch.randn(n, 16, generator=gen)),
        (torch.randn(5, k, generator=gen) / k**0.5, torch.randn(n, 5, generator=gen) * 3),
    ]
    slots = [(-1, 0, 1)[r % 3] for r in range(m)] if m > 1 else [1]
    x = torch.randn(m, k, generator=gen).bfloat16()
    out = torch.randn(m, n, generator=gen).bfloat16()
    before = out.clone()
    a, b, parts = _packed(factors, k, n)
    kernels.lora_(
        x, out, torch.tensor(slots, dtype=torch.int32), a, b, parts, num_threads=2, amx=amx
    )
    ref = _reference(x, before, slots, _bf16(factors))
    _assert_rounded_once(out, ref)
    base_rows = [r for r, s in enumerate(slots) if s < 0]
    assert torch.equal(out[base_rows], before[base_rows])  # untouched, bit for bit


@pytest.mark.parametrize("amx", SHRINKS)
@pytest.mark.parametrize("m", [1, 6, 21])
def test_kernel_gives_each_part_its_own_rank_columns(m: int, amx: bool) -> None:
    """A fused layer (q/k/v as three parts, one not targeted by the second adapter): each
    part's outputs get its own expand of its own rank columns; outputs of no part are
    untouched."""
    assert kernels is not None
    k, widths, rank = 96, (48, 16, 16), 8
    gen = torch.Generator().manual_seed(m)
    n = sum(widths) + 5  # five outputs after the parts: no adapter writes them
    # per adapter, per part: (A [rank, k], B [width, rank]); adapter 1 has no second part
    per = [
        [
            (torch.randn(rank, k, generator=gen) / k**0.5, torch.randn(w, rank, generator=gen))
            for w in widths
        ]
        for _ in range(2)
    ]
    per[1][1] = (torch.zeros(rank, k), torch.zeros(widths[1], rank))
    spans, first = [], 0
    for p, w in enumerate(widths):
        spans.append([p * rank, rank, first, w])
        first += w
    a, b = native.pack_lora_factors(
        torch.stack([torch.cat([pa for pa, _ in adapter]) for adapter in per]).bfloat16(),
        [torch.stack([adapter[p][1].t() for adapter in per]).bfloat16() for p in range(3)],
    )
    slots = [(0, -1, 1)[r % 3] for r in range(m)]
    x = torch.randn(m, k, generator=gen).bfloat16()
    out = torch.randn(m, n, generator=gen).bfloat16()
    before = out.clone()
    kernels.lora_(
        x,
        out,
        torch.tensor(slots, dtype=torch.int32),
        a,
        b,
        torch.tensor(spans),
        num_threads=2,
        amx=amx,
    )
    ref, mag = before.float().clone(), before.float().abs()
    for r, s in enumerate(slots):
        if s >= 0:
            for (pa, pb), (_, _, o, w) in zip(_bf16(per[s]), spans):
                ref[r, o : o + w] += pb @ (pa @ x[r].float())
                mag[r, o : o + w] += pb.abs() @ (pa.abs() @ x[r].float().abs())
    _assert_rounded_once(out, (ref, mag))
    assert torch.equal(out[:, sum(widths) :], before[:, sum(widths) :])
    base_rows = [r for r, s in enumerate(slots) if s < 0]
    assert torch.equal(out[base_rows], before[base_rows])


def test_kernel_refuses_bad_slots_and_shapes() -> None:
    assert kernels is not None
    bf = torch.bfloat16
    x, out = torch.ones(2, 8, dtype=bf), torch.ones(2, 4, dtype=bf)
    a, b = native.pack_lora_factors(torch.ones(1, 4, 8, dtype=bf), [torch.ones(1, 4, 4, dtype=bf)])
    parts = torch.tensor([[0, 4, 0, 4]])
    for bad in ([0, 1], [-2, 0]):
        with pytest.raises(ValueError, match="slot"):
            kernels.lora_(x, out, torch.tensor(bad, dtype=torch.int32), a, b, parts)
        assert torch.equal(out, torch.ones(2, 4, dtype=bf))  # unchanged
    zero = torch.zeros(2, dtype=torch.int32)
    # past the 16 rank columns (4 padded to 16), past N; not b's size
    for bad_parts in ([[13, 4, 0, 4]], [[0, 4, 1, 4]], [[0, 2, 0, 4]]):
        with pytest.raises(ValueError, match="parts"):
            kernels.lora_(x, out, zero, a, b, torch.tensor(bad_parts))
        assert torch.equal(out, torch.ones(2, 4, dtype=bf))
    with pytest.raises(ValueError, match="do not fit"):
        kernels.lora_(x, out, zero, a, torch.ones(2, b.shape[1], dtype=bf), parts)
    with pytest.raises(ValueError, match="do not fit"):
        kernels.lora_(x.float(), out, zero, a, b, parts)
    with pytest.raises(ValueError, match="do not fit"):
        kernels.lora_(x, out, zero, a.float(), b, parts)


class _Source:
    def __init__(self, name: str, rows: int) -> None:
        self.name, self.offset, self.rows = name, 0, rows


class _Model(nn.Module):
    """One bfloat16 linear, named as a checkpoint's (an unfused layout)."""

    def __init__(self, k: int, n: int) -> None:
        super().__init__()
        self.proj = nn.Linear(k, n, bias=False, dtype=torch.bfloat16)
        nn.init.normal_(self.proj.weight, std=0.01)

    class checkpoint_layout:  # the attribute LoRALayers reads
        @staticmethod
        def sources(name: str, rows: int) -> list[_Source]:
            return [_Source(name, rows)]


@pytest.mark.parametrize("rows", [1, 6, 40, 300])  # 300: split between threads
def test_layers_give_bf16_rows_the_float32_delta_rounded_once(rows: int) -> None:
    """On a bfloat16 base each adapter row's output is (base + float32 delta), rounded to
    bfloat16 once; base rows are the base layer's output."""
    k, n = 72, 40
    model = _Model(k, n)
    layers = LoRALayers(model)
    gen = torch.Generator().manual_seed(rows)
    factors = []
    for int_id, rank in ((1, 16), (2, 4)):
        a, b = torch.randn(rank, k, generator=gen), torch.randn(n, rank, generator=gen)
        layers.add(
            AdapterWeights(f"a{int_id}", int_id, rank, 1.0, ("proj",), {"proj": (a, b)}, "t")
        )
        factors.append((a, b))
    spans = [(1, 1), (0, 1), (2, 1)] * (rows // 3) + [(1, 1)] * (rows % 3)
    slots = [{0: -1, 1: 0, 2: 1}[i] for i, _ in spans]
    x = torch.randn(rows, k, generator=gen).bfloat16()
    base = model.proj(x)  # no step: the base model
    assert layers.begin_step(spans)
    got = model.proj(x)
    layers.end_step()
    _assert_rounded_once(got, _reference(x, base, slots, _bf16(factors)))
    base_rows = [r for r, s in enumerate(slots) if s < 0]
    assert torch.equal(got[base_rows], base[base_rows])
    assert torch.equal(model.proj(x), base)  # after the step: the base again


@pytest.mark.parametrize("amx", SHRINKS)
def test_a_rows_delta_does_not_depend_on_its_batch(amx: bool) -> None:
    """A row's output is the same bit for bit alone, among 15 rows of its adapter (one
    tile) and among 40 (three tiles, on two threads): rows of a tile are summed apart."""
    assert kernels is not None
    k, n = 576, 960
    gen = torch.Generator().manual_seed(7)
    factors = [(torch.randn(16, k, generator=gen) / k**0.5, torch.randn(n, 16, generator=gen))]
    a, b, parts = _packed(factors, k, n)
    x = torch.randn(40, k, generator=gen).bfloat16()
    out = torch.randn(40, n, generator=gen).bfloat16()

    def run(rows: slice, threads: int) -> torch.Tensor:
        got = out[rows].clone()
        slots = torch.zeros(got.shape[0], dtype=torch.int32)
        kernels.lora_(x[rows].contiguous(), got, slots, a, b, parts, num_threads=threads, amx=amx)
        return got

    alone = run(slice(5, 6), 1)
    assert torch.equal(run(slice(0, 15), 1)[5], alone[0])
    assert torch.equal(run(slice(0, 40), 2)[5], alone[0])


@pytest.mark.parametrize("amx", SHRINKS)
@pytest.mark.parametrize("rank", [64, 40, 33])  # two AMX K steps; not whole steps: FMAs
def test_kernel_at_ranks_above_one_amx_step(rank: int, amx: bool) -> None:
    assert kernels is not None
    k, n, m = 96, 70, 21
    gen = torch.Generator().manual_seed(rank)
    factors = [
        (torch.randn(rank, k, generator=gen) / k**0.5, torch.randn(n, rank, generator=gen)),
        (torch.randn(7, k, generator=gen) / k**0.5, torch.randn(n, 7, generator=gen)),
    ]
    slots = [(0, 1, -1)[r % 3] for r in range(m)]
    x = torch.randn(m, k, generator=gen).bfloat16()
    out = torch.randn(m, n, generator=gen).bfloat16()
    before = out.clone()
    a, b, parts = _packed(factors, k, n)
    kernels.lora_(x, out, torch.tensor(slots, dtype=torch.int32), a, b, parts, amx=amx)
    _assert_rounded_once(out, _reference(x, before, slots, _bf16(factors)))
