"""Speculative decoding (n-gram) in the engine core: exactness and KV bookkeeping.

With ``speculative_config={"method": "ngram", ...}`` greedy outputs must be token for
token those without it (several architectures, batch mixes with and without drafts,
chunked prefill, preemption in a small pool, prefix caching on), every sampling
transform must apply at each verified position as in a normal step, stops inside an
accepted run must truncate there, and after every step a request holds exactly the KV
blocks of the positions it kept (docs/speculative-decoding.md).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from nbengine.config import EngineConfig, SpeculativeConfig
from nbengine.core.engine_core import EngineCore
from nbengine.core.messages import EngineCoreRequest
from nbengine.core.spec_decode import DraftPolicy, NgramProposer
from nbengine.model.runner import ModelRunner
from nbengine.request import FinishReason
from nbengine.sampling_params import SamplingParams

from support.spec_policies import AllDrafts, RandomK

testing = pytest.importorskip("nbengine.testing")

ARCHS = ("llama", "qwen3", "gpt2")
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("spec_tiny")
    return {arch: testing.make_tiny_model(root / arch, arch=arch, seed=3) for arch in ARCHS}


def prompt_of(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(length)]


def passage(seed: int) -> list[int]:
    """A prompt that quotes a passage twice: the output tends to copy it again."""
    text = prompt_of(seed, 9)
    return text + prompt_of(seed + 1, 3) + text


class Run:
    """Tokens, logprobs, finish reasons and speculation counters of one core run."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.logprobs: dict[str, list[float]] = {}
        self.finish: dict[str, tuple[FinishReason | None, int | str | None]] = {}
        self.drafts = 0
        self.accepted = 0
        self.preemptions = 0
        self.per_request_accepted: dict[str, int] = {}


def check_kv(core: EngineCore) -> None:
    """Every running decode holds exactly the blocks of its computed positions."""
    sched = core.scheduler
    for req in sched.running:
        if req.num_computed_tokens >= req.num_prompt_tokens:
            assert req.num_computed_tokens == req.num_tokens - 1
            held = sched.kv.num_held_blocks(req.request_id)
            assert held == sched.kv.blocks_needed(req.num_computed_tokens), req.request_id


def run(
    path: Path,
    prompts: dict[str, list[int]],
    params: dict[str, SamplingParams] | SamplingParams,
    spec: dict[str, Any] | None,
    policy: DraftPolicy | None = None,
    shipped_policy: bool = False,
    **kwargs: Any,
) -> Run:
    kwargs.setdefault("dtype", "float32")
    kwargs.setdefault("block_size", 4)
    kwargs.setdefault("num_kv_blocks", 128)
    config = EngineConfig.from_kwargs(str(path), speculative_config=spec, **kwargs)
    core = EngineCore(config, ModelRunner)
    if spec is not None and not shipped_policy:
        # Every step drafts all the room allows, so the verification paths run whatever
        # the host's timing (the shipped policy's choices depend on measured step times).
        core.scheduler.spec_policy = policy or AllDrafts(config.speculative.num_speculative_tokens)
    for i, (rid, prompt) in enumerate(prompts.items()):
        p = params[rid] if isinstance(params, dict) else params
        core.add_request(EngineCoreRequest(rid, prompt, p, arrival_time=float(i)))
    r = Run()
    r.tokens = {rid: [] for rid in prompts}
    r.logprobs = {rid: [] for rid in prompts}
    for _ in range(2000):
        if not core.has_unfinished_requests():
            break
        batch = core.step()
        assert batch.engine_error is None, batch.engine_error
        assert batch.step is not None
        r.drafts += batch.step.spec_draft_tokens
        r.accepted += batch.step.spec_accepted_tokens
        r.preemptions += batch.step.num_preemptions
        for out in batch.outputs:
            r.tokens[out.request_id] += out.new_token_ids
            r.per_request_accepted[out.request_id] = (
                r.per_request_accepted.get(out.request_id, 0) + out.num_spec_accepted
            )
            if out.new_logprobs is not None:
                assert len(out.new_logprobs) == len(out.new_token_ids)
                for tok, pos in zip(out.new_token_ids, out.new_logprobs):
                    r.logprobs[out.request_id].append(pos[tok].logprob)
            if out.finished:
                r.finish[out.request_id] = (out.finish_reason, out.stop_reason)
        check_kv(core)
    assert not core.has_unfinished_requests()
    kv = core.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks  # every block came back
    core.shutdown()
    return r


def greedy(n: int = 24, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


# --- configuration ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "exc", "names"),
    [
        ({"method": "eagle", "num_speculative_tokens": 2}, ValueError, "method"),
        ({"method": "ngram"}, ValueError, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 0}, ValueError, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 2.5}, TypeError, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 2, "k": 1}, ValueError, "'k'"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4},
            ValueError,
            "prompt_lookup_min",
        ),
        ("ngram", TypeError, "speculative_config"),
    ],
)
def test_bad_speculative_config_is_refused_naming_the_key(value, exc, names) -> None:
    with pytest.raises(exc, match=names):
        EngineConfig.from_kwargs("m", speculative_config=value)


def test_speculation_is_off_by_default() -> None:
    assert not EngineConfig.from_kwargs("m").speculative.enabled
    spec = EngineConfig.from_kwargs("m", speculative_config=SPEC).speculative
    assert spec == SpeculativeConfig("ngram", 4, 3, 1)


def test_ngram_proposer_takes_the_longest_earlier_match() -> None:
    cfg = SpeculativeConfig("ngram", 3, 3, 1)
    proposer = NgramProposer(cfg)
    # The 3-gram (7, 8, 9) occurred before; the tokens after it are proposed.
    assert proposer.propose([1, 7, 8, 9, 4, 5, 6, 2, 7, 8, 9], 3) == [4, 5, 6]
    assert proposer.propose([1, 7, 8, 9, 4, 5, 6, 2, 7, 8, 9], 2) == [4, 5]
    # Only a 1-gram matches: (9) followed by 3.
    assert proposer.propose([9, 3, 1, 2, 9], 3) == [3, 1, 2]
    # No earlier occurrence: no drafts.
    assert proposer.propose([1, 2, 3, 4], 3) == []
    assert NgramProposer(SpeculativeConfig("ngram", 3, 3, 2)).propose([9, 3, 1, 2, 9], 3) == []


# --- greedy parity ---------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_parity_in_a_mixed_batch_with_chunked_prefill(arch, tiny_models) -> None:
    path = tiny_models[arch]
    prompts = {
        "copy": passage(1),
        "rand": prompt_of(2, 5),
        "long": passage(3) + prompt_of(4, 20),
        "one": prompt_of(5, 1),
    }
    # A budget of 16 tokens chunks the long prompt next to decodes (and their drafts).
    kw = dict(max_num_batched_tokens=16)
    spec = {**SPEC, "prompt_lookup_min": 2}  # some steps find nothing: no drafts
    base = run(path, prompts, greedy(48), None, **kw)
    got = run(path, prompts, greedy(48), spec, **kw)
    assert got.tokens == base.tokens
    assert base.drafts == 0 and got.drafts > 0 and got.accepted > 0
    assert sum(got.per_request_accepted.values()) == got.accepted


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_parity_with_preemption_and_prefix_caching(arch, tiny_models) -> None:
    path = tiny_models[arch]
    shared = passage(7)
    prompts = {f"r{i}": shared + prompt_of(100 + i, 2 + i) for i in range(3)}
    # Each request grows to about 65 tokens (17 blocks of 4): 20 blocks hold one.
    kw = dict(num_kv_blocks=20, enable_prefix_caching=True)
    base = run(path, prompts, greedy(40), None, **kw)
    got = run(path, prompts, greedy(40), SPEC, **kw)
    assert got.preemptions > 0
    # Drafts were verified (and their rejected positions rolled back) across preemptions;
    # whether a random tiny model accepts any is its weights' business (gpt2's does not).
    assert got.drafts > 0
    assert got.tokens == base.tokens


def test_greedy_logprobs_and_every_transform_per_position(tiny_models) -> None:
    path = tiny_models["llama"]
    prompts = {"a": passage(11), "b": passage(12)}
    plain = run(path, prompts, greedy(), None)
    out_a = plain.tokens["a"]
    params = {
        "a": greedy(
            logprobs=2,
            repetition_penalty=1.2,
            frequency_penalty=0.3,
            presence_penalty=0.2,
            logit_bias={out_a[3]: -0.5, out_a[8]: 0.7},
        ),
        "b": greedy(
            logprobs=1,
            min_tokens=6,
            bad_words_token_ids=[[out_a[1], out_a[2]]],
            allowed_token_ids=list(range(3, 400, 2)) + out_a,
        ),
    }
    base = run(path, prompts, params, None)
    got = run(path, prompts, params, SPEC)
    assert got.tokens == base.tokens
    assert got.accepted > 0
    for rid in prompts:
        assert got.logprobs[rid] == pytest.approx(base.logprobs[rid], abs=1e-4)
        assert len(got.logprobs[rid]) == len(got.tokens[rid])


def test_seeded_sampling_is_reproducible_with_speculation(tiny_models) -> None:
    path = tiny_models["llama"]
    prompts = {"s": passage(21), "t": passage(22)}
    params = {
        "s": SamplingParams(temperature=0.3, top_k=20, top_p=0.9, seed=7, max_tokens=40),
        "t": SamplingParams(temperature=0.2, min_p=0.05, seed=8, max_tokens=40),
    }
    plain = run(path, prompts, params, None)
    first = run(path, prompts, params, SPEC)
    again = run(path, prompts, params, SPEC, max_num_batched_tokens=9)
    forced = run(path, prompts, params, SPEC, policy=RandomK(4, seed=5))
    # The rejected rows' draws are undone, so each position draws what it would without
    # speculation: the tokens are those of the plain run, whichever steps carry drafts.
    assert first.tokens == again.tokens == forced.tokens == plain.tokens
    assert first.accepted > 0 and forced.accepted > 0
    assert all(len(set(t)) > 1 for t in first.tokens.values())


# --- the draft policy ------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_draft_counts_never_change_greedy_outputs(arch, tiny_models) -> None:
    path = tiny_models[arch]
    prompts = {"copy": passage(51), "rand": prompt_of(52, 6), "long": passage(53) * 2}
    base = run(path, prompts, greedy(40), None, max_num_batched_tokens=16)
    for seed in range(3):
        policy = RandomK(4, seed)
        got = run(path, prompts, greedy(40), SPEC, policy=policy, max_num_batched_tokens=16)
        assert got.tokens == base.tokens
        assert 0 in policy.chosen and max(policy.chosen) == 4


def test_greedy_and_seeded_parity_under_the_shipped_policy(tiny_models) -> None:
    path = tiny_models["llama"]
    prompts = {"copy": passage(61), "rand": prompt_of(62, 6)}
    params = {
        "copy": greedy(40),
        "rand": SamplingParams(temperature=0.5, seed=3, max_tokens=40, ignore_eos=True),
    }
    base = run(path, prompts, params, None)
    got = run(path, prompts, params, SPEC, shipped_policy=True)
    assert got.tokens == base.tokens
    assert got.drafts > 0  # the first decode tries drafts before any step is measured


def test_policy_stops_drafting_when_verification_does_not_pay() -> None:
    policy = DraftPolicy(4)
    assert policy.choose("a", 1, 1.0, 4) == 4  # nothing measured: it tries
    # A verified row costs as much as the plain step; 1 of 4 drafts is accepted.
    for rows in range(1, 6):
        for _ in range(3):
            policy.observe_step(rows, 1e-3 * rows)
    for _ in range(5):
        policy.record("a", 4, 0)
    choices = [policy.choose("a", 1, 1.0, 4) for _ in range(32)]
    # Plain decodes, but every 16th step probes with one draft.
    assert choices == ([0] * 15 + [1]) * 2


def test_policy_drafts_as_far_as_acceptance_pays() -> None:
    policy = DraftPolicy(4)
    # A bandwidth-bound step: each verified row adds 5% to the step.
    for rows in (1, 2, 5):
        policy.observe_step(rows, 1e-3 * (1 + 0.05 * (rows - 1)))
    for _ in range(10):
        policy.record("a", 4, 4)
        policy.record("b", 4, 0)
    assert policy.acceptance("a") > 0.9 and policy.acceptance("b") < 0.2
    assert policy.choose("a", 1, 1.0, 4) == 4
    assert policy.choose("a", 1, 1.0, 2) == 2  # never beyond the room it is given
    assert policy.choose("b", 1, 1.0, 4) in (0, 1)  # a draft is worth 10%, costs 5%
    # Cost in rows the engine has not run is interpolated between measured counts.
    assert policy.step_cost(3) == pytest.approx(1.1e-3)


# --- stops inside an accepted run ------------------------------------------------------


def test_stop_token_max_tokens_and_eos_inside_an_accepted_run(tiny_models) -> None:
    path = tiny_models["llama"]
    prompt = passage(31)
    plain = run(path, {"a": prompt}, greedy(40), None).tokens["a"]
    spec_run = run(path, {"a": prompt}, greedy(40), SPEC)
    assert spec_run.tokens["a"] == plain and spec_run.accepted > 0
    # Every output position as a stop token (first occurrence ends it), and as max_tokens.
    for i in sorted({plain.index(t) for t in plain})[:12]:
        stop = plain[i]
        p = greedy(40, stop_token_ids=[stop])
        got = run(path, {"a": prompt}, p, SPEC)
        assert got.tokens["a"] == plain[: i + 1]
        assert got.finish["a"] == (FinishReason.STOP, stop)
    for n in (1, 2, 3, 5, 8, 13):
        got = run(path, {"a": prompt}, greedy(n), SPEC)
        assert got.tokens["a"] == plain[:n]
        assert got.finish["a"][0] == FinishReason.LENGTH
    # EOS: the model's own; min_tokens holds it back exactly as without speculation.
    eos_params = SamplingParams(temperature=0.0, max_tokens=40, min_tokens=3)
    eos_base = run(path, {"a": prompt}, eos_params, None, max_model_len=60)
    eos_got = run(path, {"a": prompt}, eos_params, SPEC, max_model_len=60)
    assert eos_got.tokens == eos_base.tokens and eos_got.finish == eos_base.finish


def test_max_model_len_inside_an_accepted_run(tiny_models) -> None:
    path = tiny_models["gpt2"]
    prompt = passage(41)
    for max_len in (len(prompt) + 3, len(prompt) + 10):
        base = run(path, {"a": prompt}, greedy(100), None, max_model_len=max_len)
        got = run(path, {"a": prompt}, greedy(100), SPEC, max_model_len=max_len)
        assert got.tokens == base.tokens
        assert len(prompt) + len(got.tokens["a"]) == max_len


class _CountingProposer(NgramProposer):
    """The n-gram proposer, counting the scheduler's ``draft`` calls (draft-model compute)."""

    def __init__(self, cfg: SpeculativeConfig) -> None:
        super().__init__(cfg)
        self.calls = 0

    def draft(self, request_id: str, token_ids: Any, max_tokens: int) -> list[int]:
        self.calls += 1
        return super().draft(request_id, token_ids, max_tokens)


@pytest.mark.parametrize(("num_kv_blocks", "asked"), [(4, 0), (6, 2)])
def test_drafts_are_asked_for_only_when_their_slots_fit(num_kv_blocks: int, asked: int) -> None:
    from .fake_runner import make_core, make_request

    # Two requests of 7 prompt tokens in blocks of 4: after the prefill each holds 2
    # blocks, and its next token fits in them. With 4 blocks in all, no draft slot fits
    # (so drafting would be wasted work); with 6, one more block each does.
    core = make_core(num_kv_blocks=num_kv_blocks, block_size=4, speculative_config=SPEC)
    proposer = _CountingProposer(core.scheduler.config.speculative)
    core.scheduler.proposer = proposer
    for rid in ("a", "b"):
        core.add_request(make_request(rid, [1, 2, 3, 1, 2, 3, 1], max_tokens=8))
    core.step()  # both prefills
    proposer.calls = 0
    batch = core.scheduler.schedule()
    assert proposer.calls == asked
    assert (batch.num_draft_tokens > 0) == (asked > 0)


def test_bf16_decode_plan_greedy_parity_with_any_draft_counts() -> None:
    # The shipped default model in bfloat16 takes the native decode plan: a row's tokens
    # must not depend on how many rows (drafts, other requests) share its step, nor on a
    # step growing past the plan's row limit because of drafts (ops/kernels.c tiles;
    # Scheduler.spec_max_rows).
    from nbengine.model.loader import resolve_model_dir
    from nbengine.ops import native

    if native.kernels() is None:
        pytest.skip(f"native kernels: {native.unavailable_reason()}")
    path = resolve_model_dir(None, None)

    class RandomIds:
        """Drafts of random ids: nearly all rejected, so the row counts vary widely."""

        def __init__(self, seed: int) -> None:
            self.rng = random.Random(seed)

        def draft(self, request_id: str, token_ids: Any, max_tokens: int) -> list[int]:
            return [self.rng.randrange(3, 6144) for _ in range(max_tokens)]

        def forget(self, request_id: str) -> None:
            pass

    prompts = {f"r{i}": prompt_of(70 + i, 20 + 7 * i) for i in range(4)}
    kw: dict[str, Any] = dict(dtype="bfloat16", block_size=16, num_kv_blocks=64)
    base = run(path, prompts, greedy(120), None, **kw)
    for seed in range(2):
        config = EngineConfig.from_kwargs(str(path), speculative_config=SPEC, **kw)
        core = EngineCore(config, ModelRunner)
        core.scheduler.spec_policy = RandomK(4, seed)
        core.scheduler.proposer = RandomIds(seed)
        for i, (rid, prompt) in enumerate(prompts.items()):
            core.add_request(EngineCoreRequest(rid, prompt, greedy(120), arrival_time=float(i)))
        tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
        drafts = 0
        while core.has_unfinished_requests():
            batch = core.step()
            assert batch.step is not None
            drafts += batch.step.spec_draft_tokens
            for out in batch.outputs:
                tokens[out.request_id] += out.new_token_ids
        core.shutdown()
        assert drafts > 0
        assert tokens == base.tokens
