"""The bench's model and workloads: what every engine is given, identical from run to run.

- ``bench_model_dir``: random weights in SmolLM2-135M's shape (Llama), or in another
  real model's (``SHAPES``: ``nbengine bench --shape NAME``), bfloat16 safetensors
  written once to the cache directory and reused by every engine and every run.
- ``make_workloads``: seeded token-id workloads (scale shrinks counts and lengths; all
  greedy with ``ignore_eos``, so every engine produces exactly the requested tokens):

  - W1: 64 requests, prompt lengths uniform in 16..256, output lengths uniform in 16..128;
  - W2: one request decoding 256 tokens (a 32-token prompt);
  - W3: 64 requests sharing a 192-token prefix (+ 16 own tokens), 32 output tokens each;
  - P1024 (on request only, ``--workloads P1024``): one 1024-token prompt, one output
    token: time to first token of a long prompt (prefill).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "ALL_WORKLOADS",
    "DEFAULT_SHAPE",
    "KNOWN_WORKLOADS",
    "SHAPES",
    "SMOLLM2_135M",
    "Workload",
    "bench_model_dir",
    "make_workloads",
    "scaled",
]

ALL_WORKLOADS = ("W1", "W2", "W3")  # the default set
KNOWN_WORKLOADS = (*ALL_WORKLOADS, "P1024")  # what --workloads accepts

# SmolLM2-135M's shape (Llama architecture), random weights.
SMOLLM2_135M: dict[str, Any] = {
    "hidden_size": 576,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "intermediate_size": 1536,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
    "max_position_embeddings": 2048,
    "rope_theta": 100000.0,
    "rms_norm_eps": 1e-5,
}

# Llama 3.2's RoPE scaling (its config.json's rope_scaling).
_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

# Name -> (make_tiny_model arch, config.json fields): the dimensions of each real model
# (from its config.json on the Hub), with random weights. The tokenizer is the tiny
# test one; ids past it are placeholders (the workloads are token ids).
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "smollm2-135m": ("llama", SMOLLM2_135M),
    "llama-3.2-1b": (
        "llama",
        {
            "hidden_size": 2048,
            "num_hidden_layers": 16,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 64,
            "intermediate_size": 8192,
            "vocab_size": 128256,
            "tie_word_embeddings": True,
            "max_position_embeddings": 131072,
            "rope_theta": 500000.0,
            "rope_scaling": _LLAMA3_ROPE,
            "rms_norm_eps": 1e-5,
        },
    ),
    "qwen2.5-1.5b": (
        "qwen2",
        {
            "hidden_size": 1536,
            "num_hidden_layers": 28,
            "num_attention_heads": 12,
            "num_key_value_heads": 2,
            "intermediate_size": 8960,
            "vocab_size": 151936,
            "tie_word_embeddings": True,
            "max_position_embeddings": 32768,
            "rope_theta": 1000000.0,
            "rms_norm_eps": 1e-6,
        },
    ),
    "llama-3.2-3b": (
        "llama",
        {
            "hidden_size": 3072,
            "num_hidden_layers": 28,
            "num_attention_heads": 24,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "intermediate_size": 8192,
            "vocab_size": 128256,
            "tie_word_embeddings": True,
            "max_position_embeddings": 131072,
            "rope_theta": 500000.0,
            "rope_scaling": _LLAMA3_ROPE,
            "rms_norm_eps": 1e-5,
        },
    ),
}
DEFAULT_SHAPE = "smollm2-135m"


@dataclass(slots=True)
class Workload:
    """Prompts (token ids) and the number of output tokens each must produce."""

    name: str
    prompts: list[list[int]]
    output_lens: list[int]
    shared_prefix: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt tokens over all requests."""
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        """Output tokens over all requests."""
        return sum(self.output_lens)


def bench_model_dir(
    cache_dir: str | Path | None = None, shape: str = DEFAULT_SHAPE, **config: Any
) -> Path:
    """A random-initialised model in ``shape``'s dimensions (``SHAPES``; ``config``
    overrides fields), bfloat16 safetensors written once into the cache and reused."""
    from nbengine.testing import make_tiny_model

    if shape not in SHAPES:
        raise ValueError(f"shape must be one of {tuple(SHAPES)}, got {shape!r}.")
    arch, fields = SHAPES[shape]
    cfg = {**fields, **config}
    ident = {**cfg, "arch": arch, "weights_dtype": "bfloat16"}
    key = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:12]
    root = (
        Path(cache_dir)
        if cache_dir is not None
        else Path(os.environ.get("NBENGINE_CACHE", Path.home() / ".cache" / "nbengine")) / "bench"
    )
    path = root / f"{shape}-random-{key}"
    if not (path / ".complete").is_file():
        make_tiny_model(path, arch=arch, seed=0, weight_std=0.02, weights_dtype="bfloat16", **cfg)
        (path / ".complete").write_text("ok\n")
    return path


def scaled(n: int, scale: float, lo: int) -> int:
    """``n * scale`` rounded, at least ``lo``."""
    return max(lo, round(n * scale))


def make_workloads(
    names: Sequence[str], vocab: int, scale: float = 1.0, seed: int = 0
) -> dict[str, Workload]:
    """Deterministic workloads: the same ``(names, vocab, scale, seed)`` give the same token ids."""
    out: dict[str, Workload] = {}
    hi_id = vocab - 1
    for name in names:
        rng = random.Random(f"{seed}-{name}")

        def ids(n: int, rng: random.Random = rng) -> list[int]:
            return [rng.randint(3, hi_id) for _ in range(n)]

        if name == "W1":
            n = scaled(64, scale, 2)
            p_lo, p_hi = scaled(16, scale, 2), scaled(256, scale, 4)
            o_lo, o_hi = scaled(16, scale, 2), scaled(128, scale, 4)
            prompts = [ids(rng.randint(p_lo, p_hi)) for _ in range(n)]
            outs = [rng.randint(o_lo, o_hi) for _ in range(n)]
            out[name] = Workload(name, prompts, outs)
        elif name == "W2":
            out[name] = Workload(name, [ids(scaled(32, scale, 4))], [scaled(256, scale, 8)])
        elif name == "W3":
            n = scaled(64, scale, 2)
            prefix = ids(scaled(192, scale, 32))
            prompts = [prefix + ids(16) for _ in range(n)]
            out[name] = Workload(name, prompts, [scaled(32, scale, 4)] * n, len(prefix))
        elif name == "P1024":
            out[name] = Workload(name, [ids(scaled(1024, scale, 16))], [1])
        else:
            raise ValueError(f"Unknown workload {name!r}; choose from {KNOWN_WORKLOADS}.")
    return out
