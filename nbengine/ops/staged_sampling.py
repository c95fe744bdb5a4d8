"""The sampler of the runner's device path: ops/sampling.py's semantics, no host syncs.

``StagedSampling.__init__`` runs on the host before the step's one input copy: it decides
what the batch needs (the same conditions as ``Sampler.__call__``), draws the random
numbers on the host (``Sampler.draw_uniforms``: a seeded request samples the same tokens
on every device), fills the structured-output bitmasks and stages all of it with the
step's other inputs (model/step_inputs.py). ``sample`` then runs on the device and
returns the tensors to copy back: the sampled ids and, where asked, the logprobs' pieces;
``unpack`` turns the host copy of those into tokens and ``PositionLogprobs``.

Differences from ``Sampler.__call__``, none visible in the tokens: top-k/top-p rows sort
the whole vocabulary at once (the host sampler widens its candidates step by step to
avoid a full sort on the CPU; both keep the same set), and the rows of requests with
penalties, ``logit_bias``, ``min_tokens``, ``allowed_token_ids``, ``bad_words`` or logits
processors are processed by the same functions as on the host, which create their small
index tensors from host lists (extra copies on such steps; docs/architecture.md "Devices").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from nbengine.ops.request_processors import apply_request_processors, needs_request_processing
from nbengine.ops.sampling import (
    Sampler,
    _draw_from,
    _finite,
    _needs_processing,
    apply_penalties_and_bias,
    build_position_logprobs,
)
from nbengine.outputs import PositionLogprobs
from nbengine.structured_outputs import apply_bitmask, bitmask_words

if TYPE_CHECKING:
    # ops reads what the core's Request holds; it never imports the core at run time
    from nbengine.core.request import Request


class _Stager(Protocol):
    """What ``StagedSampling`` needs of a stager (model/step_inputs.py's ``StepStager``)."""

    def ints(self, values: Sequence[int]) -> int: ...

    def floats(self, values: Sequence[float]) -> int: ...

    def tensor(self, value: torch.Tensor) -> int: ...


class _Views(Protocol):
    def __getitem__(self, handle: int) -> torch.Tensor: ...


class StagedSampling:
    """One step's sampling on the device path; see the module docstring."""

    def __init__(
        self, sampler: Sampler, requests: Sequence[Request], vocab: int, stage: _Stager
    ) -> None:
        self.requests = requests
        self.mode = sampler.logprobs_mode
        params = [r.sampling_params for r in requests]
        self.n = len(requests)
        self.want_lp = [i for i, p in enumerate(params) if p.logprobs is not None]
        self.lp_ks = [vocab if (p.logprobs or 0) < 0 else (p.logprobs or 0) for p in params]
        self.lp_ks = [self.lp_ks[i] for i in self.want_lp]
        self.h_lp_rows = stage.ints(self.want_lp) if self.want_lp else -1
        constrained = [i for i, r in enumerate(requests) if r.grammar is not None]
        self.processors = any(needs_request_processing(r) for r in requests)
        self.fast = (
            not constrained
            and all(p.greedy for p in params)
            and not any(_needs_processing(r) for r in requests)
        )
        self.h_bitmask = self.h_constrained = -1
        if constrained:
            bitmask = torch.empty(len(constrained), bitmask_words(vocab), dtype=torch.int32)
            for j, i in enumerate(constrained):
                grammar = requests[i].grammar
                assert grammar is not None
                grammar.fill_bitmask(bitmask[j])
            self.h_constrained = stage.ints(constrained)
            self.h_bitmask = stage.tensor(bitmask)
        rand = [] if self.fast else [i for i, p in enumerate(params) if not p.greedy]
        self.rand = rand
        self.any_min_p = any(params[i].min_p > 0 for i in rand)
        ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        plain = [ks[i] == vocab and params[i].top_p >= 1.0 for i in rand]
        self.any_filtered = not all(plain)
        if rand:
            self.h_rand = stage.ints(rand)
            self.h_uniforms = stage.floats(sampler.draw_uniforms(requests, rand).tolist())
            self.h_temps = stage.floats([params[i].temperature for i in rand])
            self.h_min_p = stage.floats([params[i].min_p for i in rand])
            self.h_top_p = stage.floats([params[i].top_p for i in rand])
            self.h_top_k = stage.ints([ks[i] for i in rand])
            self.h_plain = stage.ints([int(x) for x in plain])
        if self.want_lp and self.mode.startswith("processed"):
            self.h_lp_temps = stage.floats(
                [params[i].temperature if not params[i].greedy else 1.0 for i in self.want_lp]
            )

    def sample(self, logits: torch.Tensor, views: _Views) -> list[torch.Tensor]:
        """On the device: ``[tokens [N]]`` plus, with logprobs, ``[chosen, ranks, top
        values, top ids]`` of the rows that asked (see ``unpack``)."""
        lp_rows = views[self.h_lp_rows] if self.want_lp else None
        raw = None
        if lp_rows is not None and self.mode == "raw_logprobs":
            raw = logits.log_softmax(dim=-1)[lp_rows]
        elif lp_rows is not None and self.mode == "raw_logits":
            raw = logits[lp_rows]  # advanced indexing copies: later edits of x do not reach it
        x = logits
        if self.fast:
            tokens = logits.argmax(dim=-1)
        else:
            x = logits.clone()
            if self.h_bitmask >= 0:
                apply_bitmask(x, views[self.h_constrained], views[self.h_bitmask])
            if self.processors:
                apply_request_processors(x, self.requests)
            x = _finite(apply_penalties_and_bias(x, self.requests))
            tokens = x.argmax(dim=-1)
            if self.rand:
                rows = views[self.h_rand]
                picked = self._sample_rows(x[rows], views)
                tokens.index_copy_(0, rows, picked)
        if lp_rows is None:
            return [tokens]
        if raw is None:  # processed_*: after the request's logits processing
            processed = x[lp_rows] / views[self.h_lp_temps].to(x.dtype)[:, None]
            raw = processed.log_softmax(dim=-1) if self.mode == "processed_logprobs" else processed
        return [tokens, *logprob_pieces(raw, tokens[lp_rows], max(self.lp_ks))]

    def _sample_rows(self, x: torch.Tensor, views: _Views) -> torch.Tensor:
        """Temperature, min_p, top_k, top_p and an inverse-CDF draw per row (as
        ops/sampling.py's ``_sample_rows``; the whole vocabulary sorted at once)."""
        dtype = x.dtype
        uniforms = views[self.h_uniforms].to(dtype)
        x = _finite(x / views[self.h_temps].to(dtype)[:, None])
        if self.any_min_p:
            probs = x.softmax(dim=-1)
            min_p = views[self.h_min_p].to(dtype)[:, None]
            x = x.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, float("-inf"))
        out = _draw_from(x, uniforms)  # plain rows: the vocabulary in id order
        if not self.any_filtered:
            return out
        vocab = x.shape[1]
        ks = views[self.h_top_k]
        vals, ids = x.sort(dim=-1, descending=True)
        col = torch.arange(vocab, device=x.device)[None, :]
        vals = vals.masked_fill(col >= ks[:, None], float("-inf"))
        has_k = (ks < vocab)[:, None]
        lse = torch.where(has_k, vals.logsumexp(-1, keepdim=True), x.logsumexp(-1, keepdim=True))
        probs = (vals - lse).exp()
        mass_before = probs.cumsum(dim=-1) - probs  # mass of strictly more likely tokens
        top_p = views[self.h_top_p].to(dtype)[:, None]
        # The most likely token always stays, however small top_p is after rounding.
        vals = vals.masked_fill((mass_before >= top_p) & (col > 0), float("-inf"))
        filtered = ids.gather(1, _draw_from(vals, uniforms)[:, None]).squeeze(1)
        return torch.where(views[self.h_plain].bool(), out, filtered)

    def unpack(
        self, host: Sequence[float], start: int
    ) -> tuple[list[int], list[PositionLogprobs | None], int]:
        """Tokens and logprobs from the host copy ``host`` of ``sample``'s tensors (flat,
        from ``start``); also returns where the next packed piece starts."""
        n = self.n
        tokens = [int(t) for t in host[start : start + n]]
        at = start + n
        lps: list[PositionLogprobs | None] = [None] * n
        if self.want_lp:
            chosen_tokens = [tokens[i] for i in self.want_lp]
            entries, at = unpack_logprobs(host, at, chosen_tokens, self.lp_ks)
            for i, d in zip(self.want_lp, entries):
                lps[i] = d
        return tokens, lps, at


def logprob_pieces(
    logprobs: torch.Tensor, token_ids: torch.Tensor, k_max: int
) -> list[torch.Tensor]:
    """On the device: the chosen tokens' values and ranks and the rows' top-``k_max``
    (``topk_logprobs``'s computation, with nothing copied back)."""
    chosen = logprobs.gather(1, token_ids[:, None])
    ranks = (logprobs > chosen).sum(dim=1) + 1
    pieces = [chosen.squeeze(1), ranks]
    if k_max > 0:
        vals, ids = logprobs.topk(k_max, dim=1)
        pieces += [vals.flatten(), ids.flatten()]
    return pieces


def unpack_logprobs(
    host: Sequence[float], at: int, token_ids: Sequence[int], ks: Sequence[int]
) -> tuple[list[PositionLogprobs], int]:
    """``logprob_pieces`` read back from the flat host list ``host`` at ``at``."""
    m = len(token_ids)
    k_max = max(ks, default=0)
    chosen = host[at : at + m]
    ranks = host[at + m : at + 2 * m]
    at += 2 * m
    top_vals: list[Sequence[float]] = [[]] * m
    top_ids: list[Sequence[float]] = [[]] * m
    if k_max > 0:
        flat_vals = host[at : at + m * k_max]
        flat_ids = host[at + m * k_max : at + 2 * m * k_max]
        top_vals = [flat_vals[i * k_max : (i + 1) * k_max] for i in range(m)]
        top_ids = [flat_ids[i * k_max : (i + 1) * k_max] for i in range(m)]
        at += 2 * m * k_max
    return build_position_logprobs(token_ids, chosen, ranks, top_vals, top_ids, ks), at
