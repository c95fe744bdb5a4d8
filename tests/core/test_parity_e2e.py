"""End to end: EngineCore + the real ModelRunner against transformers, in float32.

For every architecture, greedy generation must match ``generate(do_sample=False)``
token for token, whatever the engine does around it: batching prompts of different
lengths, prefix-cache hits, chunked prefill, and recompute preemption in a tiny KV
pool. Sampled-token logprobs must agree with transformers' log_softmax, and seeded
sampling must not depend on what else shares the batch.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from nbengine.config import EngineConfig
from nbengine.core.engine_core import EngineCore
from nbengine.core.messages import EngineCoreRequest
from nbengine.model.runner import ModelRunner
from nbengine.request import FinishReason
from nbengine.sampling_params import SamplingParams

transformers = pytest.importorskip("transformers")
testing = pytest.importorskip("nbengine.testing")

ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gpt2")
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: testing.make_tiny_model(root / arch, arch=arch, seed=3) for arch in ARCHS}


_HF_CACHE: dict[tuple[str, tuple[int, ...]], tuple[list[int], list[float]]] = {}


def hf_greedy(path: Path, prompt: list[int], n: int = NEW_TOKENS) -> tuple[list[int], list[float]]:
    """transformers' greedy continuation of ``prompt`` (EOS ignored) and its logprobs."""
    key = (str(path), tuple(prompt))
    if key not in _HF_CACHE:
        model = _hf_model(path)
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=n,
                do_sample=False,
                return_dict_in_generate=True,
                output_logits=True,
                pad_token_id=0,
            )
        tokens = out.sequences[0, len(prompt) :].tolist()
        assert len(tokens) == n
        lps = [
            torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, tokens)
        ]
        _HF_CACHE[key] = (tokens, lps)
    return _HF_CACHE[key]


_HF_MODELS: dict[str, object] = {}


def _hf_model(path: Path):
    if str(path) not in _HF_MODELS:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(path), dtype=torch.float32, attn_implementation="eager"
        )
        model.eval()
        # Never stop early (the engine side uses ignore_eos); min_new_tokens would instead
        # mask EOS out of the argmax.
        model.generation_config.eos_token_id = None
        _HF_MODELS[str(path)] = model
    return _HF_MODELS[str(path)]


def engine_run(
    path: Path,
    prompts: dict[str, list[int]],
    params: dict[str, SamplingParams] | SamplingParams,
    **kwargs: object,
) -> tuple[dict[str, list[int]], dict[str, list[float]], EngineCore, int]:
    """Run ``prompts`` through one EngineCore; returns tokens, logprobs, core, preemptions."""
    kwargs.setdefault("dtype", "float32")
    kwargs.setdefault("block_size", 4)
    kwargs.setdefault("num_kv_blocks", 128)
    core = EngineCore(EngineConfig.from_kwargs(str(path), **kwargs), ModelRunner)
    for i, (rid, prompt) in enumerate(prompts.items()):
        p = params[rid] if isinstance(params, dict) else params
        core.add_request(EngineCoreRequest(rid, prompt, p, arrival_time=float(i)))
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
    lps: dict[str, list[float]] = {rid: [] for rid in prompts}
    preemptions = 0
    for _ in range(1000):
        if not core.has_unfinished_requests():
            break
        batch = core.step()
        assert batch.engine_error is None
        preemptions += batch.step.num_preemptions
        for out in batch.outputs:
            tokens[out.request_id] += out.new_token_ids
            for tok, pos in zip(out.new_token_ids, out.new_logprobs or []):
                lps[out.request_id].append(pos[tok].logprob)
            if out.finished:
                assert out.finish_reason == FinishReason.LENGTH, out
    kv = core.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks
    core.shutdown()
    return tokens, lps, core, preemptions


def greedy(**kw: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, **kw)


def prompt_of(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(length)]


@pytest.mark.parametrize("arch", ARCHS)
def test_single_prompt_greedy_and_logprobs_match_transformers(arch, tiny_models):
    path = tiny_models[arch]
    prompt = prompt_of(1, 7)
    tokens, lps, _, _ = engine_run(path, {"a": prompt}, greedy(logprobs=1))
    ref_tokens, ref_lps = hf_greedy(path, prompt)
    assert tokens["a"] == ref_tokens
    assert len(set(ref_tokens)) > 1  # the model does not just repeat one token
    assert lps["a"] == pytest.approx(ref_lps, abs=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_batch_of_different_lengths_with_chunked_prefill(arch, tiny_models):
    path = tiny_models[arch]
    prompts = {f"p{n}": prompt_of(n, n) for n in (1, 5, 9, 23)}
    # A budget of 16 tokens forces the long prompt into chunks next to decodes.
    tokens, _, _, _ = engine_run(path, prompts, greedy(), max_num_batched_tokens=16)
    for rid, prompt in prompts.items():
        assert tokens[rid] == hf_greedy(path, prompt)[0], rid


@pytest.mark.parametrize("arch", ARCHS)
def test_prefix_caching_on_and_off(arch, tiny_models):
    path = tiny_models[arch]
    shared = prompt_of(7, 13)  # three full blocks of 4 and one more token
    prompts = {"a": shared + [11, 12], "b": shared + [21], "c": shared + [31, 32, 33]}
    results = {}
    for enable in (True, False):
        core = EngineCore(
            EngineConfig.from_kwargs(
                str(path),
                dtype="float32",
                block_size=4,
                num_kv_blocks=64,
                enable_prefix_caching=enable,
            ),
            ModelRunner,
        )
        got: dict[str, list[int]] = {k: [] for k in prompts}
        core.add_request(EngineCoreRequest("a", prompts["a"], greedy(), 0.0))
        for out in core.step().outputs:  # a's prompt is cached before b and c arrive
            got[out.request_id] += out.new_token_ids
        core.add_request(EngineCoreRequest("b", prompts["b"], greedy(), 1.0))
        core.add_request(EngineCoreRequest("c", prompts["c"], greedy(), 2.0))
        while core.has_unfinished_requests():
            for out in core.step().outputs:
                got[out.request_id] += out.new_token_ids
        results[enable] = (got, core.scheduler.kv.prefix_cache_hits)
        core.shutdown()
    assert results[True][1] == 24 and results[False][1] == 0
    assert results[True][0] == results[False][0]
    for rid, prompt in prompts.items():
        assert results[True][0][rid] == hf_greedy(path, prompt)[0], rid


@pytest.mark.parametrize("arch", ARCHS)
def test_preemption_in_a_small_pool(arch, tiny_models):
    path = tiny_models[arch]
    prompts = {f"r{i}": prompt_of(100 + i, 9 + i) for i in range(3)}
    # Each request grows to ~21 tokens (6 blocks of 4); 12 blocks cannot hold three.
    tokens, _, _, preemptions = engine_run(
        path, prompts, greedy(), num_kv_blocks=12, enable_prefix_caching=False
    )
    assert preemptions > 0
    for rid, prompt in prompts.items():
        assert tokens[rid] == hf_greedy(path, prompt)[0], rid


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_seeded_sampling_independent_of_batch(arch, tiny_models):
    path = tiny_models[arch]
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=NEW_TOKENS, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    prompt = prompt_of(5, 6)
    alone, _, _, _ = engine_run(path, {"s": prompt}, seeded)
    crowd = {"x": prompt_of(6, 3), "s": prompt, "y": prompt_of(8, 11), "z": prompt_of(9, 2)}
    params = {"x": other, "s": seeded, "y": seeded.clone(), "z": other}
    together, _, _, _ = engine_run(path, crowd, params, max_num_batched_tokens=8, seed=99)
    assert together["s"] == alone["s"]
    assert len(set(alone["s"])) > 1
