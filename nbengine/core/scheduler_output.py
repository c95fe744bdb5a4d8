"""What crosses between the scheduler and the model runner, once per step.

The scheduler decides, for each scheduled request, which contiguous run of its
tokens to compute this step (a prefill chunk or a single decode token) and which
KV blocks hold them; the runner computes them, writes their K/V into those blocks,
and samples one next token for every chunk that reaches the end of the request's
known tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nbengine.core.request import Request
from nbengine.outputs import PositionLogprobs


@dataclass(slots=True)
class ScheduledChunk:
    """Compute positions ``[start_pos, start_pos + num_tokens)`` of ``request.all_token_ids``.

    Invariants:
    - ``start_pos == request.num_computed_tokens`` when the step starts; K/V for
      positions ``[0, start_pos)`` are already in the cache (computed earlier or hit
      in the prefix cache).
    - ``block_table`` lists the physical block ids for positions
      ``[0, start_pos + num_tokens)``: position ``p`` lives in block
      ``block_table[p // block_size]`` at offset ``p % block_size``.
    - ``sample`` is True iff ``start_pos + num_tokens == request.num_tokens``.
    - ``draft_token_ids`` (speculative decoding, docs/speculative-decoding.md): only on a
      one-token decode chunk; the runner computes them at the positions after the
      chunk's (the block table covers them too) and verifies them.
    """

    request: Request
    start_pos: int
    num_tokens: int
    block_table: list[int]
    sample: bool
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def is_prefill(self) -> bool:
        """True when this chunk computes prompt (or recomputed) tokens, not one decode."""
        return not (self.num_tokens == 1 and self.start_pos >= self.request.num_prompt_tokens)


@dataclass(slots=True)
class SchedulerOutput:
    """One step's batch. Chunks are ordered: decodes first, then prefills (a runner may
    rely on nothing else)."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0  # one per decode, plus its drafts
    num_draft_tokens: int = 0  # speculative drafts among the decode tokens

    @property
    def total_num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass(slots=True)
class SampledToken:
    """The token sampled for one request, and its logprobs when ``params.logprobs`` is set."""

    token_id: int
    logprobs: PositionLogprobs | None = None  # top-k plus the sampled token


@dataclass(slots=True)
class ModelRunnerOutput:
    """Results of one step, keyed by the request's internal key."""

    sampled: dict[str, SampledToken] = field(default_factory=dict)
    # Requests whose chunk had drafts: the tokens verification kept, in order (the
    # accepted drafts, then the token sampled after them); such a key is not in ``sampled``.
    spec_sampled: dict[str, list[SampledToken]] = field(default_factory=dict)
    # For requests with params.prompt_logprobs: logprobs of the prompt tokens whose
    # predecessors were computed in this step, in position order (position 0 gets None).
    prompt_logprobs: dict[str, list[PositionLogprobs | None]] = field(default_factory=dict)
