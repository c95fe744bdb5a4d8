"""Constants shared by the distributed tests (imported by name: no imports from conftest)."""

from __future__ import annotations

from nbengine.testing import TINY_LLAMA

TINY = {**TINY_LLAMA, "max_position_embeddings": 8192}
ENGINE_KW = dict(num_kv_blocks=512, block_size=16, max_num_seqs=32, max_num_batched_tokens=256)
