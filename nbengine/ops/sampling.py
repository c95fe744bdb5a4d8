"""Token sampling with vLLM's SamplingParams semantics.

Order of operations (as vLLM's v1 sampler):

1. raw logprobs = log_softmax(model logits), kept for ``logprobs`` (vLLM's "raw_logprobs");
2. logits processors: ``min_tokens`` (mask EOS, unless ``ignore_eos``, and
   ``stop_token_ids`` while too few tokens were generated), ``logit_bias``;
3. penalties: repetition (prompt + output tokens; positive logits divided, negative
   multiplied), frequency (``-= f * count`` over output tokens), presence
   (``-= p`` for every token present in the output);
4. greedy rows (``temperature == 0`` or ``top_k == 1``) take the argmax;
5. other rows: divide by temperature, ``min_p`` (drop tokens whose probability is below
   ``min_p * max_prob``), ``top_k``, ``top_p`` (keep the smallest most-likely set whose
   mass reaches ``top_p``), then sample by inverse CDF with one uniform draw per row.

Randomness: a request with ``params.seed`` draws only from its own ``torch.Generator``
(``Request.generator``, created lazily from the seed), one uniform per step, so its
random numbers do not depend on what else is in the batch. Its tokens still can: the
logits themselves differ in their last bits with the batch's size and mix (matrix
products block their sums by shape), which flips a draw that lands near a boundary of
the CDF. docs/api.md ("seed") gives the measured rates.
Unseeded rows draw from the sampler's generator, seeded from ``ModelConfig.seed``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from nbengine.ops import native
from nbengine.ops.request_processors import apply_request_processors, needs_request_processing
from nbengine.outputs import Logprob, PositionLogprobs
from nbengine.sampling_params import SamplingParams
from nbengine.structured_outputs import apply_bitmask, bitmask_words

if TYPE_CHECKING:
    # ops reads what the core's Request holds; it never imports the core at run time
    from nbengine.core.request import Request


def _needs_processing(req: Request) -> bool:
    p = req.sampling_params
    return bool(
        p.logit_bias
        or p.presence_penalty
        or p.frequency_penalty
        or p.repetition_penalty != 1.0
        or (p.min_tokens and req.num_output_tokens < p.min_tokens)
        or needs_request_processing(req)
    )


def topk_logprobs(
    logprobs: torch.Tensor, token_ids: Sequence[int], ks: Sequence[int]
) -> list[PositionLogprobs]:
    """For each row: the chosen token's logprob and rank, then the row's top-``k`` entries.

    ``logprobs [M, V]`` are normalised log-probabilities; rank 1 is the most likely token.
    """
    m = logprobs.shape[0]
    if m == 0:
        return []
    ks = [logprobs.shape[1] if k < 0 else k for k in ks]  # -1: the whole vocabulary
    tok = torch.tensor(list(token_ids), dtype=torch.int64).unsqueeze(1)
    chosen = logprobs.gather(1, tok)  # [M, 1]
    ranks = (logprobs > chosen).sum(dim=1) + 1
    k_max = max(ks)
    top_vals, top_ids = logprobs.topk(k_max, dim=1) if k_max > 0 else (None, None)
    chosen_l, ranks_l = chosen.squeeze(1).tolist(), ranks.tolist()
    top_vals_l = top_vals.tolist() if top_vals is not None else [[]] * m
    top_ids_l = top_ids.tolist() if top_ids is not None else [[]] * m
    return build_position_logprobs(token_ids, chosen_l, ranks_l, top_vals_l, top_ids_l, ks)


def build_position_logprobs(
    token_ids: Sequence[int],
    chosen: Sequence[float],
    ranks: Sequence[int | float],
    top_vals: Sequence[Sequence[float]],
    top_ids: Sequence[Sequence[int | float]],
    ks: Sequence[int],
) -> list[PositionLogprobs]:
    """Per row: ``{chosen token: (logprob, rank)}`` then the row's top-``k`` entries (host
    lists, as ``topk_logprobs`` computes them; ``ks`` already resolved from -1)."""
    out: list[PositionLogprobs] = []
    for i in range(len(token_ids)):
        d: PositionLogprobs = {int(token_ids[i]): Logprob(chosen[i], int(ranks[i]))}
        for r in range(ks[i]):
            t = int(top_ids[i][r])
            if t not in d:
                d[t] = Logprob(top_vals[i][r], r + 1)
        out.append(d)
    return out


def apply_penalties_and_bias(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    """Steps 2-3 of the module docstring, in place on ``logits [N, V]`` (float32)."""
    vocab, dev = logits.shape[1], logits.device
    pen_rows: list[int] = []
    for i, req in enumerate(requests):
        p = req.sampling_params
        if p.min_tokens and req.num_output_tokens < p.min_tokens:
            stop_ids = set(p.stop_token_ids or ())
            if not p.ignore_eos:
                stop_ids |= req.eos_token_ids
            ids = [t for t in stop_ids if t < vocab]
            if ids:
                logits[i, ids] = float("-inf")
        if p.logit_bias:
            items = [(t, b) for t, b in p.logit_bias.items() if t < vocab]
            if items:
                idx = torch.tensor([t for t, _ in items], dtype=torch.int64, device=dev)
                logits[i].index_add_(
                    0, idx, torch.tensor([b for _, b in items], dtype=logits.dtype, device=dev)
                )
        if p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0:
            pen_rows.append(i)
    if not pen_rows:
        return logits
    n = len(pen_rows)
    out_counts = torch.zeros(n, vocab, dtype=logits.dtype, device=dev)
    seen = torch.zeros(n, vocab, dtype=torch.bool, device=dev)
    for j, i in enumerate(pen_rows):
        req = requests[i]
        if req.output_token_ids:
            out_ids = torch.tensor(req.output_token_ids, dtype=torch.int64, device=dev)
            out_ids.clamp_(max=vocab - 1)
            ones = torch.ones(len(out_ids), dtype=logits.dtype, device=dev)
            out_counts[j].index_add_(0, out_ids, ones)
        if req.sampling_params.repetition_penalty != 1.0:
            all_ids = torch.tensor(req.all_token_ids, dtype=torch.int64, device=dev)
            seen[j, all_ids[all_ids < vocab]] = True
    rows = torch.tensor(pen_rows, dtype=torch.int64, device=dev)
    sub = logits[rows]
    params = [requests[i].sampling_params for i in pen_rows]
    rep = torch.tensor([p.repetition_penalty for p in params], dtype=logits.dtype, device=dev)[
        :, None
    ]
    freq = torch.tensor([p.frequency_penalty for p in params], dtype=logits.dtype, device=dev)[
        :, None
    ]
    pres = torch.tensor([p.presence_penalty for p in params], dtype=logits.dtype, device=dev)[
        :, None
    ]
    penalised = torch.where(sub > 0, sub / rep, sub * rep)
    sub = torch.where(seen, penalised, sub)
    sub = sub - freq * out_counts - pres * (out_counts > 0).to(logits.dtype)
    logits[rows] = sub
    return logits


_CANDIDATE_TIERS = (256, 2048)


def _finite(logits: torch.Tensor) -> torch.Tensor:
    """Keep extreme but valid parameters meaningful in float32, in place.

    A large logit_bias or a small repetition_penalty can push a logit past the float32
    range; softmax of +inf is NaN, and inverse-CDF sampling over NaNs would return the
    last vocabulary id. An overflowed logit becomes the largest finite value (the token
    stays the most likely); NaN becomes -inf (never chosen).
    """
    return torch.nan_to_num_(logits, nan=float("-inf"), posinf=torch.finfo(logits.dtype).max)


def _scale_and_min_p(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature, then min_p, on ``logits [M, V]``."""
    temp = torch.tensor([p.temperature for p in params], dtype=logits.dtype)[:, None]
    logits = _finite(logits / temp)
    if any(p.min_p > 0 for p in params):
        probs = logits.softmax(dim=-1)
        min_p = torch.tensor([p.min_p for p in params], dtype=logits.dtype)[:, None]
        too_small = probs < min_p * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(too_small, float("-inf"))
    return logits


def _draw_from(logits: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: column index per row of ``logits [M, C]``, one uniform per row."""
    cdf = logits.softmax(dim=-1).cumsum(dim=-1)
    target = uniforms[:, None] * cdf[:, -1:]
    # First index whose cdf exceeds the target; zero-probability tokens are never chosen.
    return torch.searchsorted(cdf, target, right=True).clamp_(max=logits.shape[1] - 1).squeeze(1)


def _sample_rows(
    logits: torch.Tensor, params: Sequence[SamplingParams], uniforms: torch.Tensor
) -> list[int]:
    """Sample one token per row after temperature, min_p, top_k and top_p.

    top_k/top_p need the most likely tokens in order. A full sort of a large vocab is
    slow on CPU, so candidates come from ``topk(C)`` for growing C: a row is settled
    at C when its top-k set fits in C, or (no top-k) when the C candidates already
    hold ``top_p`` of the full mass, which makes the result identical to a full sort.
    """
    vocab = logits.shape[1]
    x = _scale_and_min_p(logits, params)
    ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    tops = [p.top_p for p in params]
    out = [0] * len(params)
    plain = [i for i in range(len(params)) if ks[i] == vocab and tops[i] >= 1.0]
    if plain:
        idx = torch.tensor(plain, dtype=torch.int64)
        for i, t in zip(plain, _draw_from(x[idx], uniforms[idx]).tolist()):
            out[i] = t
    pending = [i for i in range(len(params)) if i not in set(plain)]
    # Full-vocab normaliser, needed for rows without top-k (their top-p mass is global).
    full_lse = x.logsumexp(-1, keepdim=True) if pending else x[:, :1]
    for width in (*[c for c in _CANDIDATE_TIERS if c < vocab], vocab):
        if not pending:
            break
        idx = torch.tensor(pending, dtype=torch.int64)
        rows = x[idx]
        if width < vocab:
            vals, ids = rows.topk(width, dim=-1)
        else:
            vals, ids = rows.sort(dim=-1, descending=True)
        k = torch.tensor([min(ks[i], width) for i in pending])[:, None]
        vals = vals.masked_fill(torch.arange(width)[None, :] >= k, float("-inf"))
        has_k = torch.tensor([ks[i] < vocab for i in pending])[:, None]
        # Probabilities of the candidates within the top-k set (when set) or the full vocab.
        lse = torch.where(has_k, vals.logsumexp(-1, keepdim=True), full_lse[idx])
        probs = (vals - lse).exp()
        top_p = torch.tensor([tops[i] for i in pending], dtype=vals.dtype)[:, None]
        mass_before = probs.cumsum(dim=-1) - probs  # mass of strictly more likely tokens
        # The most likely token always stays, however small top_p is after rounding.
        beyond = (mass_before >= top_p) & (torch.arange(width)[None, :] > 0)
        vals = vals.masked_fill(beyond, float("-inf"))
        mass = probs.sum(-1).tolist()
        settled = [
            j
            for j, i in enumerate(pending)
            if ks[i] <= width or (ks[i] == vocab and tops[i] < 1.0 and mass[j] >= tops[i])
        ]
        if not settled:
            continue
        sj = torch.tensor(settled, dtype=torch.int64)
        cols = _draw_from(vals[sj], uniforms[idx[sj]])
        toks = ids[sj].gather(1, cols[:, None]).squeeze(1).tolist()
        for j, t in zip(settled, toks):
            out[pending[j]] = t
        pending = [i for j, i in enumerate(pending) if j not in set(settled)]
    return out


def _argmax_rows(logits: torch.Tensor) -> list[int]:
    """``logits.argmax(dim=-1).tolist()``; natively for float32 rows when the kernels are
    loaded (torch would wake a second OpenMP thread for a 50k-entry row, which costs
    more than the scan)."""
    if (
        logits.dtype == torch.float32
        and logits.dim() == 2
        and logits.is_contiguous()
        and logits.device.type == "cpu"
    ):
        k = native.loaded()  # only where a bfloat16 model already built the kernels
        if k is not None:
            return k.argmax(logits)
    return logits.argmax(dim=-1).tolist()


def _argmax_only(requests: Sequence[Request]) -> bool:
    """Every request greedy, with no logits processing (penalties, bias, min_tokens,
    allowed or bad words, processors): its token is the raw logits' argmax."""
    return all(r.sampling_params.greedy and not _needs_processing(r) for r in requests)


class Sampler:
    """Samples one token per row of logits for the given requests."""

    @staticmethod
    def argmax_suffices(requests: Sequence[Request]) -> bool:
        """True when the tokens of ``requests`` are their logits' argmax and nothing else
        is asked of the logits (no logprobs, no grammar): what a model may then compute
        without handing the logits over (``decode_greedy``)."""
        return _argmax_only(requests) and all(
            r.grammar is None and r.sampling_params.logprobs is None for r in requests
        )

    def __init__(self, seed: int = 0, logprobs_mode: str = "raw_logprobs") -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self.logprobs_mode = logprobs_mode  # config.LOGPROBS_MODES

    def draw_uniforms(self, requests: Sequence[Request], rand: Sequence[int]) -> torch.Tensor:
        """One float64 uniform (on the host) per row in ``rand``: a seeded request's from its
        own generator, the others from the sampler's, in row order (module docstring)."""
        params = [r.sampling_params for r in requests]
        uniforms = torch.empty(len(rand), dtype=torch.float64)
        unseeded = [j for j, i in enumerate(rand) if params[i].seed is None]
        if unseeded:
            uniforms[unseeded] = torch.rand(
                len(unseeded), dtype=torch.float64, generator=self.generator
            )
        for j, i in enumerate(rand):
            req = requests[i]
            seed = req.sampling_params.seed
            if seed is None:
                continue
            if req.generator is None:
                req.generator = torch.Generator().manual_seed(seed)
            uniforms[j] = torch.rand(1, dtype=torch.float64, generator=req.generator)[0]
        return uniforms

    def __call__(
        self, logits: torch.Tensor, requests: Sequence[Request]
    ) -> tuple[list[int], list[PositionLogprobs | None]]:
        """Token ids and (when ``params.logprobs`` is set) their logprobs, one per row.

        ``logits [N, V]`` float32 are the raw model outputs for the N requests' next token.
        """
        assert logits.shape[0] == len(requests)
        params = [r.sampling_params for r in requests]
        want_lp = [i for i, p in enumerate(params) if p.logprobs is not None]
        mode = self.logprobs_mode
        raw = None
        if want_lp and mode == "raw_logprobs":
            raw = logits.log_softmax(dim=-1)[want_lp]
        elif want_lp and mode == "raw_logits":
            raw = logits[want_lp].clone()

        x = logits  # the processed logits (the model's own on the fast path)
        constrained = [i for i, r in enumerate(requests) if r.grammar is not None]
        if not constrained and _argmax_only(requests):
            tokens = _argmax_rows(logits)  # fast path: no per-row work
        else:
            x = logits.clone()
            if constrained:
                # Structured outputs: only the tokens each row's grammar allows remain.
                bitmask = torch.empty(
                    len(constrained), bitmask_words(x.shape[1]), dtype=torch.int32
                )
                for j, i in enumerate(constrained):
                    grammar = requests[i].grammar
                    assert grammar is not None
                    grammar.fill_bitmask(bitmask[j])
                apply_bitmask(x, constrained, bitmask)
            if any(needs_request_processing(r) for r in requests):
                apply_request_processors(x, requests)
            x = _finite(apply_penalties_and_bias(x, requests))
            rand = [i for i, p in enumerate(params) if not p.greedy]
            # The greedy rows' tokens (the argmax of a vocabulary in torch: about 90 us a
            # row here, natively about 10).
            tokens = _argmax_rows(x) if len(rand) < len(params) else [0] * len(params)
            if rand:
                uniforms = self.draw_uniforms(requests, rand)
                rows = torch.tensor(rand, dtype=torch.int64)
                picked = _sample_rows(x[rows], [params[i] for i in rand], uniforms.to(x.dtype))
                for j, i in enumerate(rand):
                    tokens[i] = picked[j]

        if want_lp and raw is None:  # processed_*: after the request's logits processing
            temp = torch.tensor(
                [p.temperature if not p.greedy else 1.0 for p in params], dtype=x.dtype
            )[:, None]
            processed = (x / temp)[want_lp]
            raw = processed.log_softmax(dim=-1) if mode == "processed_logprobs" else processed
        lps: list[PositionLogprobs | None] = [None] * len(requests)
        if want_lp:
            assert raw is not None
            computed = topk_logprobs(
                raw, [tokens[i] for i in want_lp], [params[i].logprobs or 0 for i in want_lp]
            )
            for i, d in zip(want_lp, computed):
                lps[i] = d
        return tokens, lps
