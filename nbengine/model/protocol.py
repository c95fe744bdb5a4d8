"""CausalLM: what the loader and the runner need of a model; PlannedDecode: what a model
may add to run a decode-only step in one call.

Every model class (``LlamaForCausalLM``, ``GemmaForCausalLM``, ``GPT2LMHeadModel``) is an
``nn.Module`` that also has the ``CausalLM`` shape; the protocol states it for the type
checker, so the runner does not reach into ``nn.Module.__getattr__`` (typed
``Tensor | Module``). A model that also implements ``PlannedDecode`` (the Llama family)
declares it as a base class; the runner checks for it once, when it is built, and picks
its execution path from the answer (model/runner.py).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from nbengine.model.weights import WeightMap
from nbengine.ops.attention import AttentionMetadata

__all__ = ["CausalLM", "PlannedDecode"]


class CausalLM(Protocol):
    """A decoder-only language model over a paged KV cache."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    # Per layer, the sliding attention window (None: full attention). A model without
    # windows lists None for every layer.
    layer_windows: tuple[int | None, ...]

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


@runtime_checkable
class PlannedDecode(Protocol):
    """Optional: a model that runs a decode-only step (every row one token that samples)
    through one native call of its decode plan (model/decode_plan.py).

    Either entry point may decline a step (returns None); the runner then runs the step
    through ``CausalLM.__call__`` and ``compute_logits``, as it does for every step of a
    model without this capability.
    """

    def decode_logits(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor | None:
        """float32 logits ``[T, vocab]`` of every row, or None where the plan cannot."""
        ...

    def decode_greedy(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> list[int] | None:
        """Each row's argmax token, or None where the plan cannot."""
        ...

    def configure_decode_plans(self, *, enabled: bool, max_rows: int | None) -> None:
        """Set, once at the runner's construction, whether decode plans may run at all
        (the device path runs torch ops only) and the most rows of a step they may take
        (None: no limit; larger steps take the module path). Defaults: enabled, no limit."""
        ...

    def pause_decode_plans(self, paused: bool) -> None:
        """While paused, every step takes the module path (a step with LoRA adapter rows:
        the plan's native call cannot add their deltas; docs/lora.md)."""
        ...
