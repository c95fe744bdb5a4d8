"""Per-request logits processing beyond penalties: vLLM's ``allowed_token_ids``,
``bad_words`` and per-request ``logits_processors``.

Applied by the sampler (ops/sampling.py) to the rows of requests that set one of them,
after the structured-output mask and before ``min_tokens``, ``logit_bias`` and the
penalties. A batch in which no request sets them never reaches this module (the
sampler's fast path is unchanged).

Cost: ``allowed_token_ids`` and ``bad_words`` are one indexed write per row and step.
A logits processor is a Python call per request per step on the engine core's thread,
holding the whole step (every other request waits for it): keep it cheap, vectorised,
and free of I/O. An exception in a processor fails that request alone (finish_reason
"error"), never the engine.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from nbengine.core.request import Request
from nbengine.sampling_params import processor_arity

logger = logging.getLogger(__name__)


def needs_request_processing(req: Request) -> bool:
    """True when ``req`` sets allowed_token_ids, bad_words or logits_processors."""
    p = req.sampling_params
    return bool(p.allowed_token_ids or p.bad_words_token_ids or p.logits_processors)


def banned_by_bad_words(bad_words: Sequence[Sequence[int]], output_ids: Sequence[int]) -> list[int]:
    """The tokens that would complete one of ``bad_words`` after ``output_ids``.

    A one-token word is always banned; a longer one only when the output ends with all
    of it but its last token (vLLM's rule: only generated tokens count, not the prompt).
    """
    banned: list[int] = []
    n_out = len(output_ids)
    for word in bad_words:
        k = len(word) - 1
        if k > n_out:
            continue
        if k == 0 or list(output_ids[n_out - k :]) == list(word[:k]):
            banned.append(word[-1])
    return banned


def apply_request_processors(logits: torch.Tensor, requests: Sequence[Request]) -> None:
    """Apply each request's allowed_token_ids, bad_words and logits processors, in place."""
    vocab = logits.shape[1]
    for i, req in enumerate(requests):
        p = req.sampling_params
        if p.allowed_token_ids:
            keep = torch.full((vocab,), True, device=logits.device)
            keep[[t for t in p.allowed_token_ids if t < vocab]] = False
            logits[i].masked_fill_(keep, float("-inf"))
        if p.bad_words_token_ids:
            banned = [
                t
                for t in banned_by_bad_words(p.bad_words_token_ids, req.output_token_ids)
                if t < vocab
            ]
            if banned:
                logits[i, banned] = float("-inf")
        if p.logits_processors and req.error is None:
            row = logits[i]
            out_ids = list(req.output_token_ids)
            try:
                for fn in p.logits_processors:
                    if processor_arity(fn) == 3:
                        res = fn(list(req.prompt_token_ids), out_ids, row)
                    else:
                        res = fn(out_ids, row)
                    if not isinstance(res, torch.Tensor) or res.shape != row.shape:
                        raise TypeError(
                            f"a logits processor must return a tensor of shape "
                            f"{tuple(row.shape)}, got {type(res).__name__} "
                            f"{tuple(getattr(res, 'shape', ()))}"
                        )
                    row = res.to(logits.dtype)
            except Exception as exc:  # fails this request only (scheduler reads req.error)
                logger.warning("logits processor of request %s failed: %r", req.request_id, exc)
                req.error = f"logits processor failed: {type(exc).__name__}: {exc}"
                continue
            logits[i] = row
