"""A small deterministic model runner for the core tests, and helpers to drive a core.

``FakeRunner`` samples ``(last token + 1) % vocab_size`` for every chunk that ends
at the request's last token. It also simulates the paged KV cache: it writes the
token id of every computed position into its (block, offset) slot and, before
"computing" a chunk, checks that every earlier position reads back the right token
through the chunk's block table. So a wrong block table, a bad prefix-cache hit or a
block reused while still in use makes the step raise, exactly where a real model
would silently produce garbage.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from nbengine.config import EngineConfig
from nbengine.core.engine_core import EngineCore
from nbengine.core.messages import EngineCoreOutputs, EngineCoreRequest
from nbengine.core.scheduler_output import ModelRunnerOutput, SampledToken, SchedulerOutput
from nbengine.outputs import Logprob
from nbengine.sampling_params import SamplingParams


class KVMismatch(AssertionError):
    """The fake KV cache read back a wrong token."""


@dataclass
class FakeRunner:
    num_kv_blocks: int = 64
    block_size: int = 4
    max_model_len: int = 512
    vocab_size: int = 100
    eos_token_ids: frozenset[int] = frozenset({99})
    on_execute: Callable[[SchedulerOutput], None] | None = None
    slots: dict[tuple[int, int], int] = field(default_factory=dict)
    batches: list[SchedulerOutput] = field(default_factory=list)
    shut_down: bool = False

    def execute(self, batch: SchedulerOutput) -> ModelRunnerOutput:
        self.batches.append(batch)
        if self.on_execute is not None:
            self.on_execute(batch)
        bs = self.block_size
        seen_decode_after_prefill = False
        written: set[tuple[int, int]] = set()
        out = ModelRunnerOutput()
        for chunk in batch.chunks:
            req = chunk.request
            if chunk.is_prefill:
                seen_decode_after_prefill = True
            elif seen_decode_after_prefill:
                raise AssertionError("decode chunk after a prefill chunk")
            assert chunk.start_pos == req.num_computed_tokens
            end = chunk.start_pos + chunk.num_tokens
            assert end <= req.num_tokens
            assert len(chunk.block_table) == math.ceil(end / bs), "block table size"
            assert all(0 <= b < self.num_kv_blocks for b in chunk.block_table)
            assert chunk.sample == (end == req.num_tokens)
            for p in range(chunk.start_pos):
                slot = (chunk.block_table[p // bs], p % bs)
                if self.slots.get(slot) != req.all_token_ids[p]:
                    raise KVMismatch(f"{req.request_id}: position {p} reads {self.slots.get(slot)}")
            for p in range(chunk.start_pos, end):
                slot = (chunk.block_table[p // bs], p % bs)
                assert slot not in written, "two chunks write one KV slot in one step"
                written.add(slot)
                self.slots[slot] = req.all_token_ids[p]
            params = req.sampling_params
            if params.prompt_logprobs is not None:
                n_prompt = req.num_prompt_tokens
                first = 0 if chunk.start_pos == 0 else chunk.start_pos + 1
                last = min(end, n_prompt - 1)
                lps: list[dict[int, Logprob] | None] = []
                for q in range(first, last + 1):
                    lps.append(None if q == 0 else {req.all_token_ids[q]: Logprob(-float(q))})
                if lps:
                    out.prompt_logprobs[req.request_id] = lps
            if chunk.sample:
                tok = (req.all_token_ids[-1] + 1) % self.vocab_size
                lp = {tok: Logprob(-1.0, rank=1)} if params.logprobs is not None else None
                out.sampled[req.request_id] = SampledToken(tok, lp)
        return out

    def shutdown(self) -> None:
        self.shut_down = True


def make_core(
    *,
    num_kv_blocks: int = 64,
    block_size: int = 4,
    max_model_len: int = 512,
    vocab_size: int = 100,
    eos: int = 99,
    **kwargs: object,
) -> EngineCore:
    """An EngineCore over a FakeRunner; kwargs go to ``EngineConfig.from_kwargs``."""
    config = EngineConfig.from_kwargs(
        None, block_size=block_size, num_kv_blocks=num_kv_blocks, **kwargs
    )
    runner = FakeRunner(
        num_kv_blocks=num_kv_blocks,
        block_size=block_size,
        max_model_len=max_model_len,
        vocab_size=vocab_size,
        eos_token_ids=frozenset({eos}),
    )
    return EngineCore(config, runner=runner)


_clock = [0.0]


def make_request(
    rid: str,
    prompt: list[int],
    priority: int = 0,
    arrival: float | None = None,
    **params: object,
) -> EngineCoreRequest:
    params.setdefault("max_tokens", 8)
    if arrival is None:
        _clock[0] += 1.0
        arrival = _clock[0]
    return EngineCoreRequest(
        request_id=rid,
        prompt_token_ids=list(prompt),
        sampling_params=SamplingParams(**params),  # type: ignore[arg-type]
        arrival_time=arrival,
        priority=priority,
    )


def expected_tokens(prompt: list[int], n: int, vocab: int = 100) -> list[int]:
    """What FakeRunner generates after ``prompt`` (ignoring stops)."""
    out, last = [], prompt[-1]
    for _ in range(n):
        last = (last + 1) % vocab
        out.append(last)
    return out


@dataclass
class Collected:
    """Everything the core reported per key over a run."""

    tokens: dict[str, list[int]] = field(default_factory=dict)
    finish: dict[str, object] = field(default_factory=dict)
    stop_reason: dict[str, object] = field(default_factory=dict)
    status: dict[str, object] = field(default_factory=dict)
    prompt_logprobs: dict[str, list] = field(default_factory=dict)
    finished_count: dict[str, int] = field(default_factory=dict)
    batches: list[EngineCoreOutputs] = field(default_factory=list)

    def add(self, batch: EngineCoreOutputs) -> None:
        self.batches.append(batch)
        for out in batch.outputs:
            assert self.finished_count.get(out.request_id, 0) == 0, (
                f"output for {out.request_id} after it was reported finished"
            )
            self.tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.new_prompt_logprobs:
                self.prompt_logprobs.setdefault(out.request_id, []).extend(out.new_prompt_logprobs)
            if out.finished:
                self.finish[out.request_id] = out.finish_reason
                self.stop_reason[out.request_id] = out.stop_reason
                self.status[out.request_id] = out.status
        for key in batch.finished:
            self.finished_count[key] = self.finished_count.get(key, 0) + 1


def run_all(
    core: EngineCore, collected: Collected | None = None, max_steps: int = 10_000
) -> Collected:
    """Step until the core holds nothing; every key must be reported finished once."""
    c = collected or Collected()
    for _ in range(max_steps):
        if not core.has_unfinished_requests():
            break
        c.add(core.step())
    else:
        raise AssertionError("core did not finish")
    rest = core.collect_removals()
    if rest is not None:
        c.add(rest)
    assert all(v == 1 for v in c.finished_count.values()), c.finished_count
    return c
