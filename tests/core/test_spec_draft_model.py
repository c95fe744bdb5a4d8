"""Speculative decoding with a draft model (``method: "draft_model"``).

Greedy outputs are token for token those without speculation, with the target as its
own draft (every draft accepted) and with a random draft of the same vocabulary (few
accepted), in mixed batches with chunked prefill and preemption; an aborted request's
draft state is gone when the abort is reported, and its id is reusable at once; a draft
of another vocabulary is refused at construction, naming the key
(docs/speculative-decoding.md).
"""

from __future__ import annotations

from pathlib import Path

import pytest

import nbengine as nb
from nbengine.config import EngineConfig
from nbengine.core.engine_core import EngineCore
from nbengine.core.messages import EngineCoreRequest
from nbengine.model.draft import DraftModelProposer
from nbengine.model.runner import ModelRunner
from nbengine.sampling_params import SamplingParams

from .test_spec_decode import greedy, passage, prompt_of, run

testing = pytest.importorskip("nbengine.testing")

ARCHS = ("llama", "gpt2")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("draft_tiny")
    out: dict[str, Path] = {}
    for arch in ARCHS:
        out[arch] = testing.make_tiny_model(root / arch, arch=arch, seed=3)
        # Same vocabulary (the tiny tokenizer), other weights, one layer.
        layers = {"n_layer": 1} if arch == "gpt2" else {"num_hidden_layers": 1}
        out[arch + "-draft"] = testing.make_tiny_model(
            root / f"{arch}-draft", arch=arch, seed=11, **layers
        )
    return out


def draft_spec(path: Path, k: int = 3) -> dict[str, object]:
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": k}


PROMPTS = {
    "copy": passage(1),
    "rand": prompt_of(2, 5),
    "long": passage(3) + prompt_of(4, 20),
    "one": prompt_of(5, 1),
}


@pytest.mark.parametrize("arch", ARCHS)
def test_the_target_as_its_own_draft_has_every_draft_accepted(arch, models) -> None:
    path = models[arch]
    kw = dict(max_num_batched_tokens=16)  # the long prompt is chunked next to decodes
    base = run(path, PROMPTS, greedy(40), None, **kw)
    got = run(path, PROMPTS, greedy(40), draft_spec(path), **kw)
    assert got.tokens == base.tokens
    assert got.drafts > 0 and got.accepted == got.drafts
    assert sum(got.per_request_accepted.values()) == got.accepted


@pytest.mark.parametrize("arch", ARCHS)
def test_a_random_draft_changes_no_greedy_output(arch, models) -> None:
    path = models[arch]
    # A mixed batch: greedy and seeded sampled requests, chunked prefill.
    params: dict[str, SamplingParams] = {rid: greedy(40) for rid in ("copy", "long", "one")}
    params["rand"] = SamplingParams(temperature=0.8, seed=7, max_tokens=40, ignore_eos=True)
    kw = dict(max_num_batched_tokens=16)
    base = run(path, PROMPTS, params, None, **kw)
    got = run(path, PROMPTS, params, draft_spec(models[arch + "-draft"]), **kw)
    again = run(path, PROMPTS, params, draft_spec(models[arch + "-draft"]), **kw)
    assert got.drafts > 0
    for rid in ("copy", "long", "one"):
        assert got.tokens[rid] == base.tokens[rid], rid
    assert got.tokens["rand"] == again.tokens["rand"]  # seeded: reproducible with drafts
    assert len(got.tokens["rand"]) == 40


def test_parity_under_preemption(models) -> None:
    path = models["llama"]
    shared = passage(7)
    prompts = {f"r{i}": shared + prompt_of(100 + i, 2 + i) for i in range(3)}
    kw = dict(num_kv_blocks=20, enable_prefix_caching=True)
    base = run(path, prompts, greedy(40), None, **kw)
    got = run(path, prompts, greedy(40), draft_spec(path, 4), **kw)
    assert got.preemptions > 0 and got.accepted > 0
    assert got.tokens == base.tokens


def test_an_aborted_request_drops_its_draft_state_and_its_id_is_reusable(models) -> None:
    path = models["llama"]
    config = EngineConfig.from_kwargs(
        str(path), speculative_config=draft_spec(path), dtype="float32", block_size=4
    )
    core = EngineCore(config, ModelRunner)
    proposer = core.scheduler.proposer
    assert isinstance(proposer, DraftModelProposer)
    prompt = passage(1)
    core.add_request(EngineCoreRequest("a", prompt, greedy(30), arrival_time=0.0))
    for _ in range(4):
        core.step()
    assert proposer.num_cached_requests == 1
    core.abort_requests(["a"])
    batch = core.step()  # the abort is applied and reported in this step
    assert any(o.request_id == "a" and o.finished for o in batch.outputs)
    assert proposer.num_cached_requests == 0
    # Reused at once: the same tokens as a fresh request, every block returned.
    core.add_request(EngineCoreRequest("a", prompt, greedy(30), arrival_time=1.0))
    tokens: list[int] = []
    while core.has_unfinished_requests():
        for out in core.step().outputs:
            tokens += out.new_token_ids
    assert proposer.num_cached_requests == 0
    assert core.scheduler.kv.num_free_blocks == core.scheduler.kv.num_blocks
    core.shutdown()
    ref = run(path, {"a": prompt}, greedy(30), None)
    assert tokens == ref.tokens["a"]


def test_a_draft_of_another_vocabulary_is_refused(models, tmp_path: Path) -> None:
    other = testing.make_tiny_model(tmp_path / "other", arch="llama", seed=1, vocab_size=512)
    with pytest.raises(ValueError, match=r"speculative_config\['model'\].*vocabulary"):
        nb.Engine(str(models["llama"]), speculative_config=draft_spec(other), dtype="float32")


@pytest.mark.parametrize(
    ("value", "exc", "key"),
    [
        ({"method": "draft_model", "num_speculative_tokens": 2}, ValueError, "model"),
        ({"method": "draft_model", "model": "", "num_speculative_tokens": 2}, ValueError, "model"),
        ({"method": "ngram", "model": "x", "num_speculative_tokens": 2}, ValueError, "model"),
        (
            {"method": "draft_model", "model": "x", "dtype": 3, "num_speculative_tokens": 2},
            TypeError,
            "dtype",
        ),
    ],
)
def test_bad_draft_model_configs_are_refused(value, exc, key) -> None:
    with pytest.raises(exc, match=rf"speculative_config\['{key}'\]"):
        EngineConfig.from_kwargs(None, speculative_config=value)
