"""LoRA deltas on a bfloat16 base by the native kernel (docs/lora.md, "How the deltas run"):
``nb_lora_bf16`` against a float32 torch reference, and ``LoRALayers`` using it."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from torch import nn

from nbengine.lora.adapter import AdapterWeights
from nbengine.lora.layers import LoRALayers
from nbengine.ops import native

kernels = native.kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason=str(native.unavailable_reason()))


def _reference(
    x: torch.Tensor,
    out: torch.Tensor,
    slots: Sequence[int],
    factors: Sequence[tuple[torch.Tensor, torch.Tensor]],
) -> torch.Tensor:
    """``out[r] + B_s A_s x[r]`` in float32 per row with an adapter (unpadded factors)."""
    ref = out.float().clone()
    for r, s in enumerate(slots):
        if s >= 0:
            a, b = factors[s]
            ref[r] += b @ (a @ x[r].float())
    return ref


def _assert_rounded_once(got: torch.Tensor, ref: torch.Tensor) -> None:
    """``got`` is ``ref`` rounded to bfloat16 (within one bf16 step: float32 sums in
    another order may round the other way at a tie)."""
    ulp = torch.finfo(torch.bfloat16).eps * ref.abs().clamp_min(1e-30)
    assert ((got.float() - ref).abs() <= ulp).all(), (got.float() - ref).abs().max()


def _padded(
    factors: Sequence[tuple[torch.Tensor, torch.Tensor]], k: int, n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's layout: A [S, R, K], B [S, R, N] (B transposed), ranks zero-padded."""
    rank = max(a.shape[0] for a, _ in factors)
    big_a = torch.zeros(len(factors), rank, k)
    big_b = torch.zeros(len(factors), rank, n)
    for s, (a, b) in enumerate(factors):
        big_a[s, : a.shape[0]] = a
        big_b[s, : a.shape[0]] = b.t()
    return big_a, big_b


@pytest.mark.parametrize(
    ("m", "k", "n"), [(1, 576, 960), (3, 40, 24), (17, 100, 37), (64, 1536, 576), (5, 7, 3)]
)
def test_kernel_matches_the_float32_reference(m: int, k: int, n: int) -> None:
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
    a, b = _padded(factors, k, n)
    kernels.lora_(x, out, torch.tensor(slots, dtype=torch.int32), a, b, num_threads=2)
    ref = _reference(x, before, slots, factors)
    _assert_rounded_once(out, ref)
    base_rows = [r for r, s in enumerate(slots) if s < 0]
    assert torch.equal(out[base_rows], before[base_rows])  # untouched, bit for bit


def test_kernel_refuses_bad_slots_and_shapes() -> None:
    assert kernels is not None
    x, out = torch.ones(2, 8, dtype=torch.bfloat16), torch.ones(2, 4, dtype=torch.bfloat16)
    a, b = torch.ones(1, 2, 8), torch.ones(1, 2, 4)
    for bad in ([0, 1], [-2, 0]):
        with pytest.raises(ValueError, match="slot"):
            kernels.lora_(x, out, torch.tensor(bad, dtype=torch.int32), a, b)
        assert torch.equal(out, torch.ones(2, 4, dtype=torch.bfloat16))  # unchanged
    with pytest.raises(ValueError, match="do not fit"):
        kernels.lora_(x, out, torch.zeros(2, dtype=torch.int32), a, torch.ones(1, 2, 5))
    with pytest.raises(ValueError, match="do not fit"):
        kernels.lora_(x.float(), out, torch.zeros(2, dtype=torch.int32), a, b)


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


@pytest.mark.parametrize("rows", [1, 6, 40])
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
    _assert_rounded_once(got, _reference(x, base, slots, factors))
    base_rows = [r for r, s in enumerate(slots) if s < 0]
    assert torch.equal(got[base_rows], base[base_rows])
    assert torch.equal(model.proj(x), base)  # after the step: the base again
