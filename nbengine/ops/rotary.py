"""Rotary position embeddings (GPT-NeoX / Hugging Face "rotate_half" layout).

``RotaryEmbedding`` precomputes float32 cos/sin tables for every position up to
``max_positions`` once; a forward pass only gathers rows by position. Scaling types:
``default``, ``linear`` and Llama 3's ``llama3`` (frequency-dependent wavelength scaling).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from nbengine.ops import native

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_inv_freq(
    head_dim: int, theta: float, scaling: dict[str, Any] | None = None
) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` (float32), with ``scaling`` applied."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim)
    )
    rope_type = rope_type_of(scaling)
    if rope_type == "default":
        return inv_freq
    assert scaling is not None
    factor = float(scaling["factor"])
    if rope_type == "linear":
        return inv_freq / factor
    if rope_type == "llama3":
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen = old_len / low
        high_wavelen = old_len / high
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths (low frequencies) are divided by factor, short ones kept,
        # and the band in between is interpolated smoothly.
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"Unsupported rope scaling type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}.")


def rope_type_of(scaling: dict[str, Any] | None) -> str:
    """The scaling type named by an HF ``rope_scaling``/``rope_parameters`` dict."""
    if not scaling:
        return "default"
    return str(scaling.get("rope_type", scaling.get("type", "default")))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_ref(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: rotate ``q [T, Hq, D]`` and ``k [T, Hk, D]`` at ``positions [T]``."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]
    qf, kf = q.float(), k.float()
    q_out = qf * cos + _rotate_half(qf) * sin
    k_out = kf * cos + _rotate_half(kf) * sin
    return q_out.to(q.dtype), k_out.to(k.dtype)


class RotaryEmbedding(nn.Module):
    """Applies RoPE using cos/sin tables precomputed for ``max_positions`` positions."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float = 10000.0,
        scaling: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        # The tables are always computed on the CPU: under a meta-device context (the
        # loader builds models there) torch would route these ops through its Python
        # reference kernels, which import torch._dynamo (seconds per process).
        with torch.device("cpu"):
            inv_freq = rope_inv_freq(head_dim, theta, scaling)
            t = torch.arange(max_positions, dtype=torch.int64).to(torch.float32)
            freqs = torch.outer(t, inv_freq)
        # Tables hold the half-dimension; apply() duplicates through broadcasting.
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)
        self._cached: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def _tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Every layer of one forward pass gets the same ``positions`` tensor: gather the
        # rows once and reuse them (the cache holds only the latest tensor).
        cached = self._cached
        if cached is not None and cached[0] is positions:
            return cached[1], cached[2]
        cos = self.cos[positions][:, None, :]
        sin = self.sin[positions][:, None, :]
        self._cached = (positions, cos, sin)
        return cos, sin

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``q [T, Hq, D]`` and ``k [T, Hk, D]``; computed in float32, cast back."""
        cos, sin = self._tables(positions)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Rotate ``x [T, H, D]`` (e.g. q and k side by side): one pass instead of two.

        bfloat16 input whose heads are contiguous (rows may be strided, e.g. a slice of
        the fused qkv projection) is rotated in place by the native kernel and returned.
        """
        if (x.dtype == torch.bfloat16 and x.stride(2) == 1 and x.stride(1) == x.shape[2]
                and positions.dtype == torch.int64 and positions.is_contiguous()
                and self.cos.dtype == torch.float32):
            k = native.kernels()
            if k is not None:
                return k.rotary_(x, positions, self.cos, self.sin)
        cos, sin = self._tables(positions)
        return _rotate(x, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)
