"""Greedy decoding and logprobs match Hugging Face transformers on the same tiny weights."""

from __future__ import annotations

import pytest
from nbe_driver import Driver

from nbengine.sampling_params import SamplingParams
from nbengine.testing import make_tiny_model

transformers = pytest.importorskip("transformers")
from parity_setup import ParitySetup  # noqa: E402  (imports transformers)

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}

CASES = {
    "llama": ("llama", {}),
    "llama-tied-llama3rope": (
        "llama",
        {"tie_word_embeddings": True, "rope_scaling": LLAMA3_ROPE, "rope_theta": 500000.0},
    ),
    "llama-bias-mha": (
        "llama",
        {"attention_bias": True, "mlp_bias": True, "num_key_value_heads": 4},
    ),
    "mistral": ("mistral", {"num_key_value_heads": 1}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "gpt2": ("gpt2", {}),
}
TEXTS = ["Once upon a time", "The quick brown fox jumps over the lazy dog and the cat", "Hi"]
N_NEW = 20


@pytest.fixture(scope="module", params=list(CASES))
def setup(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> ParitySetup:
    arch, cfg = CASES[request.param]
    path = make_tiny_model(tmp_path_factory.mktemp(request.param), arch, seed=1, **cfg)
    return ParitySetup(path, TEXTS, N_NEW)


GREEDY = SamplingParams(temperature=0.0)


def test_single_prompt_greedy_matches_transformers(setup: ParitySetup) -> None:
    got = Driver(setup.runner).generate([setup.prompts[0]], GREEDY, N_NEW)[0]
    ref = setup.hf_greedy(0)
    assert got == ref
    assert len(set(ref)) > 3, "tiny model should not repeat one token"


def test_batch_of_three_decoded_together_matches_transformers(setup: ParitySetup) -> None:
    d = Driver(setup.runner)
    got = d.generate(setup.prompts, GREEDY, N_NEW)
    assert got == [setup.hf_greedy(i) for i in range(3)]
    assert any(sum(c.num_tokens == 1 for c in b.chunks) >= 3 for b in d.steps), (
        "decodes were batched"
    )


def test_chunked_prefill_matches_transformers(setup: ParitySetup) -> None:
    d = Driver(setup.runner, chunk_size=3)
    got = d.generate(setup.prompts, GREEDY, N_NEW)
    assert got == [setup.hf_greedy(i) for i in range(3)]
    assert any(c.start_pos > 0 and c.num_tokens > 1 for b in d.steps for c in b.chunks)


def test_prompt_and_sample_logprobs_match_transformers(setup: ParitySetup) -> None:
    d = Driver(setup.runner, chunk_size=5)
    t = d.add(setup.prompts[1], SamplingParams(temperature=0.0, logprobs=4, prompt_logprobs=3), 6)
    d.run()
    prompt = setup.prompts[1]
    ref = setup.hf_logprobs(prompt + t.req.output_token_ids)
    assert len(t.prompt_logprobs) == len(prompt) and t.prompt_logprobs[0] is None
    for p in range(1, len(prompt)):
        entry = t.prompt_logprobs[p]
        assert entry is not None and prompt[p] in entry
        row = ref[p - 1]
        for tok, lp in entry.items():
            assert abs(lp.logprob - float(row[tok])) < 1e-4
            assert lp.rank == int((row > row[tok]).sum()) + 1
        assert len(entry) in (3, 4)
    for j, tok in enumerate(t.req.output_token_ids):
        entry = t.logprobs[j]
        row = ref[len(prompt) - 1 + j]
        assert entry is not None and entry[tok].rank == 1  # greedy picks the top token
        assert {k for k, v in entry.items()} == set(row.topk(4).indices.tolist())
        for k, v in entry.items():
            assert abs(v.logprob - float(row[k])) < 1e-4


def test_seeded_sampling_same_alone_and_in_a_batch(setup: ParitySetup) -> None:
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=42)
    alone = Driver(setup.runner).generate([setup.prompts[0]], params, 12)[0]
    d = Driver(setup.runner)
    d.add(setup.prompts[1], SamplingParams(temperature=1.0), 12)
    mine = d.add(setup.prompts[0], params, 12)
    d.add(setup.prompts[2], SamplingParams(temperature=0.8, seed=7), 12)
    d.run()
    assert mine.req.output_token_ids == alone
    other = Driver(setup.runner).generate(
        [setup.prompts[0]], SamplingParams(temperature=1.0, top_p=0.95, seed=43), 12
    )[0]
    assert other != alone
