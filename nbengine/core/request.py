"""``Request``: the engine core's record of one incarnation of a request.

It is keyed by the internal request key (unique per incarnation), never by the user's
id; its status is one of the core's (WAITING, RUNNING, PREEMPTED, then FINISHED_*:
nbengine/request.py, docs/lifecycle.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from nbengine.request import RequestStatus

if TYPE_CHECKING:
    import torch

    from nbengine.sampling_params import SamplingParams
    from nbengine.structured_outputs import GrammarMatcher

__all__ = ["Request"]


@dataclass(slots=True, eq=False)
class Request:
    """The engine core's state for one incarnation of a request.

    Invariants:
    - ``all_token_ids == prompt_token_ids + output_token_ids`` at all times.
    - ``num_computed_tokens <= len(all_token_ids)``; KV entries exist for exactly the
      first ``num_computed_tokens`` positions while the request holds blocks.
    - A PREEMPTED request holds no KV blocks and has ``num_computed_tokens == 0``.
    """

    request_id: str  # internal key: unique per incarnation
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    arrival_time: float
    priority: int = 0
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit tokens on first admission; -1 = not yet
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    generator: torch.Generator | None = None  # per-request RNG when params.seed is set
    grammar: GrammarMatcher | None = None  # structured outputs: the request's grammar state
    finished_by_grammar: bool = False  # its grammar matched and allows nothing more
    error: str | None = None  # set when its own logits processor failed: it ends in error
    cache_salt: str | None = None  # prefix-cache isolation: blocks shared only within a salt
    lora_int_id: int = 0  # the LoRA adapter it runs under (0: the base model; docs/lora.md)
    lora_key: str | None = None  # that adapter's load, unique per load: the prefix-cache key

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
