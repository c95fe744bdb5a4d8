"""The Llama family: Llama, Mistral, Qwen2, Qwen3, Phi-3, SmolLM3 and OLMo 2.

All share one decoder: blocks of RMSNorm -> GQA attention with RoPE -> RMSNorm -> SwiGLU
MLP. The differences are flags of ``DecoderArgs``: Qwen2 has biases on q/k/v, Qwen3
normalises q and k per head (RMSNorm over head_dim) before RoPE and may set ``head_dim``
independently of ``hidden_size``, Llama may set ``attention_bias`` (q/k/v/o) and
``mlp_bias``, and any of them may tie ``lm_head`` to the embeddings. Per layer, attention
may be limited to a sliding window (Mistral, Qwen2 with ``use_sliding_window``, Phi-3;
model/windows.py) and SmolLM3 skips RoPE in some layers (``no_rope_layers``).

- Phi-3 / Phi-4-mini store q/k/v and gate/up already fused (``qkv_proj``,
  ``gate_up_proj``) and may rotate only part of each head (``partial_rotary_factor``).
- OLMo 2 normalises q and k over the whole projection (all heads at once) and puts its
  norms after attention and the MLP (``x = x + norm(attn(x))``), none before.

For speed, q/k/v are held as one fused ``qkv_proj`` and gate/up as one ``gate_up_proj``;
``decoder_layout`` declares how the checkpoint's separate tensors stack into them
(model/weight_map.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeAlias

import torch
from torch import nn

from nbengine.model.decode_plan import DecodePlan, build_decode_plan, cache_key
from nbengine.model.protocol import PlannedDecode
from nbengine.model.weight_map import CheckpointLayout, CheckpointModule
from nbengine.model.windows import layer_windows, rope_layers
from nbengine.ops.activation import silu_and_mul
from nbengine.ops.attention import AttentionMetadata
from nbengine.ops.attention_kernels import paged_attention, rope_paged_attention
from nbengine.ops.linear import NativeLinear, PackedLinear
from nbengine.ops.quant import QuantLinear
from nbengine.ops.rms_norm import RMSNorm
from nbengine.ops.rotary import RotaryEmbedding, with_original_length

# A linear layer as built (nn.Linear) or as replaced after loading (pack_linears in
# ops/linear.py, quantize_linears in ops/quant.py).
AnyLinear: TypeAlias = "nn.Linear | PackedLinear | NativeLinear | QuantLinear"


@dataclass(slots=True)
class DecoderArgs:
    """Shape and flavour of a Llama-family model, parsed from config.json."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_positions: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    hidden_act: str
    # Per layer: the sliding window (None: full attention) and whether RoPE is applied.
    layer_windows: tuple[int | None, ...] = ()
    layer_rope: tuple[bool, ...] = ()
    rotary_dim: int = 0  # channels of each head that RoPE rotates (Phi-4-mini: 3/4)
    model_max_positions: int | None = None  # config max_position_embeddings (rope scaling)
    qk_norm_full: bool = False  # OLMo 2: q/k RMSNorm over the whole projection
    post_norm: bool = False  # OLMo 2: norms after attention and MLP, none before
    fused_checkpoint: bool = False  # Phi-3: the checkpoint stores qkv_proj / gate_up_proj

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], arch: str, max_positions: int) -> DecoderArgs:
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        rope_params = (
            cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else None
        )
        theta = cfg.get("rope_theta")
        if theta is None and rope_params is not None:
            theta = rope_params.get("rope_theta")
        scaling = cfg.get("rope_scaling") or rope_params
        attention_bias = bool(cfg.get("attention_bias", False))
        qwen2 = arch == "Qwen2ForCausalLM"
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        partial = cfg.get("partial_rotary_factor")
        if partial is None and rope_params is not None:
            partial = rope_params.get("partial_rotary_factor")
        scaling = with_original_length(scaling, cfg)  # Phi-3 keeps it beside rope_scaling
        layers = int(cfg["num_hidden_layers"])
        olmo2 = arch == "Olmo2ForCausalLM"
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta if theta is not None else 10000.0),
            rope_scaling=scaling,
            max_positions=max_positions,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qwen2 or attention_bias,
            o_bias=attention_bias and not qwen2,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM" or olmo2,
            hidden_act=str(cfg.get("hidden_act", "silu")),
            layer_windows=layer_windows(cfg, arch, layers),
            layer_rope=rope_layers(cfg, arch, layers),
            rotary_dim=int(head_dim * float(partial)) if partial is not None else head_dim,
            model_max_positions=int(cfg.get("max_position_embeddings") or max_positions),
            qk_norm_full=olmo2,
            post_norm=olmo2,
            fused_checkpoint=arch == "Phi3ForCausalLM",
        )


class DecoderAttention(nn.Module):
    # nn.Linear as built; packed (ops/linear.py) or quantized (ops/quant.py) after loading.
    qkv_proj: AnyLinear
    o_proj: AnyLinear

    def __init__(
        self, a: DecoderArgs, rotary: RotaryEmbedding | None, window: int | None = None
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = a.num_heads, a.num_kv_heads, a.head_dim
        self.q_size = a.num_heads * a.head_dim
        self.kv_size = a.num_kv_heads * a.head_dim
        self.qkv_proj = nn.Linear(a.hidden_size, self.q_size + 2 * self.kv_size, bias=a.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, a.hidden_size, bias=a.o_bias)
        q_dim, k_dim = (self.q_size, self.kv_size) if a.qk_norm_full else (a.head_dim, a.head_dim)
        self.q_norm = RMSNorm(q_dim, a.rms_norm_eps) if a.qk_norm else None
        self.k_norm = RMSNorm(k_dim, a.rms_norm_eps) if a.qk_norm else None
        self.qk_norm_full = a.qk_norm_full
        self.rotary = rotary  # None: this layer applies no position embedding (SmolLM3)
        self.window = window
        self.scale = a.head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        n = x.shape[0]
        qkv = self.qkv_proj.forward(x)
        rotary = self.rotary
        if self.qk_norm_full or rotary is None:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            norms = (
                None if self.q_norm is None or self.k_norm is None else (self.q_norm, self.k_norm)
            )
            if norms is not None and self.qk_norm_full:  # over all heads at once
                q, k = norms[0](q.contiguous()), norms[1](k.contiguous())
            q = q.reshape(n, self.num_heads, self.head_dim)
            k = k.reshape(n, self.num_kv_heads, self.head_dim)
            v = v.reshape(n, self.num_kv_heads, self.head_dim)
            if norms is not None and not self.qk_norm_full:  # per head
                q, k = norms[0](q), norms[1](k)
            if rotary is not None:
                q, k = rotary(positions, q, k)
        elif self.q_norm is None:
            o = rope_paged_attention(
                qkv,
                self.num_heads,
                positions,
                rotary,
                k_cache,
                v_cache,
                meta,
                self.scale,
                self.window,
            )
            if o is not None:  # the three steps below in one native call, same values
                return self.o_proj.forward(o.view(n, self.q_size))
            # q and k sit side by side in qkv: rotate them in one pass (same elementwise ops).
            qk = qkv[:, : self.q_size + self.kv_size].view(
                n, self.num_heads + self.num_kv_heads, self.head_dim
            )
            q, k = rotary.rotate(positions, qk).split([self.num_heads, self.num_kv_heads], dim=1)
            v = qkv[:, self.q_size + self.kv_size :].view(n, self.num_kv_heads, self.head_dim)
        else:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q.view(n, self.num_heads, self.head_dim)
            k = k.view(n, self.num_kv_heads, self.head_dim)
            v = v.view(n, self.num_kv_heads, self.head_dim)
            assert self.k_norm is not None
            q, k = rotary(positions, self.q_norm(q), self.k_norm(k))
        o = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale, self.window)
        return self.o_proj.forward(o.view(n, self.q_size))


class SwiGLU(nn.Module):
    gate_up_proj: AnyLinear  # as DecoderAttention's projections
    down_proj: AnyLinear

    def __init__(self, a: DecoderArgs) -> None:
        super().__init__()
        self.inter = a.intermediate_size
        self.gate_up_proj = nn.Linear(a.hidden_size, 2 * a.intermediate_size, bias=a.mlp_bias)
        self.down_proj = nn.Linear(a.intermediate_size, a.hidden_size, bias=a.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.forward(silu_and_mul(self.gate_up_proj.forward(x)))


class DecoderLayer(nn.Module):
    def __init__(
        self, a: DecoderArgs, rotary: RotaryEmbedding | None, window: int | None = None
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.self_attn = DecoderAttention(a, rotary, window)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.mlp = SwiGLU(a)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(h, residual)``: the stream is ``h + residual``, added by the next norm.

        Deferring each residual add to the norm that follows fuses the two (one native
        pass); the values are those of ``x = x + attn(norm(x)); x = x + mlp(norm(x))``.
        """
        if residual is None:
            residual, h = x, self.input_layernorm.forward(x)
        else:
            h, residual = self.input_layernorm.add_forward(x, residual)
        h = self.self_attn.forward(h, positions, meta, k_cache, v_cache)
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp.forward(h), residual


class PostNormDecoderLayer(nn.Module):
    """OLMo 2's block: ``x = x + norm1(attn(x)); x = x + norm2(mlp(x))`` (no pre-norms)."""

    def __init__(
        self, a: DecoderArgs, rotary: RotaryEmbedding | None, window: int | None = None
    ) -> None:
        super().__init__()
        self.self_attn = DecoderAttention(a, rotary, window)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.mlp = SwiGLU(a)
        self.post_feedforward_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(h, residual)`` as ``DecoderLayer`` returns them (the stream is their sum)."""
        if residual is not None:
            x = x + residual
        h = self.post_attention_layernorm(
            self.self_attn.forward(x, positions, meta, k_cache, v_cache)
        )
        x = x + h
        return self.post_feedforward_layernorm(self.mlp.forward(x)), x


class LlamaForCausalLM(CheckpointModule, PlannedDecode):
    """The Llama-family decoder (see the module docstring) over a paged KV cache; decode
    steps may run through its decode plan (``PlannedDecode``, model/protocol.py)."""

    def __init__(self, a: DecoderArgs) -> None:
        super().__init__()
        self.args = a
        self.checkpoint_layout = decoder_layout(a)
        self.num_layers = a.num_layers
        self.num_kv_heads = a.num_kv_heads
        self.head_dim = a.head_dim
        self.layer_windows: tuple[int | None, ...] = a.layer_windows or (None,) * a.num_layers
        self.rotary = RotaryEmbedding(
            a.head_dim,
            a.max_positions,
            a.rope_theta,
            a.rope_scaling,
            a.rotary_dim or a.head_dim,
            a.model_max_positions,
        )
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        rope = a.layer_rope or (True,) * a.num_layers
        block = PostNormDecoderLayer if a.post_norm else DecoderLayer
        self.layers = nn.ModuleList(
            block(a, self.rotary if rope[i] else None, self.layer_windows[i])
            for i in range(a.num_layers)
        )
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.lm_head = nn.Linear(a.hidden_size, a.vocab_size, bias=False)
        self.tie_weights()
        # Decode-only steps run through a DecodePlan where the native kernels can run the
        # whole stack; False forces the module path (the device path; tests compare the
        # two). The runner sets both limits once, through configure_decode_plans.
        self.decode_plans_enabled = True
        # Where products of many rows run on AMX tiles (ops/linear.py), decode steps of
        # more rows than this run the module path; None: no limit.
        self.decode_plan_max_rows: int | None = None
        self.decode_plans_paused = False  # pause_decode_plans: a LoRA step (docs/lora.md)
        self._plan: DecodePlan | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` (final norm applied) for the flattened batch."""
        x = self.embed_tokens(input_ids)
        if self._plan_may_run(meta, x.shape[0]):
            plan = self._decode_plan(kv_caches)
            if plan is not None:  # every layer in one native call (model/decode_plan.py)
                x, res = plan.run(x, positions, meta)
                return self.norm.add_forward(x, res)[0]
        residual: torch.Tensor | None = None
        # Layers are called through .forward: nn.Module.__call__ (hooks, which inference
        # never registers) would add about a millisecond to a 30-layer decode step.
        for layer, (kc, vc) in zip(self.layers, kv_caches):
            x, residual = layer.forward(x, residual, positions, meta, kc, vc)
        assert residual is not None, "a model has at least one layer"
        return self.norm.add_forward(x, residual)[0]

    def configure_decode_plans(self, *, enabled: bool, max_rows: int | None) -> None:
        """Whether decode plans may run, and on steps of at most how many rows."""
        self.decode_plans_enabled = enabled
        self.decode_plan_max_rows = max_rows

    def pause_decode_plans(self, paused: bool) -> None:
        """While paused, decode steps take the module path (the runner's LoRA steps)."""
        self.decode_plans_paused = paused

    def decode_logits(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor | None:
        """float32 logits of every row of a decode-only step, from one native call (the
        layers, the final norm and lm_head); ``None`` where the plan cannot do it."""
        plan = self._token_plan(meta, input_ids.shape[0], kv_caches)
        return None if plan is None else plan.logits(input_ids, positions, meta)

    def decode_greedy(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> list[int] | None:
        """Each row's greedy next token of a decode-only step from one native call
        (embedding, layers, head, argmax); ``None`` where the plan cannot do it."""
        plan = self._token_plan(meta, input_ids.shape[0], kv_caches)
        return None if plan is None else plan.greedy(input_ids, positions, meta)

    def _token_plan(
        self, meta: AttentionMetadata, rows: int, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> DecodePlan | None:
        """The decode plan, for a step it may run from token ids to logits (or tokens)."""
        if not self._plan_may_run(meta, rows):
            return None
        plan = self._decode_plan(kv_caches)
        return plan if plan is not None and plan.reads_token_ids else None

    def _plan_may_run(self, meta: AttentionMetadata, rows: int) -> bool:
        """A decode-only step the decode plan is allowed to take."""
        limit = self.decode_plan_max_rows
        return (
            meta.num_decodes == rows
            and self.decode_plans_enabled
            and not self.decode_plans_paused
            and (limit is None or rows <= limit)
        )

    def _decode_plan(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> DecodePlan | None:
        plan = self._plan
        if plan is None or (
            plan.kv_caches is not kv_caches and plan.cache_key != cache_key(kv_caches)
        ):
            plan = build_decode_plan(self, kv_caches)
            if plan is None:
                self.decode_plans_enabled = False  # this model cannot: stop asking
            self._plan = plan
        return plan

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[N, vocab]`` in float32 for the selected hidden rows."""
        head = self.lm_head
        if isinstance(
            head, (NativeLinear, QuantLinear)
        ):  # float32 straight from the kernel's accumulators
            return head(hidden, out_dtype=torch.float32)
        return head(hidden).float()


def decoder_layout(a: DecoderArgs) -> CheckpointLayout:
    """Where a Llama-family checkpoint keeps each parameter: q/k/v and gate/up packed into
    our fused projections, unless the checkpoint stores them fused (Phi-3)."""
    q, kv, inter = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.intermediate_size
    packed = (
        {}
        if a.fused_checkpoint
        else {
            "qkv_proj": (("q_proj", q), ("k_proj", kv), ("v_proj", kv)),
            "gate_up_proj": (("gate_proj", inter), ("up_proj", inter)),
        }
    )
    return CheckpointLayout(
        packed=packed, tied=("lm_head", "embed_tokens") if a.tie_word_embeddings else None
    )
