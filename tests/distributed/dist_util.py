"""Constants shared by the distributed tests (imported by name: no imports from conftest)."""

from __future__ import annotations

TINY = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=8192,
)
ENGINE_KW = dict(num_kv_blocks=512, block_size=16, max_num_seqs=32, max_num_batched_tokens=256)
