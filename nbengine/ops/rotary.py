"""Rotary position embeddings (GPT-NeoX / Hugging Face "rotate_half" layout).

``RotaryEmbedding`` precomputes float32 cos/sin tables for every position up to
``max_positions`` once; a forward pass only gathers rows by position. Scaling types, with
transformers' semantics (``transformers.modeling_rope_utils``):

- ``default``, ``linear``, Llama 3's ``llama3`` (frequency-dependent wavelength scaling);
- ``yarn`` (Qwen, DeepSeek): a ramp between interpolated and original frequencies, and an
  attention factor that scales cos/sin (so q.k by its square);
- ``dynamic`` (NTK-aware): transformers rescales the base only once a sequence grows past
  ``max_position_embeddings``. The engine never serves positions past it
  (``max_model_len <= max_position_embeddings``), so within the served range the tables are
  the unscaled ones, exactly as transformers computes them there;
- ``longrope`` (alias ``su``; Phi-3, Phi-4-mini): per-frequency ``short_factor`` or
  ``long_factor`` divisors and an attention factor. transformers picks the factors by
  the length of each forward call, so a sequence that grows past
  ``original_max_position_embeddings`` mixes keys rotated both ways. Here the choice is
  made once: ``long_factor`` when the engine's ``max_model_len`` exceeds
  ``original_max_position_embeddings``, else ``short_factor`` (as vLLM does); it matches
  transformers for every sequence that stays on one side of that length.

``rotary_dim < head_dim`` (``partial_rotary_factor``, Phi-4-mini) rotates the first
``rotary_dim`` channels of each head and passes the rest through.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from nbengine.ops import native

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")


def rope_inv_freq(
    head_dim: int, theta: float, scaling: dict[str, Any] | None = None
) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` (float32), with ``scaling`` applied.

    For the types that depend on context lengths (``yarn``, ``dynamic``, ``longrope``) the
    lengths come from ``scaling`` alone; ``rope_parameters`` takes them explicitly and
    also returns the attention factor.
    """
    return rope_parameters(head_dim, theta, scaling)[0]


def rope_parameters(
    head_dim: int,
    theta: float,
    scaling: dict[str, Any] | None = None,
    max_positions: int | None = None,
    model_max_positions: int | None = None,
) -> tuple[torch.Tensor, float]:
    """``(inv_freq [head_dim // 2] float32, attention_factor)`` for ``scaling``.

    ``head_dim`` is the rotated width (``rotary_dim``). ``max_positions`` is the longest
    context the engine serves (picks longrope's factors); ``model_max_positions`` is the
    config's ``max_position_embeddings`` (the default ``factor`` of yarn and longrope, and
    dynamic scaling's reference length).
    """
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim)
    )
    rope_type = rope_type_of(scaling)
    if rope_type == "default":
        return inv_freq, 1.0
    assert scaling is not None
    if rope_type == "yarn":
        return _yarn(head_dim, theta, scaling, model_max_positions)
    if rope_type == "longrope":
        return _longrope(head_dim, theta, scaling, max_positions, model_max_positions)
    if rope_type == "dynamic":
        # transformers rescales only past max_position_embeddings (see the module docstring).
        ref_len = model_max_positions or int(scaling.get("original_max_position_embeddings") or 0)
        if not ref_len or max_positions is None or max_positions <= ref_len:
            return inv_freq, 1.0
        return _dynamic_ntk(head_dim, theta, float(scaling["factor"]), ref_len, max_positions), 1.0
    factor = float(scaling["factor"])
    if rope_type == "linear":
        return inv_freq / factor, 1.0
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
        return torch.where(medium, smoothed, scaled), 1.0
    raise ValueError(
        f"Unsupported rope scaling type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}."
    )


def _dynamic_ntk(dim: int, theta: float, factor: float, ref_len: int, seq_len: int) -> torch.Tensor:
    """NTK-aware base rescaling for a sequence of ``seq_len`` > ``ref_len`` positions."""
    base = theta * ((factor * seq_len / ref_len) - (factor - 1)) ** (dim / (dim - 2))
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim))


def _yarn(
    dim: int, theta: float, scaling: dict[str, Any], model_max_positions: int | None
) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate the low frequencies by ``factor``, keep the high ones, ramp between."""
    orig = float(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor")
    if factor is None:
        assert model_max_positions is not None, "yarn without factor needs max_position_embeddings"
        factor = model_max_positions / orig
    factor = float(factor)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = scaling.get("attention_factor")
    if attention is None:
        ms, ms_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = mscale(factor, ms) / mscale(factor, ms_all) if ms and ms_all else mscale(factor)
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        # The dimension whose wavelength makes ``rotations`` turns over the original context.
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(torch.float32) / dim)
    extrapolation = 1 - ramp  # 1: keep the original frequency, 0: interpolate
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (
        1.0 / pos_freqs
    ) * extrapolation
    return inv_freq, float(attention)


def _longrope(
    dim: int,
    theta: float,
    scaling: dict[str, Any],
    max_positions: int | None,
    model_max_positions: int | None,
) -> tuple[torch.Tensor, float]:
    """LongRoPE: per-frequency divisors, long ones when the served context exceeds the
    original one (see the module docstring), and an attention factor."""
    orig = int(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor")
    if factor is None:
        assert model_max_positions is not None, (
            "longrope without factor needs max_position_embeddings"
        )
        factor = model_max_positions / orig
    factor = float(factor)
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    long = max_positions is not None and max_positions > orig
    ext = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
    if ext.shape != (dim // 2,):
        raise ValueError(
            f"longrope factors must have rotary_dim / 2 = {dim // 2} entries, "
            f"got {tuple(ext.shape)}."
        )
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (ext * theta**shape), float(attention)


def with_original_length(
    scaling: dict[str, Any] | None, cfg: dict[str, Any]
) -> dict[str, Any] | None:
    """``scaling`` with the ``original_max_position_embeddings`` transformers would use.

    For ``llama3``, ``yarn`` and ``longrope``, a top-level config field of that name wins
    (Phi-3 keeps it there), else the scaling's own, else ``max_position_embeddings``.
    """
    if rope_type_of(scaling) not in ("llama3", "yarn", "longrope"):
        return scaling
    assert scaling is not None
    top = cfg.get("original_max_position_embeddings")
    if top is not None:
        return {**scaling, "original_max_position_embeddings": top}
    if scaling.get("original_max_position_embeddings") is None and cfg.get(
        "max_position_embeddings"
    ):
        return {**scaling, "original_max_position_embeddings": cfg["max_position_embeddings"]}
    return scaling


def rope_type_of(scaling: dict[str, Any] | None) -> str:
    """The scaling type named by an HF ``rope_scaling``/``rope_parameters`` dict
    (legacy names: ``su`` is ``longrope``)."""
    if not scaling:
        return "default"
    name = str(scaling.get("rope_type", scaling.get("type", "default")))
    return "longrope" if name == "su" else name


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
    """Applies RoPE using cos/sin tables precomputed for ``max_positions`` positions.

    ``rotary_dim`` (default ``head_dim``) channels of each head are rotated; the scaling's
    attention factor is folded into the tables. ``model_max_positions`` is the config's
    ``max_position_embeddings`` (see ``rope_parameters``).
    """

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float = 10000.0,
        scaling: dict[str, Any] | None = None,
        rotary_dim: int | None = None,
        model_max_positions: int | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = head_dim if rotary_dim is None else rotary_dim
        self._spec = (max_positions, theta, scaling, model_max_positions)
        self.register_buffer("inv_freq", torch.empty(0), persistent=False)
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.reset_tables()

    def reset_tables(self) -> None:
        """(Re)compute the float32 tables (``model.to(dtype)`` casts buffers; the loader
        calls this afterwards so the tables stay float32 for exactness)."""
        max_positions, theta, scaling, model_max_positions = self._spec
        # The tables are always computed on the CPU: under a meta-device context (the
        # loader builds models there) torch would route these ops through its Python
        # reference kernels, which import torch._dynamo (seconds per process).
        with torch.device("cpu"):
            inv_freq, attention = rope_parameters(
                self.rotary_dim, theta, scaling, max_positions, model_max_positions
            )
            t = torch.arange(max_positions, dtype=torch.int64).to(torch.float32)
            freqs = torch.outer(t, inv_freq)
            cos, sin = freqs.cos(), freqs.sin()
            if attention != 1.0:
                cos, sin = cos * attention, sin * attention
        # Tables hold the half-dimension; apply() duplicates through broadcasting.
        self.inv_freq, self.cos, self.sin = inv_freq, cos, sin
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
        if self.rotary_dim != self.head_dim:
            return _rotate_partial(q, cos, sin, self.rotary_dim), _rotate_partial(
                k, cos, sin, self.rotary_dim
            )
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Rotate ``x [T, H, D]`` (e.g. q and k side by side): one pass instead of two.

        bfloat16 input whose heads are contiguous (rows may be strided, e.g. a slice of
        the fused qkv projection) is rotated in place by the native kernel and returned.
        """
        if self.rotary_dim != self.head_dim:
            cos, sin = self._tables(positions)
            return _rotate_partial(x, cos, sin, self.rotary_dim)
        if (
            x.dtype == torch.bfloat16
            and x.is_cpu
            and x.stride(2) == 1
            and x.stride(1) == x.shape[2]
            and positions.dtype == torch.int64
            and positions.is_contiguous()
            and self.cos.dtype == torch.float32
        ):
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


def _rotate_partial(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int
) -> torch.Tensor:
    """Rotate the first ``rotary_dim`` channels of each head, pass the others through."""
    return torch.cat((_rotate(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]), dim=-1)
