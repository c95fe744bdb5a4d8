"""Tiny random checkpoints written by transformers' own model classes (save_pretrained,
safetensors), with the byte-level tokenizer of ``make_tiny_model``: for architectures that
``make_tiny_model`` does not write, and so that the checkpoint layout is transformers'."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from nbengine.testing import make_tiny_model

# architecture -> (transformers config class, model class) names
HF_CLASSES = {
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM"),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
}

SHAPE: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    initializer_range=0.15,
)


# Gemma 2 with the features that change the attention path: a sliding window, attention
# and final logit soft-capping, and its own query scale (shared by the parity suites).
GEMMA2_WINDOW_SOFTCAP: dict[str, object] = {
    "sliding_window": 8,
    "query_pre_attn_scalar": 24,
    "attn_logit_softcapping": 2.0,
    "final_logit_softcapping": 3.0,
    "tie_word_embeddings": False,
}


def make_hf_model(path: Path, arch: str, seed: int = 0, **config: Any) -> Path:
    """Write a random ``arch`` model of ``SHAPE`` (overridden by ``config``) into ``path``."""
    import transformers

    make_tiny_model(path, "llama", seed=seed)  # tokenizer files (and ids) only
    ids = json.loads((path / "generation_config.json").read_text())
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    config_cls, model_cls = (getattr(transformers, n) for n in HF_CLASSES[arch])
    cfg = config_cls(
        **{
            **SHAPE,
            "vocab_size": vocab,
            "bos_token_id": ids["bos_token_id"],
            "eos_token_id": ids["eos_token_id"],
            "pad_token_id": 0,
            **config,
        }
    )
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    with torch.no_grad():  # norm weights start at 0 (Gemma) or 1: make them random too
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path, safe_serialization=True)
    return path
