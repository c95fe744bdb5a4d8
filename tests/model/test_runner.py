"""ModelRunner behaviour beyond parity: KV sizing, prefix reuse, dtypes, edge cases."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from nbe_driver import Driver
from torch import nn

from nbengine.config import EngineConfig
from nbengine.core.scheduler_output import SchedulerOutput
from nbengine.model import runner as runner_module
from nbengine.model.loader import LoadedModel, load_model
from nbengine.model.protocol import PlannedDecode
from nbengine.model.runner import ModelRunner, kv_block_bytes
from nbengine.model.weights import WeightMap
from nbengine.sampling_params import SamplingParams
from nbengine.testing import make_tiny_model

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("qwen2"), "qwen2", seed=2)


@pytest.fixture(scope="module")
def runner(model_dir: Path) -> ModelRunner:
    return ModelRunner(EngineConfig.from_kwargs(model_dir, block_size=4, num_kv_blocks=128))


def test_runner_attributes_and_explicit_block_count(runner: ModelRunner) -> None:
    assert runner.num_kv_blocks == 128 and runner.block_size == 4
    assert runner.max_model_len == 256 and runner.vocab_size == 400
    assert runner.eos_token_ids == frozenset({0, 2})
    k, v = runner.kv_caches[0]
    assert k.shape == v.shape == (128, 4, 2, 16) and len(runner.kv_caches) == 2


def test_kv_blocks_sized_from_memory_and_capped(model_dir: Path) -> None:
    per_block = kv_block_bytes(2, 16, 2, 16, torch.float32)
    r = ModelRunner(EngineConfig.from_kwargs(model_dir, kv_cache_memory_gb=0.0001, max_num_seqs=64))
    assert r.num_kv_blocks == int(0.0001 * (1 << 30)) // per_block
    r = ModelRunner(EngineConfig.from_kwargs(model_dir, kv_cache_memory_gb=1.0, max_num_seqs=3))
    assert r.num_kv_blocks == 3 * math.ceil(256 / 16)  # never more than 3 full-length sequences


def test_prefill_continuing_from_shared_prefix_blocks(runner: ModelRunner) -> None:
    tok = runner.tokenizer
    base = tok.encode("The quick brown fox jumps over the lazy dog")
    other = tok.encode("The quick brown fox jumps over the hill and far away")
    shared = 0
    while base[shared] == other[shared]:
        shared += 1
    n_blocks = shared // runner.block_size
    assert n_blocks >= 2
    expected = Driver(runner).generate([other], GREEDY, 10)[0]

    d = Driver(runner)
    a = d.add(base, GREEDY, 10)
    d.step()  # computes base's prompt K/V into a's blocks
    b = d.add(other, GREEDY, 10)
    b.blocks = a.blocks[:n_blocks]  # a prefix-cache hit: reuse base's full blocks
    b.req.num_computed_tokens = n_blocks * runner.block_size
    d.run()
    assert b.req.output_token_ids == expected
    first_b = next(c for s in d.steps for c in s.chunks if c.request is b.req)
    assert first_b.start_pos == n_blocks * runner.block_size


def test_empty_batch_and_one_token_prompt(runner: ModelRunner) -> None:
    assert runner.execute(SchedulerOutput()).sampled == {}
    d = Driver(runner)
    t = d.add([5], SamplingParams(temperature=0, prompt_logprobs=2), 3)
    d.run()
    assert t.prompt_logprobs == [None] and len(t.req.output_token_ids) == 3


def test_prompt_logprobs_arrive_per_chunk_in_order(runner: ModelRunner) -> None:
    prompt = runner.tokenizer.encode("Once upon a time there was a cat")
    d = Driver(runner, chunk_size=4)
    t = d.add(prompt, SamplingParams(temperature=0, prompt_logprobs=1), 2)
    d.run()
    assert len(t.prompt_logprobs) == len(prompt) and t.prompt_logprobs[0] is None
    assert all(e is not None and prompt[p] in e for p, e in enumerate(t.prompt_logprobs) if p)


def test_bfloat16_runner_generates(model_dir: Path) -> None:
    r = ModelRunner(
        EngineConfig.from_kwargs(model_dir, dtype="bfloat16", block_size=4, num_kv_blocks=32)
    )
    assert r.kv_caches[0][0].dtype == torch.bfloat16
    prompt = r.tokenizer.encode("Once upon a time")
    out = Driver(r, stop_at_eos=False).generate([prompt], GREEDY, 8)[0]
    assert len(out) == 8 and all(0 <= t < r.vocab_size for t in out)


def test_shutdown_drops_tensors(model_dir: Path) -> None:
    r = ModelRunner(EngineConfig.from_kwargs(model_dir, num_kv_blocks=4))
    r.shutdown()
    assert r.kv_caches == [] and r.model is None


def test_steps_with_only_intermediate_chunks_sample_nothing(runner: ModelRunner) -> None:
    prompt = runner.tokenizer.encode("The cat sat on the mat")
    expected = Driver(runner).generate([prompt], GREEDY, 5)[0]
    d = Driver(runner, chunk_size=2)
    got = d.generate([prompt], GREEDY, 5)[0]
    assert got == expected
    assert sum(1 for s in d.steps if not any(c.sample for c in s.chunks)) >= 2


class _MinimalLM(nn.Module):
    """A model that is only a ``CausalLM`` (model/protocol.py): an ``nn.Module`` that runs
    a loaded model's forward and head, with none of its optional capabilities."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.num_layers, self.num_kv_heads = inner.num_layers, inner.num_kv_heads
        self.head_dim, self.layer_windows = inner.head_dim, inner.layer_windows
        self.forward_rows: list[int] = []  # rows of each forward call

    def forward(self, input_ids: torch.Tensor, *rest: Any) -> torch.Tensor:
        """The inner model's hidden states (``rest``: positions, metadata, KV caches)."""
        self.forward_rows.append(input_ids.shape[0])
        return self.inner(input_ids, *rest)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.inner.compute_logits(hidden)

    def tie_weights(self) -> None:
        self.inner.tie_weights()

    def hf_weight_map(self) -> WeightMap:
        return self.inner.hf_weight_map()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_model_without_a_decode_plan_runs_every_step_through_its_forward(
    model_dir: Path, dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The runner picks its path from the model's declared capabilities: a plain
    CausalLM gets every step, decode steps included, through ``__call__`` and
    ``compute_logits``, and generates what the same weights generate with their plan."""
    config = EngineConfig.from_kwargs(model_dir, dtype=dtype, block_size=4, num_kv_blocks=64)
    prompts = [[5, 9, 11, 13, 17], [7, 3]]
    params = SamplingParams(temperature=0.0, ignore_eos=True)
    full = ModelRunner(config)
    assert isinstance(full.model, PlannedDecode)
    expected = Driver(full, stop_at_eos=False).generate(prompts, params, 6)
    full.shutdown()

    def load_minimal(*args: Any, **kwargs: Any) -> LoadedModel:
        loaded = load_model(*args, **kwargs)
        return dataclasses.replace(loaded, model=_MinimalLM(loaded.model))

    monkeypatch.setattr(runner_module, "load_model", load_minimal)
    plain = ModelRunner(config)
    assert isinstance(plain.model, _MinimalLM) and not isinstance(plain.model, PlannedDecode)
    d = Driver(plain, stop_at_eos=False)
    assert d.generate(prompts, params, 6) == expected
    assert plain.model.forward_rows == [sum(c.num_tokens for c in s.chunks) for s in d.steps]
    assert plain.model.forward_rows.count(2) >= 5, "the decode steps ran the forward"
