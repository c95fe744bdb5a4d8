"""Gemma 2 and Gemma 3 (text): Gemma2ForCausalLM, Gemma3ForCausalLM.

Differences from the Llama family (model/llama.py), as transformers computes them:

- the embeddings are multiplied by ``sqrt(hidden_size)``, rounded to the model dtype;
- RMSNorm scales by ``1 + weight`` and normalises in float32 (``GemmaRMSNorm``);
- "sandwich" norms: each block is ``x = x + post_attn_norm(attn(input_norm(x)))``, then
  ``x = x + post_ff_norm(mlp(pre_ff_norm(x)))``;
- the MLP is ``down(gelu_tanh(gate(x)) * up(x))`` (``hidden_activation``);
- attention scores are scaled by ``query_pre_attn_scalar ** -0.5``, not ``head_dim ** -0.5``;
- Gemma 2 soft-caps the attention scores (``attn_logit_softcapping``) and the final logits
  (``final_logit_softcapping``): ``c * tanh(x / c)``;
- sliding-window layers alternate with global ones (``layer_types``, or Gemma 2's every
  other layer and Gemma 3's ``sliding_window_pattern``; model/windows.py);
- Gemma 3 normalises q and k per head (Gemma RMSNorm) before RoPE, and its sliding layers
  use their own RoPE base (``rope_local_base_freq``, or ``rope_parameters`` per layer type
  in newer configs) without the global layers' scaling.

q/k/v and gate/up are fused into one projection each while loading, as for Llama (the
packed modules of its ``CheckpointLayout``, model/weight_map.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from nbengine.model.weight_map import CheckpointLayout, CheckpointModule
from nbengine.model.windows import layer_types, layer_windows
from nbengine.ops.activation import gelu_tanh_and_mul
from nbengine.ops.attention import AttentionMetadata
from nbengine.ops.attention_kernels import paged_attention
from nbengine.ops.linear import NativeLinear
from nbengine.ops.quant import QuantLinear
from nbengine.ops.rotary import RotaryEmbedding, with_original_length

GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
GEMMA_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_tanh")

RopeSpec = tuple[float, dict[str, Any] | None]  # (theta, scaling)


@dataclass(slots=True)
class GemmaArgs:
    """Shape and flavour of a Gemma 2 / Gemma 3 text model, parsed from config.json."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    hidden_act: str
    attn_scale: float
    attn_softcap: float | None
    final_softcap: float | None
    attention_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    max_positions: int
    model_max_positions: int
    layer_windows: tuple[int | None, ...]
    layer_rope: tuple[RopeSpec, ...]  # per layer: (theta, scaling)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], arch: str, max_positions: int) -> GemmaArgs:
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        layers = int(cfg["num_hidden_layers"])
        gemma3 = arch == "Gemma3ForCausalLM"
        default_softcap = (50.0, 30.0) if not gemma3 else (None, None)
        attn_cap = cfg.get("attn_logit_softcapping", default_softcap[0])
        final_cap = cfg.get("final_logit_softcapping", default_softcap[1])
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            hidden_act=str(
                cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
            ),
            attn_scale=float(cfg.get("query_pre_attn_scalar") or head_dim) ** -0.5,
            attn_softcap=float(attn_cap) if attn_cap else None,
            final_softcap=float(final_cap) if final_cap else None,
            attention_bias=bool(cfg.get("attention_bias", False)),
            qk_norm=gemma3,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
            max_positions=max_positions,
            model_max_positions=int(cfg.get("max_position_embeddings") or max_positions),
            layer_windows=layer_windows(cfg, arch, layers),
            layer_rope=_layer_rope(cfg, arch, layers),
        )


def _layer_rope(cfg: dict[str, Any], arch: str, num_layers: int) -> tuple[RopeSpec, ...]:
    """Each layer's RoPE base and scaling (Gemma 3's sliding layers have their own)."""
    params = cfg.get("rope_parameters")
    types = layer_types(cfg, arch, num_layers)
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        # Newer configs: one rope_parameters dict per layer type.
        per_type = {
            t: (float(p.get("rope_theta", 10000.0)), with_original_length(p, cfg))
            for t, p in params.items()
            if isinstance(p, dict)
        }
        return tuple(per_type.get(t, per_type["full_attention"]) for t in types)
    flat = params if isinstance(params, dict) else None
    theta = cfg.get("rope_theta")
    if theta is None and flat is not None:
        theta = flat.get("rope_theta")
    global_rope: RopeSpec = (
        float(theta if theta is not None else 10000.0),
        with_original_length(cfg.get("rope_scaling") or flat, cfg),
    )
    if arch != "Gemma3ForCausalLM":
        return (global_rope,) * num_layers
    local_rope: RopeSpec = (float(cfg.get("rope_local_base_freq", 10000.0)), None)
    return tuple(local_rope if t == "sliding_attention" else global_rope for t in types)


class GemmaRMSNorm(nn.Module):
    """``x / rms(x) * (1 + weight)``, computed in float32 and cast back (weights start at 0)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class GemmaAttention(nn.Module):
    def __init__(self, a: GemmaArgs, rotary: RotaryEmbedding, window: int | None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = a.num_heads, a.num_kv_heads, a.head_dim
        self.q_size = a.num_heads * a.head_dim
        self.kv_size = a.num_kv_heads * a.head_dim
        self.qkv_proj = nn.Linear(
            a.hidden_size, self.q_size + 2 * self.kv_size, bias=a.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, a.hidden_size, bias=a.attention_bias)
        self.q_norm = GemmaRMSNorm(a.head_dim, a.rms_norm_eps) if a.qk_norm else None
        self.k_norm = GemmaRMSNorm(a.head_dim, a.rms_norm_eps) if a.qk_norm else None
        self.rotary = rotary
        self.window = window
        self.scale = a.attn_scale
        self.softcap = a.attn_softcap

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj.forward(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(n, self.num_heads, self.head_dim)
        k = k.reshape(n, self.num_kv_heads, self.head_dim)
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        o = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale, self.window, self.softcap)
        return self.o_proj.forward(o.reshape(n, self.q_size))


class GemmaMLP(nn.Module):
    def __init__(self, a: GemmaArgs) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(a.hidden_size, 2 * a.intermediate_size, bias=False)
        self.down_proj = nn.Linear(a.intermediate_size, a.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.forward(gelu_tanh_and_mul(self.gate_up_proj.forward(x)))


class GemmaDecoderLayer(nn.Module):
    def __init__(self, a: GemmaArgs, rotary: RotaryEmbedding, window: int | None) -> None:
        super().__init__()
        h, eps = a.hidden_size, a.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.self_attn = GemmaAttention(a, rotary, window)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.mlp = GemmaMLP(a)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        h = self.self_attn.forward(self.input_layernorm(x), positions, meta, k_cache, v_cache)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp.forward(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(h)


class GemmaForCausalLM(CheckpointModule):
    """Gemma 2 / Gemma 3 text decoder over a paged KV cache."""

    def __init__(self, a: GemmaArgs) -> None:
        super().__init__()
        self.args = a
        q, kv, inter = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.intermediate_size
        self.checkpoint_layout = CheckpointLayout(
            packed={
                "qkv_proj": (("q_proj", q), ("k_proj", kv), ("v_proj", kv)),
                "gate_up_proj": (("gate_proj", inter), ("up_proj", inter)),
            },
            tied=("lm_head", "embed_tokens") if a.tie_word_embeddings else None,
        )
        self.num_layers = a.num_layers
        self.num_kv_heads = a.num_kv_heads
        self.head_dim = a.head_dim
        self.layer_windows: tuple[int | None, ...] = a.layer_windows
        # One rotary table per distinct (theta, scaling): Gemma 3 has a local and a global one.
        tables: dict[str, RotaryEmbedding] = {}
        rotaries: list[RotaryEmbedding] = []
        for theta, scaling in a.layer_rope:
            key = repr((theta, scaling))
            if key not in tables:
                tables[key] = RotaryEmbedding(
                    a.head_dim,
                    a.max_positions,
                    theta,
                    scaling,
                    model_max_positions=a.model_max_positions,
                )
            rotaries.append(tables[key])
        self.rotaries = nn.ModuleList(tables.values())
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(a, rotaries[i], a.layer_windows[i]) for i in range(a.num_layers)
        )
        self.norm = GemmaRMSNorm(a.hidden_size, a.rms_norm_eps)
        self.lm_head = nn.Linear(a.hidden_size, a.vocab_size, bias=False)
        self.tie_weights()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` (final norm applied) for the flattened batch."""
        x = self.embed_tokens(input_ids)
        # The normaliser is rounded to the model dtype first, as transformers does.
        x = x * torch.tensor(self.args.hidden_size**0.5, dtype=x.dtype)
        for layer, (kc, vc) in zip(self.layers, kv_caches):
            x = layer.forward(x, positions, meta, kc, vc)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[N, vocab]`` in float32, soft-capped where the config says so."""
        head = self.lm_head
        if isinstance(head, (NativeLinear, QuantLinear)):
            logits = head(hidden, out_dtype=torch.float32)
        else:
            logits = head(hidden).float()
        cap = self.args.final_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
