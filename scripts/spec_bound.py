"""What bounds n-gram speculation on the shipped default model: per prompt, the tokens a
step keeps with drafts on every step (k = 4), and the A/B of the shipped draft policy
against no speculation (interleaved, the order flipping every repeat); then the step
cost per row count (1 + k rows, drafts all rejected). docs/benchmarks.md,
"Speculative decoding".

Prompts: W4 as the bench builds it; three passages of Python's documentation (the model's
training text: ``pydoc_data.topics`` "for", "while", "if"), 96 tokens pasted, a blank
line, then their first 12 tokens again (the model asked to continue the passage); and
``len``'s docstring, whose continuation loops.

    python scripts/spec_bound.py [--repeats 10]
"""

from __future__ import annotations

import argparse
import inspect
import pydoc_data.topics as topics
import random
import statistics
import time
from typing import Any

import torch
from tokenizers import Tokenizer

from nbengine.bench.workloads import engine_continuation, make_workloads
from nbengine.config import EngineConfig
from nbengine.core.engine_core import EngineCore
from nbengine.core.messages import EngineCoreRequest
from nbengine.core.spec_decode import DraftPolicy
from nbengine.model.loader import resolve_model_dir
from nbengine.model.runner import ModelRunner
from nbengine.sampling_params import SamplingParams

SPEC = {"method": "ngram", "num_speculative_tokens": 4}


class _AllDrafts(DraftPolicy):
    def choose(self, request_id: str, rows: int, tokens: float, k_cap: int) -> int:
        return min(k_cap, self.k_max)


class _FixedDrafts:
    """A proposer of ``k`` drafts that are never right (token 5): the row-cost probe."""

    def __init__(self, k: int) -> None:
        self.k = k

    def draft(self, request_id: str, token_ids: Any, max_tokens: int) -> list[int]:
        return [5] * min(self.k, max_tokens)

    def forget(self, request_id: str) -> None:
        pass


def _core(path: str, spec: dict[str, Any] | None, policy: DraftPolicy | None = None) -> EngineCore:
    config = EngineConfig.from_kwargs(
        path, dtype="bfloat16", num_kv_blocks=256, speculative_config=spec
    )
    core = EngineCore(config, ModelRunner)
    if policy is not None:
        core.scheduler.spec_policy = policy
    return core


def _run(core: EngineCore, prompt: list[int], n: int) -> dict[str, Any]:
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    core.add_request(EngineCoreRequest("r", prompt, params, arrival_time=0.0))
    r: dict[str, Any] = {"steps": 0, "verified": 0, "drafted": 0, "accepted": 0, "tokens": []}
    times: list[float] = []
    start = time.perf_counter()
    while core.has_unfinished_requests():
        t = time.perf_counter()
        batch = core.step()
        times.append(time.perf_counter() - t)
        assert batch.step is not None
        r["steps"] += 1
        r["verified"] += bool(batch.step.spec_draft_tokens)
        r["drafted"] += batch.step.spec_draft_tokens
        r["accepted"] += batch.step.spec_accepted_tokens
        for out in batch.outputs:
            r["tokens"] += out.new_token_ids
    r["wall_s"] = time.perf_counter() - start
    r["step_s"] = statistics.median(times[2:]) if len(times) > 4 else float("nan")
    return r


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args()
    torch.set_num_threads(1)
    path = str(resolve_model_dir(None, None))
    tok = Tokenizer.from_file(path + "/tokenizer.json")

    def enc(text: str) -> list[int]:
        return list(tok.encode(text).ids)

    cont = engine_continuation(path, "bfloat16")
    prompts = {"W4": make_workloads(["W4"], 6144, continuation=cont)["W4"].prompts[0]}
    for name in ("for", "while", "if"):
        ids = enc(topics.topics[name])[:97]  # <|endoftext|> + 96 tokens
        prompts[f"pasted '{name}'"] = ids + enc("\n\n")[1:] + ids[1:13]
    prompts["len docstring (loops)"] = enc(inspect.getdoc(len) or "")
    for name, prompt in prompts.items():
        n = min(128, 256 - len(prompt))
        off, on, always = _core(path, None), _core(path, SPEC), _core(path, SPEC, _AllDrafts(4))
        a = _run(always, prompt, n)
        assert a["tokens"] == _run(off, prompt, n)["tokens"], name  # greedy parity
        rates: dict[str, list[float]] = {"off": [], "on": []}
        steps = []
        for rep in range(args.repeats):
            for label in ("off", "on") if rep % 2 == 0 else ("on", "off"):
                r = _run(off if label == "off" else on, prompt, n)
                rates[label].append(n / r["wall_s"])
                if label == "on":
                    steps.append(r["steps"])
        ratios = [b / x for x, b in zip(rates["off"], rates["on"])]
        print(
            f"{name}: {len(prompt)}-token prompt, {n} tokens | k=4 every step: {a['steps']} "
            f"steps ({a['verified']} verified), accepted {a['accepted']}/{a['drafted']} "
            f"({a['accepted'] / max(a['drafted'], 1):.0%}), {n / a['steps']:.2f} tokens/step "
            f"| policy: {min(steps)}-{max(steps)} steps, ratio median "
            f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})",
            flush=True,
        )
    cores = {}
    for k in range(5):
        cores[k] = _core(path, SPEC, _AllDrafts(4))
        cores[k].scheduler.proposer = _FixedDrafts(k)
    rng = random.Random(0)
    prompt = [rng.randrange(3, 6000) for _ in range(32)]
    cost: dict[int, list[float]] = {k: [] for k in cores}
    for rep in range(args.repeats // 2 + 1):
        for k in list(cores) if rep % 2 == 0 else list(reversed(cores)):
            cost[k].append(_run(cores[k], prompt, 200)["step_s"])
    base = statistics.median(cost[0])
    for k, v in cost.items():
        m = statistics.median(v)
        print(f"step of {k + 1} rows: {m * 1e3:.3f} ms (min {min(v) * 1e3:.3f}), {m / base:.2f}x")


if __name__ == "__main__":
    main()
