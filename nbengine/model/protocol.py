"""CausalLM: what the loader and the runner need of a model.

Every model class (``LlamaForCausalLM``, ``GemmaForCausalLM``, ``GPT2LMHeadModel``) is an
``nn.Module`` that also has this shape; the protocol states it for the type checker, so
the runner does not reach into ``nn.Module.__getattr__`` (typed ``Tensor | Module``).
"""

from __future__ import annotations

from typing import Protocol

import torch

from nbengine.model.weights import WeightMap
from nbengine.ops.attention import AttentionMetadata

__all__ = ["CausalLM"]


class CausalLM(Protocol):
    """A decoder-only language model over a paged KV cache."""

    num_layers: int
    num_kv_heads: int
    head_dim: int

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` (final norm applied) for the flattened batch."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits ``[N, vocab]`` for the selected hidden rows."""
        ...

    def tie_weights(self) -> None:
        """Share the embedding matrix with lm_head when the config ties them."""
        ...

    def hf_weight_map(self) -> WeightMap:
        """Where each parameter comes from in the checkpoint."""
        ...
