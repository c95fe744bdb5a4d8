"""What the frontend costs per token, with no model (issue 32, item 5).

Runs a real ``nb.Engine`` (the tiny test Llama's tokenizer; its core a real
``EngineCore`` and scheduler) whose model runner is a stub: every sampled chunk gets a
fixed token from a short cycle of ordinary text tokens, at no compute cost. So the
core emits tokens for ``--streams`` concurrent requests as fast as it can schedule
them, and each batch travels the frontend's whole output path: the core client's
``emit``, the loop bridge, the registry, the output processor (detokenizer, stop
checks, observers: the engine's ``MetricsLog``), the ``RequestOutput`` and the
handle's merge.

Reported per run (median of ``--runs``):

- frontend tokens/s: tokens delivered per CPU second of the ``nbengine-loop`` thread,
  which runs the frontend's output path and nothing else (``time.thread_time`` read on
  that thread); the core's scheduling runs on its own thread and is not counted;
- end-to-end tokens/s: tokens delivered per wall second (core and frontend together,
  sharing the GIL: an upper bound on the frontend's throughput, not its cost).

Usage: python scripts/bench_frontend.py [--streams 64] [--tokens 200] [--rounds 4]
[--runs 3]
(docs/benchmarks.md, "Frontend cost per token").
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import nbengine as nb
from nbengine.config import EngineConfig
from nbengine.core.scheduler_output import ModelRunnerOutput, SampledToken, SchedulerOutput
from nbengine.testing import make_tiny_model


class StubRunner:
    """A model runner that samples a fixed cycle of tokens and computes nothing."""

    def __init__(self, config: EngineConfig, probe: nb.Engine, tokens: list[int]) -> None:
        self.block_size = config.cache.block_size
        self.num_kv_blocks = config.cache.num_kv_blocks or 4096
        self.max_model_len = probe.max_model_len
        self.vocab_size = probe.vocab_size
        self.eos_token_ids = probe.eos_token_ids
        self._tokens = tokens
        self._step = 0

    def execute(self, batch: SchedulerOutput) -> ModelRunnerOutput:
        out = ModelRunnerOutput()
        self._step += 1
        tok = self._tokens[self._step % len(self._tokens)]
        for chunk in batch.chunks:
            if chunk.sample:
                out.sampled[chunk.request.request_id] = SampledToken(tok)
        return out

    def shutdown(self) -> None:
        pass


def _text_tokens(engine: nb.Engine) -> list[int]:
    """A few ids of ordinary words, so the detokenizer does its usual work."""
    ids = engine.encode_prompt(" the quick brown fox jumps over the lazy dog")
    return [i for i in ids if i not in engine.eos_token_ids] or [5]


def run_once(model: Path, streams: int, tokens: int, rounds: int) -> dict[str, float]:
    """One run: ``rounds`` times, ``streams`` requests of ``tokens`` tokens each."""
    kw = dict(max_num_seqs=streams, num_kv_blocks=4096, max_num_batched_tokens=8192)
    probe = nb.Engine(str(model), **kw)
    try:
        runner = StubRunner(probe.config, probe, _text_tokens(probe))
    finally:
        probe.shutdown()
    engine = nb.Engine(str(model), _runner=runner, **kw)
    try:
        params = nb.SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0)
        cpu0 = engine._bridge.call(time.thread_time)
        t0 = time.perf_counter()
        outs = []
        for _ in range(rounds):
            handles = [engine.generate("Once upon a time", params) for _ in range(streams)]
            outs += [h.result(timeout=600) for h in handles]
        wall = time.perf_counter() - t0
        cpu = engine._bridge.call(time.thread_time) - cpu0
    finally:
        engine.shutdown()
    delivered = sum(len(o.outputs[0].token_ids) for o in outs)
    assert delivered == rounds * streams * tokens, (delivered, rounds * streams * tokens)
    return {
        "tokens": delivered,
        "loop_cpu_s": cpu,
        "wall_s": wall,
        "frontend_tok_s": delivered / cpu,
        "e2e_tok_s": delivered / wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=200, help="output tokens per stream")
    ap.add_argument("--rounds", type=int, default=4, help="batches of streams per run")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "llama")
        runs = [run_once(model, args.streams, args.tokens, args.rounds) for _ in range(args.runs)]
    summary = {
        "streams": args.streams,
        "tokens_per_stream": args.tokens,
        "rounds": args.rounds,
        "runs": runs,
        "median_frontend_tok_s": statistics.median(r["frontend_tok_s"] for r in runs),
        "median_e2e_tok_s": statistics.median(r["e2e_tok_s"] for r in runs),
    }
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
