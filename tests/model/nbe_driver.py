"""A tiny scheduler stand-in for driving ModelRunner in tests: a free-list block
allocator, all requests scheduled every step, prompts optionally split into chunks."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from nbengine.core.request import Request
from nbengine.core.scheduler_output import ModelRunnerOutput, ScheduledChunk, SchedulerOutput
from nbengine.model.runner import ModelRunner
from nbengine.outputs import PositionLogprobs
from nbengine.sampling_params import SamplingParams

_ids = itertools.count()


@dataclass
class Tracked:
    req: Request
    max_new: int
    blocks: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs | None] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs | None] = field(default_factory=list)
    done: bool = False


class Driver:
    def __init__(
        self, runner: ModelRunner, chunk_size: int | None = None, stop_at_eos: bool = True
    ) -> None:
        self.runner = runner
        self.free = list(range(runner.num_kv_blocks))
        self.live: list[Tracked] = []
        self.chunk_size = chunk_size
        self.stop_at_eos = stop_at_eos
        self.steps: list[SchedulerOutput] = []

    def add(self, prompt: list[int], params: SamplingParams, max_new: int) -> Tracked:
        req = Request(
            f"r{next(_ids)}", list(prompt), params, self.runner.eos_token_ids, time.monotonic()
        )
        t = Tracked(req, max_new)
        self.live.append(t)
        return t

    def step(self) -> ModelRunnerOutput:
        batch = SchedulerOutput()
        bs = self.runner.block_size
        for t in self.live:
            if t.done:
                continue
            r = t.req
            n = r.num_tokens - r.num_computed_tokens
            if self.chunk_size is not None:
                n = min(n, self.chunk_size)
            end = r.num_computed_tokens + n
            while len(t.blocks) * bs < end:
                t.blocks.append(self.free.pop(0))
            batch.chunks.append(
                ScheduledChunk(r, r.num_computed_tokens, n, list(t.blocks), end == r.num_tokens)
            )
        batch.chunks.sort(key=lambda c: c.num_tokens != 1)
        self.steps.append(batch)
        out = self.runner.execute(batch)
        for c in batch.chunks:
            t = next(x for x in self.live if x.req is c.request)
            r = c.request
            r.num_computed_tokens += c.num_tokens
            if r.request_id in out.prompt_logprobs:
                t.prompt_logprobs.extend(out.prompt_logprobs[r.request_id])
            if c.sample:
                s = out.sampled[r.request_id]
                r.append_output_token(s.token_id)
                t.logprobs.append(s.logprobs)
                if r.num_output_tokens >= t.max_new or (
                    self.stop_at_eos
                    and s.token_id in r.eos_token_ids
                    and not r.sampling_params.ignore_eos
                ):
                    t.done = True
                    shared = {b for o in self.live if o is not t and not o.done for b in o.blocks}
                    self.free.extend(b for b in t.blocks if b not in shared and b not in self.free)
                    t.blocks = []
            else:
                assert r.request_id not in out.sampled
        return out

    def run(self) -> None:
        while any(not t.done for t in self.live):
            self.step()

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, max_new: int
    ) -> list[list[int]]:
        tracked = [self.add(p, params, max_new) for p in prompts]
        self.run()
        return [t.req.output_token_ids for t in tracked]
