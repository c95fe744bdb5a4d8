"""GPT2LMHeadModel: learned positions, pre-LayerNorm blocks, gelu_new MLP, tied lm_head.

Checkpoint Conv1D weights are stored ``[in, out]``; the loader transposes them into
ordinary ``nn.Linear`` layers (the ``transposed`` modules of the model's
``CheckpointLayout``, model/weight_map.py). Attention runs on the same paged KV cache as the
Llama family (one KV head per query head).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from nbengine.model.weight_map import CheckpointLayout, CheckpointModule
from nbengine.ops.attention import AttentionMetadata
from nbengine.ops.attention_kernels import paged_attention

_ACTIVATIONS = {
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "relu": F.relu,
}


@dataclass(slots=True)
class GPT2Args:
    """Shape of a GPT-2 model, parsed from config.json."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    inner_size: int
    max_positions: int
    eps: float
    activation: str
    tie_word_embeddings: bool
    scale_attn_weights: bool

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> GPT2Args:
        hidden = int(cfg.get("n_embd", cfg.get("hidden_size", 768)))
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            num_layers=int(cfg.get("n_layer", cfg.get("num_hidden_layers", 12))),
            num_heads=int(cfg.get("n_head", cfg.get("num_attention_heads", 12))),
            inner_size=int(cfg.get("n_inner") or 4 * hidden),
            max_positions=int(cfg.get("n_positions", cfg.get("max_position_embeddings", 1024))),
            eps=float(cfg.get("layer_norm_epsilon", 1e-5)),
            activation=str(cfg.get("activation_function", "gelu_new")),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
            scale_attn_weights=bool(cfg.get("scale_attn_weights", True)),
        )


class GPT2Block(nn.Module):
    def __init__(self, a: GPT2Args) -> None:
        super().__init__()
        self.num_heads = a.num_heads
        self.head_dim = a.hidden_size // a.num_heads
        self.hidden = a.hidden_size
        self.scale = self.head_dim**-0.5 if a.scale_attn_weights else 1.0
        self.ln_1 = nn.LayerNorm(a.hidden_size, eps=a.eps)
        self.c_attn = nn.Linear(a.hidden_size, 3 * a.hidden_size)
        self.attn_proj = nn.Linear(a.hidden_size, a.hidden_size)
        self.ln_2 = nn.LayerNorm(a.hidden_size, eps=a.eps)
        self.c_fc = nn.Linear(a.hidden_size, a.inner_size)
        self.mlp_proj = nn.Linear(a.inner_size, a.hidden_size)
        self.act = _ACTIVATIONS[a.activation]

    def forward(
        self, x: torch.Tensor, meta: AttentionMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.c_attn(self.ln_1(x)).split(self.hidden, dim=-1)
        shape = (n, self.num_heads, self.head_dim)
        o = paged_attention(
            q.reshape(shape), k.reshape(shape), v.reshape(shape), k_cache, v_cache, meta, self.scale
        )
        x = x + self.attn_proj(o.reshape(n, self.hidden))
        return x + self.mlp_proj(self.act(self.c_fc(self.ln_2(x))))


# Our projections -> GPT-2's modules, all Conv1D: their weights are stored [in, out].
_GPT2_NAMES = {
    "c_attn": "attn.c_attn",
    "attn_proj": "attn.c_proj",
    "c_fc": "mlp.c_fc",
    "mlp_proj": "mlp.c_proj",
}


class GPT2LMHeadModel(CheckpointModule):
    """GPT-2 over a paged KV cache."""

    def __init__(self, a: GPT2Args) -> None:
        super().__init__()
        self.args = a
        self.checkpoint_layout = CheckpointLayout(
            prefix="transformer.",
            renamed=_GPT2_NAMES,
            transposed=frozenset(_GPT2_NAMES),
            tied=("lm_head", "wte") if a.tie_word_embeddings else None,
        )
        self.num_layers = a.num_layers
        self.num_kv_heads = a.num_heads
        self.head_dim = a.hidden_size // a.num_heads
        self.layer_windows: tuple[int | None, ...] = (None,) * a.num_layers  # full attention
        self.wte = nn.Embedding(a.vocab_size, a.hidden_size)
        self.wpe = nn.Embedding(a.max_positions, a.hidden_size)
        self.h = nn.ModuleList(GPT2Block(a) for _ in range(a.num_layers))
        self.ln_f = nn.LayerNorm(a.hidden_size, eps=a.eps)
        self.lm_head = nn.Linear(a.hidden_size, a.vocab_size, bias=False)
        self.tie_weights()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` (final LayerNorm applied)."""
        x = self.wte(input_ids) + self.wpe(positions)
        for block, (kc, vc) in zip(self.h, kv_caches):
            x = block(x, meta, kc, vc)
        return self.ln_f(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[N, vocab]`` in float32."""
        return self.lm_head(hidden).float()
