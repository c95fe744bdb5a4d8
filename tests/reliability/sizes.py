"""The reliability suites' model and engine sizes: a short context and a small KV cache,
so max_model_len, preemption and KV exhaustion are reached quickly."""

from __future__ import annotations

from typing import Any

from nbengine.testing import TINY_LLAMA

TINY: dict[str, Any] = {**TINY_LLAMA, "max_position_embeddings": 1024}
ENGINE_KW: dict[str, Any] = dict(
    num_kv_blocks=256, block_size=8, max_num_seqs=32, max_num_batched_tokens=256
)
