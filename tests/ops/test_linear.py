"""Prepacked bfloat16 linear layers agree with F.linear (the reference)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nbengine.ops import native
from nbengine.ops.linear import PackedLinear, pack_linears, packed_linear_supported

needs_pack = pytest.mark.skipif(
    not packed_linear_supported(torch.bfloat16),
    reason="oneDNN bfloat16 prepacking unavailable on this CPU",
)


@needs_pack
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_packed_matches_f_linear(bias: bool, rows: int) -> None:
    torch.manual_seed(0)
    lin = nn.Linear(48, 80, bias=bias).to(torch.bfloat16)
    packed = PackedLinear(lin, batch_size_hint=8)
    x = torch.randn(rows, 48).to(torch.bfloat16)
    with torch.inference_mode():
        want = F.linear(x, lin.weight, lin.bias).float()
        got = packed(x).float()
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)


@needs_pack
def test_pack_linears_falls_back_to_onednn(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NBENGINE_NATIVE", "0")  # the native path: tests/ops/test_native.py
    native.kernels.cache_clear()
    try:
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)).to(torch.bfloat16)
        f32 = nn.Sequential(nn.Linear(16, 8))
        x = torch.randn(2, 16).to(torch.bfloat16)
        with torch.inference_mode():
            before = model(x).float()
            assert pack_linears(model) == 2
            after = model(x).float()
            assert pack_linears(f32) == 0
    finally:
        monkeypatch.delenv("NBENGINE_NATIVE")
        native.kernels.cache_clear()
    assert isinstance(model[0], PackedLinear) and isinstance(f32[0], nn.Linear)
    torch.testing.assert_close(after, before, rtol=1e-2, atol=1e-2)


def test_float32_is_never_packed() -> None:
    assert not packed_linear_supported(torch.float32)


needs_native = pytest.mark.skipif(
    native.kernels() is None, reason=f"native kernels: {native.unavailable_reason()}"
)


@needs_pack
@needs_native
@pytest.mark.parametrize("bias", [False, True])
def test_onednn_twin_takes_the_products_of_many_rows(bias: bool) -> None:
    """A NativeLinear with a oneDNN twin: below ONEDNN_MIN_ROWS rows the native kernel's
    exact result, from there on oneDNN's, and both agree with F.linear."""
    from nbengine.ops.linear import ONEDNN_MIN_ROWS, NativeLinear

    kernels = native.kernels()
    assert kernels is not None
    torch.manual_seed(0)
    lin = nn.Linear(64, 96, bias=bias).to(torch.bfloat16)
    plain = NativeLinear(lin, kernels)
    twin = NativeLinear(lin, kernels, onednn_twin=True)
    onednn = PackedLinear(lin)
    assert twin.has_onednn_twin and not plain.has_onednn_twin
    for rows in (1, ONEDNN_MIN_ROWS - 1, ONEDNN_MIN_ROWS, 40):
        x = torch.randn(rows, 64).to(torch.bfloat16)
        with torch.inference_mode():
            got = twin(x)
            want = (plain if rows < ONEDNN_MIN_ROWS else onednn)(x)
            ref = F.linear(x, lin.weight, lin.bias).float()
            logits = twin(x, torch.float32)  # lm_head asks for float32
        assert torch.equal(got, want), rows
        assert logits.dtype == torch.float32
        torch.testing.assert_close(got.float(), ref, rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(logits, ref, rtol=1e-2, atol=1e-2)
