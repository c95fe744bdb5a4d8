"""The tiny random model the engine-level suites share, and their engine sizes."""

from __future__ import annotations

from typing import Any

from nbengine.testing import TINY_LLAMA

# Long enough for every "runs until aborted" request in the suites: max_model_len ends
# a request before the test does otherwise.
TINY: dict[str, Any] = {**TINY_LLAMA, "max_position_embeddings": 8192}

# Engine sizes: a large KV cache and batch, so nothing preempts unless a test wants it.
ENGINE_KW: dict[str, Any] = dict(
    num_kv_blocks=1024, block_size=16, max_num_seqs=64, max_num_batched_tokens=512
)
