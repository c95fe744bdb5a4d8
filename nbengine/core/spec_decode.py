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

import statistics
from array import array
from bisect import bisect_left, insort
from collections import deque
from collections.abc import Sequence
from typing import Protocol

import torch

from nbengine.config import SpeculativeConfig
from nbengine.core.request import Request

__all__ = ["DraftPolicy", "DraftProposer", "NgramProposer", "may_speculate", "prefix_view"]

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


class DraftPolicy:
    """Cost-aware draft lengths: per request and step, the k (0 = a plain decode) that
    maximizes the step's expected tokens per second.

    Two estimates, both the engine's own (docs/speculative-decoding.md, "When it drafts"):

    - **what a verification keeps**: per request, the chance ``a`` that a draft is
      accepted, from its recent verifications (counts that decay by ``decay`` each time,
      prior 1 accepted and 1 rejected: ``a`` starts at 0.5). With drafts accepted
      independently at ``a``, k drafts keep ``1 + a + ... + a**k`` tokens on average;
    - **what a step costs**: the median seconds of the last ``window`` decode-only steps
      (no prefill in them) per number of rows, drafts included (``observe_step``).
      Between measured row counts the cost is interpolated; below the smallest one it is
      taken as proportional to the rows; above the largest, extrapolated with the last
      slope (free while only one count is measured, so the first steps try drafting).

    For a request in a step that already holds ``rows`` rows expected to make ``tokens``
    tokens, k drafts give ``(tokens - 1 + E(k)) / t(rows + k)`` tokens per second; the
    best k is chosen. When that is 0, every ``probe_every``-th step still verifies one
    draft (if the lookup finds one), so a stream whose text starts repeating is noticed.
    Outputs never depend on it: only which steps carry drafts (and how many) does.
    """

    def __init__(
        self, k_max: int, window: int = 15, decay: float = 0.8, probe_every: int = 16
    ) -> None:
        self.k_max = k_max
        self.window = window
        self.decay = decay
        self.probe_every = probe_every
        self._times: dict[int, deque[float]] = {}  # rows -> recent decode-only step seconds
        self._cost: dict[int, float] = {}  # rows -> their median (kept with ``_times``)
        self._rows: list[int] = []  # measured row counts, ascending
        self._counts: dict[str, list[float]] = {}  # key -> [accepted, rejected] (decayed)
        self._plain: dict[str, int] = {}  # key -> plain steps since its last probe

    def acceptance(self, request_id: str) -> float:
        """The estimated chance that one of ``request_id``'s drafts is accepted."""
        acc, rej = self._counts.get(request_id, (0.0, 0.0))
        return (acc + 1.0) / (acc + rej + 2.0)

    def expected_tokens(self, request_id: str, k: int) -> float:
        """Tokens a verification of k drafts keeps on average (1 at k = 0)."""
        a = self.acceptance(request_id)
        return sum(a**j for j in range(k + 1))

    def step_cost(self, rows: int) -> float:
        """Estimated seconds of a decode-only step of ``rows`` rows (0.0: none measured)."""
        known = self._rows
        if not known:
            return 0.0
        cost = self._cost
        at = bisect_left(known, rows)
        if at < len(known) and known[at] == rows:
            return cost[rows]
        if at == 0:  # below every measured count: proportional to the rows
            return cost[known[0]] * rows / known[0]
        if at == len(known):  # above: the last slope (free while one count is known)
            if len(known) == 1:
                return cost[known[0]]
            lo, hi = known[-2], known[-1]
            slope = max(0.0, (cost[hi] - cost[lo]) / (hi - lo))
            return cost[hi] + slope * (rows - hi)
        lo, hi = known[at - 1], known[at]
        return cost[lo] + (cost[hi] - cost[lo]) * (rows - lo) / (hi - lo)

    def choose(self, request_id: str, rows: int, tokens: float, k_cap: int) -> int:
        """The number of drafts (at most ``k_cap``; 0: a plain decode) for ``request_id``
        in a step that holds ``rows`` rows so far (its own decoded row included), expected
        to make ``tokens`` tokens (its own decoded token included)."""
        k_cap = min(k_cap, self.k_max)
        if k_cap <= 0:
            return 0
        best_k = 0
        t0 = self.step_cost(rows)
        if t0 <= 0.0:
            best_k = k_cap  # nothing measured yet: try
        else:
            best_rate = tokens / t0
            a = self.acceptance(request_id)
            kept = 1.0
            for k in range(1, k_cap + 1):
                kept += a**k
                rate = (tokens - 1.0 + kept) / max(self.step_cost(rows + k), 1e-12)
                if rate > best_rate:
                    best_k, best_rate = k, rate
        if best_k:
            self._plain.pop(request_id, None)
            return best_k
        plain = self._plain.get(request_id, 0) + 1
        if plain >= self.probe_every:
            self._plain.pop(request_id, None)
            return 1  # a probe: one draft, the cheapest verification
        self._plain[request_id] = plain
        return 0

    def record(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """The outcome of one verification of ``request_id``'s ``num_drafts`` drafts."""
        counts = self._counts.setdefault(request_id, [0.0, 0.0])
        d = self.decay
        counts[0] = counts[0] * d + num_accepted
        counts[1] = counts[1] * d + (1.0 if num_accepted < num_drafts else 0.0)

    def observe_step(self, rows: int, seconds: float) -> None:
        """One decode-only step of ``rows`` rows (drafts included) took ``seconds``."""
        times = self._times.get(rows)
        if times is None:
            times = self._times[rows] = deque(maxlen=self.window)
            insort(self._rows, rows)
        times.append(seconds)
        self._cost[rows] = statistics.median(times)

    def forget(self, request_id: str) -> None:
        """Drop the state of a request that left the core."""
        self._counts.pop(request_id, None)
        self._plain.pop(request_id, None)
