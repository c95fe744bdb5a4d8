"""The draft-model proposer of speculative decoding (``method: "draft_model"``).

A small model of the target's vocabulary proposes ``num_speculative_tokens`` greedy
tokens per request per step; the target verifies them as it verifies n-gram drafts
(docs/speculative-decoding.md). Greedy drafts are a deterministic proposal (a one-hot
q), for which the verifier's rule (keep a draft while the target's sample at its
position equals it) is exact rejection sampling for sampled requests too.

The draft's KV cache is its own: per request, a small paged cache (block table
``0..n-1`` of the request's own tensors) with the token ids whose K/V it holds. Each
call keeps only the longest prefix those ids share with the request's tokens now and
recomputes from there, so the target's rollback (rejected drafts), a preemption or any
other change of the token list can never leave stale draft K/V in use. ``forget`` drops
a request's cache (the scheduler calls it when the request leaves the core, before its
removal is reported, and on preemption). Runs on the core thread only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from nbengine.config import EngineConfig, ModelConfig
from nbengine.model.loader import LoadedModel, load_model
from nbengine.model.protocol import CausalLM, PlannedDecode
from nbengine.ops.attention import ChunkSpec, build_attention_metadata
from nbengine.ops.linear import pack_linears

__all__ = ["DraftModelProposer", "check_draft_vocabulary"]

_BLOCK = 16  # tokens per block of a draft cache


@dataclass(slots=True)
class _DraftCache:
    """One request's draft K/V: ``ids[i]``'s K/V is at position i, for every i."""

    kv: list[tuple[torch.Tensor, torch.Tensor]]
    ids: list[int] = field(default_factory=list)

    @property
    def capacity(self) -> int:
        return int(self.kv[0][0].shape[0]) * _BLOCK if self.kv else 0


def check_draft_vocabulary(target: LoadedModel, draft: LoadedModel) -> None:
    """Raise ValueError naming ``speculative_config['model']`` unless ``draft`` speaks the
    target's vocabulary: the same logits width and the same token for every id."""
    where = f"speculative_config['model'] ({str(draft.path)!r})"
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"{where} has a vocabulary of {draft.vocab_size} tokens; the target model's "
            f"has {target.vocab_size}. The draft model must share the target's tokenizer."
        )
    if draft.tokenizer.backend.get_vocab(True) != target.tokenizer.backend.get_vocab(True):
        raise ValueError(
            f"{where} has a different tokenizer (its token strings differ from the target "
            "model's). The draft model must share the target's tokenizer."
        )


class DraftModelProposer:
    """Greedy drafts from a small model (``DraftProposer`` of core/spec_decode.py)."""

    def __init__(self, loaded: LoadedModel, k: int, device: str) -> None:
        self.loaded = loaded
        self.model: CausalLM = loaded.model
        self.planned: PlannedDecode | None = None
        if isinstance(self.model, PlannedDecode):
            self.model.configure_decode_plans(enabled=device == "cpu", max_rows=None)
            self.planned = self.model
        self.k = k
        self.device = device
        self.dtype = loaded.dtype
        self._caches: dict[str, _DraftCache] = {}

    @classmethod
    def load(cls, config: EngineConfig, target: LoadedModel) -> DraftModelProposer:
        """Load ``config.speculative.model`` with the target's loader settings (dtype of
        the target unless the config names one) and check its vocabulary."""
        spec = config.speculative
        assert spec.method == "draft_model" and spec.model is not None
        dtype = spec.dtype or str(target.dtype).removeprefix("torch.")
        mc = config.model
        draft_config = ModelConfig(
            model=spec.model,
            dtype=dtype,
            max_model_len=target.max_model_len,
            seed=0,
            device=mc.device,
        )
        loaded = load_model(draft_config)
        check_draft_vocabulary(target, loaded)
        if loaded.dtype == torch.bfloat16 and mc.device == "cpu" and mc.quantization is None:
            pack_linears(loaded.model, 1, False)
        return cls(loaded, spec.num_speculative_tokens, mc.device)

    # ---- DraftProposer ------------------------------------------------------------------
    def draft(self, request_id: str, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        """Up to ``min(k, max_tokens)`` greedy tokens of the draft model after
        ``token_ids`` (none where they would pass its max_model_len)."""
        n = min(self.k, max_tokens, self.loaded.max_model_len - len(token_ids))
        if n <= 0 or not token_ids:
            return []
        cache = self._cache_for(request_id, len(token_ids) + n)
        # Reuse the K/V of the prefix the cache shares with the tokens now; recompute at
        # least the last token (its logits give the first draft).
        keep = _common_prefix(cache.ids, token_ids, len(token_ids) - 1)
        del cache.ids[keep:]
        with torch.inference_mode():
            tok = self._forward(cache, list(token_ids[keep:]))
            drafts = [tok]
            while len(drafts) < n:
                tok = self._forward(cache, [tok])
                drafts.append(tok)
        return drafts

    def forget(self, request_id: str) -> None:
        """Drop ``request_id``'s draft cache."""
        self._caches.pop(request_id, None)

    @property
    def num_cached_requests(self) -> int:
        """Requests holding a draft cache now."""
        return len(self._caches)

    # ---- internals ----------------------------------------------------------------------
    def _cache_for(self, request_id: str, num_positions: int) -> _DraftCache:
        """``request_id``'s cache, grown (doubling, K/V copied) to hold ``num_positions``."""
        cache = self._caches.get(request_id)
        if cache is not None and cache.capacity >= num_positions:
            return cache
        blocks = -(-num_positions // _BLOCK)
        if cache is not None:
            blocks = max(blocks, 2 * cache.capacity // _BLOCK)
        m = self.model
        shape = (blocks, _BLOCK, m.num_kv_heads, m.head_dim)
        kv = [
            (
                torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device),
            )
            for _ in range(m.num_layers)
        ]
        if cache is None:
            cache = _DraftCache(kv)
            self._caches[request_id] = cache
        else:
            used = cache.capacity // _BLOCK
            for (k_new, v_new), (k_old, v_old) in zip(kv, cache.kv):
                k_new[:used].copy_(k_old)
                v_new[:used].copy_(v_old)
            cache.kv = kv
        return cache

    def _forward(self, cache: _DraftCache, new_ids: list[int]) -> int:
        """Run ``new_ids`` after ``cache.ids`` (writing their K/V); the greedy next token."""
        start = len(cache.ids)
        table = range(cache.capacity // _BLOCK)
        meta = build_attention_metadata(
            [ChunkSpec(start, len(new_ids), table)], _BLOCK, device=self.device
        )
        ids = torch.tensor(new_ids, dtype=torch.int64, device=self.device)
        pos = torch.arange(start, start + len(new_ids), dtype=torch.int64, device=self.device)
        cache.ids.extend(new_ids)
        if len(new_ids) == 1 and self.planned is not None:
            tokens = self.planned.decode_greedy(ids, pos, meta, cache.kv)
            if tokens is not None:
                return int(tokens[0])
        hidden = self.model(ids, pos, meta, cache.kv)
        logits = self.model.compute_logits(hidden[-1:])
        return int(torch.argmax(logits[0]).item())


def _common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    """Length of the longest common prefix of ``a`` and ``b``, at most ``limit``."""
    n = min(len(a), len(b), limit)
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
