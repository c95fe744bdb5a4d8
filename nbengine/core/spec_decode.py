"""Speculative decoding's bookkeeping in the core: the n-gram proposer, which requests
may get drafts, and the per-position views the verifier samples with.

One step of a request with drafts ``d_1..d_k`` (docs/speculative-decoding.md): the
scheduler computes its last token and the k drafts in one chunk (1 + k positions, their
slots allocated like any others); the runner samples a token at each of the 1 + k
positions, each as a normal step would at that prefix (``prefix_view``), and keeps the
longest run where the sample equals the next draft, plus the sample after it
(ops/rejection.py). The scheduler then appends exactly those tokens, rolls
``num_computed_tokens`` back to the kept positions and frees the blocks beyond them.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Protocol

import torch

from nbengine.config import SpeculativeConfig
from nbengine.core.request import Request

__all__ = ["DraftBackoff", "DraftProposer", "NgramProposer", "may_speculate", "prefix_view"]

_WORD = "i"  # token ids as 4-byte words (every vocabulary is far below 2**31)
assert array(_WORD).itemsize == 4


def may_speculate(request: Request) -> bool:
    """Whether ``request`` may get drafts at all.

    Everything the sampler applies per position from the request's tokens alone
    (temperature, top-k/p, min-p, penalties, min_tokens, bad words, logit_bias,
    allowed tokens, logprobs) is applied exactly at every verified position. State that
    lives outside the token list cannot be replayed per position: structured outputs'
    grammar and custom logits processors; such a request gets no drafts and runs exactly
    as without speculation.
    """
    params = request.sampling_params
    return request.grammar is None and not params.logits_processors


def prefix_view(request: Request, drafts: Sequence[int]) -> Request:
    """The request as the sampler would see it one step later, had it generated
    ``drafts`` already: same parameters, same generator (its draws stay in order), its
    output extended by ``drafts``. Never held by the scheduler."""
    if not drafts:
        return request
    seed = request.sampling_params.seed
    if request.generator is None and seed is not None:
        # Created on the request itself, so every view draws from the one generator.
        request.generator = torch.Generator().manual_seed(seed)
    extra = list(drafts)
    return Request(
        request_id=request.request_id,
        prompt_token_ids=request.prompt_token_ids,
        sampling_params=request.sampling_params,
        eos_token_ids=request.eos_token_ids,
        arrival_time=request.arrival_time,
        priority=request.priority,
        status=request.status,
        output_token_ids=request.output_token_ids + extra,
        all_token_ids=request.all_token_ids + extra,
        num_computed_tokens=request.num_computed_tokens,
        generator=request.generator,
        cache_salt=request.cache_salt,
    )


class DraftProposer(Protocol):
    """What the scheduler asks of a speculative method (core thread only).

    ``draft`` proposes up to ``max_tokens`` tokens to follow ``token_ids`` (the request's
    prompt and output so far). ``forget`` drops whatever the proposer keeps for a request
    that left the core (finished, aborted); the scheduler calls it before the removal is
    reported, so an aborted request's draft state is gone when its abort is confirmed.
    """

    def draft(self, request_id: str, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        """Up to ``max_tokens`` drafts for ``request_id``."""
        ...

    def forget(self, request_id: str) -> None:
        """Drop ``request_id``'s state."""
        ...


class NgramProposer:
    """Prompt lookup (vLLM's "ngram" method).

    For n from ``prompt_lookup_max`` down to ``prompt_lookup_min``: find the latest
    earliest occurrence of the request's last n tokens (prompt and output together) and
    propose the up to ``num_speculative_tokens`` tokens that followed it. No match: no
    drafts (the request takes a normal one-token step in the same batch).
    """

    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.n_max = config.prompt_lookup_max
        self.n_min = config.prompt_lookup_min

    def propose(self, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        """Up to ``min(k, max_tokens)`` drafts to follow ``token_ids``."""
        k = min(self.k, max_tokens)
        length = len(token_ids)
        if k <= 0 or length <= self.n_min:
            return []
        # Byte search (C speed) over the ids as 4-byte words; a hit must be word-aligned.
        data = array(_WORD, token_ids).tobytes()
        limit = (length - 1) * 4  # matches end before the last token: never the suffix itself
        for n in range(min(self.n_max, length - 1), self.n_min - 1, -1):
            pattern = data[(length - n) * 4 :]
            at = data.find(pattern, 0, limit)
            while at >= 0 and at % 4:
                at = data.find(pattern, at + 1, limit)
            if at >= 0:
                start = at // 4 + n
                return list(token_ids[start : start + k])
        return []

    def draft(self, request_id: str, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        """``propose`` (a lookup keeps no per-request state)."""
        return self.propose(token_ids, max_tokens)

    def forget(self, request_id: str) -> None:
        """Nothing to drop."""


class DraftBackoff:
    """Fewer wasted verifications: after a step whose drafts were all rejected, the
    request proposes nothing for 1, then 2, 4, ... up to ``max_skip`` lookups; an
    accepted draft resets it. A verified step costs more than a plain decode (more rows
    through the model and the sampler), so a stream whose lookups keep failing (W2,
    docs/benchmarks.md) decodes nearly as without speculation. Outputs never depend on
    it: only which steps carry drafts does."""

    def __init__(self, max_skip: int = 16) -> None:
        self.max_skip = max_skip
        self._skip: dict[str, tuple[int, int]] = {}  # key -> (lookups left to skip, penalty)

    def allows(self, request_id: str) -> bool:
        """Whether ``request_id`` may look up drafts now (counts one skipped lookup)."""
        state = self._skip.get(request_id)
        if state is None or state[0] == 0:
            return True
        self._skip[request_id] = (state[0] - 1, state[1])
        return False

    def record(self, request_id: str, num_accepted: int) -> None:
        """The outcome of one verification of ``request_id``'s drafts."""
        if num_accepted:
            self._skip.pop(request_id, None)
            return
        penalty = self._skip.get(request_id, (0, 0))[1]
        penalty = min(self.max_skip, max(1, 2 * penalty))
        self._skip[request_id] = (penalty, penalty)

    def forget(self, request_id: str) -> None:
        """Drop the state of a request that left the core."""
        self._skip.pop(request_id, None)
