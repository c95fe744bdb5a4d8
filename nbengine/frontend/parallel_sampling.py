"""Parallel sampling: one request with ``n > 1`` fans out into ``n`` completions.

Each completion (child) is its own incarnation in the core, under its own internal key
``<id>#<incarnation>.<index>`` (``<id>#<incarnation>`` when ``n == 1``); the output
processor fans their outputs back in (nbengine/frontend/output_processor.py).
Completion ``i`` draws from ``seed + i`` (wrapped into 64 bits) and only completion 0
asks the core for the prompt's logprobs, so the request carries one copy of them.
"""

from __future__ import annotations

from collections.abc import Sequence

from nbengine.frontend.detokenizer import IncrementalDetokenizer, TokenizerLike
from nbengine.frontend.output_processor import ChildState
from nbengine.sampling_params import SEED_MAX, SamplingParams

__all__ = ["child_seed", "fan_out"]


def child_seed(seed: int, index: int) -> int:
    """The seed of completion ``index`` of an n>1 request: ``seed + index`` in 64 bits."""
    child = seed + index
    return child if child <= SEED_MAX else child - 2**64


def fan_out(
    request_id: str,
    incarnation: int,
    params: SamplingParams,
    tokenizer: TokenizerLike,
    prompt_token_ids: Sequence[int],
) -> list[ChildState]:
    """The children of one incarnation, each with its key, params and detokenizer."""
    n = params.n
    children: list[ChildState] = []
    for i in range(n):
        if n == 1:
            key, cp = f"{request_id}#{incarnation}", params
        else:
            key = f"{request_id}#{incarnation}.{i}"
            cp = params.replace(
                n=1,
                seed=None if params.seed is None else child_seed(params.seed, i),
                prompt_logprobs=params.prompt_logprobs if i == 0 else None,
            )
        children.append(
            ChildState(
                key=key,
                index=i,
                params=cp,
                detok=IncrementalDetokenizer(tokenizer, cp, prompt_token_ids),
            )
        )
    return children
