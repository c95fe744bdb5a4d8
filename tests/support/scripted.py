"""A scripted reply: a logits processor that makes any model write a given text.

Tests of what is done with a model's text (tool-call parsing) need that text from a
tiny random model; the processor forces the text's tokens one by one, then ``then``
(an eos id to stop, or a token to repeat until max_tokens)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def scripted(
    tokenizer: Any, text: str, then: int
) -> Callable[[list[int], torch.Tensor], torch.Tensor]:
    """The processor forcing ``text`` (whose tokens must decode back to it), then ``then``."""
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    assert tokenizer.decode(ids, skip_special_tokens=False) == text, "text does not round-trip"

    def force(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        step = len(output_ids)
        out = torch.full_like(logits, float("-inf"))
        out[ids[step] if step < len(ids) else then] = 0.0
        return out

    return force


def eos_id(tokenizer: Any) -> int:
    """An id that ends a reply."""
    return min(tokenizer.eos_token_ids)
