"""vLLM's remaining SamplingParams fields, each against its documented behaviour.

Expected behaviour, in our words, from vLLM's documentation and tests:
- bad_words: the listed words never appear as generated token sequences, whether written
  at the start of a word or after a space; a one-token word is never sampled at all.
- allowed_token_ids: every generated token is one of them.
- truncate_prompt_tokens=k: the model sees only the last k prompt tokens.
- logprobs=-1: every position carries the whole vocabulary; the engine's max_logprobs
  (default 20) bounds what a request may ask for, and -1 only fits under max_logprobs=-1.
- logprobs_mode: raw_* report the model's distribution, processed_* the one sampled from.
- detokenize=False: token ids only, empty text.
- extra_args: kept untouched on the params the engine runs with.
- logits_processors: fn(output_ids, logits) -> logits, applied every step.
- prompts as {"prompt": text} or {"prompt_token_ids": ids}.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from conftest import ENGINE_KW

import nbengine as nb
from nbengine import SamplingParams
from nbengine.testing import make_tiny_model

GREEDY = dict(temperature=0, max_tokens=12, ignore_eos=True)


def _gen(engine: nb.Engine, prompt: object, **kw: object) -> nb.CompletionOutput:
    return engine.generate(prompt, SamplingParams(**kw)).result(timeout=300).outputs[0]  # type: ignore[arg-type]


def test_allowed_token_ids_bound_every_token(engine: nb.Engine) -> None:
    allowed = [5, 17, 42, 99]
    for seed in range(5):
        c = _gen(
            engine, "Hello", seed=seed, max_tokens=20, ignore_eos=True, allowed_token_ids=allowed
        )
        assert set(c.token_ids) <= set(allowed)
    c = _gen(engine, "Hello", allowed_token_ids=[7], **GREEDY)
    assert c.token_ids == [7] * 12


def test_bad_words_single_token_is_never_sampled(engine: nb.Engine) -> None:
    free = _gen(engine, "The cat", **GREEDY)
    word = engine.tokenizer.decode([free.token_ids[0]])
    ids = engine._inputs.bad_words_token_ids([word])
    banned = {seq[0] for seq in ids if len(seq) == 1}
    assert banned
    c = _gen(engine, "The cat", bad_words=[word], **GREEDY)
    assert not banned & set(c.token_ids)
    assert c.token_ids != free.token_ids


def test_bad_words_multi_token_sequence_is_cut_before_its_last_token(engine: nb.Engine) -> None:
    free = _gen(engine, "Once upon", max_tokens=16, temperature=0, ignore_eos=True)
    seq = free.token_ids[3:6]  # a three-token span the greedy model produces
    params = SamplingParams(
        temperature=0, max_tokens=16, ignore_eos=True, bad_words_token_ids=[seq]
    )
    out = engine.generate("Once upon", params).result().outputs[0].token_ids
    assert out[:5] == free.token_ids[:5]  # same until the span's last token
    assert out[5] != seq[2]
    for i in range(len(out) - 2):
        assert out[i : i + 3] != seq


def test_bad_words_cover_the_leading_space_form(engine: nb.Engine) -> None:
    tok = engine.tokenizer
    ids = engine._inputs.bad_words_token_ids(["hello"])
    assert tok.encode("hello", add_special_tokens=False) in ids
    spaced = tok.encode(" hello", add_special_tokens=False)
    plain = tok.encode("hello", add_special_tokens=False)
    # vLLM's rule: the spaced form is added when it differs in its first token and has
    # as many tokens.
    assert (spaced in ids) == (spaced[0] != plain[0] and len(spaced) == len(plain))


def test_truncate_prompt_tokens_keeps_the_last_tokens(engine: nb.Engine) -> None:
    ids = list(range(10, 40))
    out = engine.generate(ids, SamplingParams(truncate_prompt_tokens=5, **GREEDY)).result()
    assert out.prompt_token_ids == ids[-5:]
    alone = engine.generate(ids[-5:], SamplingParams(**GREEDY)).result()
    assert out.outputs[0].token_ids == alone.outputs[0].token_ids


def test_logprobs_minus_one_needs_max_logprobs(engine: nb.Engine, tiny_model: Path) -> None:
    with pytest.raises(ValueError, match="max_logprobs"):
        engine.generate("a", SamplingParams(logprobs=-1))
    with pytest.raises(ValueError, match="max_logprobs"):
        engine.generate("a", SamplingParams(logprobs=21))
    assert engine.generate("a", SamplingParams(logprobs=20, max_tokens=2)).result()
    with nb.Engine(str(tiny_model), dtype="float32", max_logprobs=-1, **ENGINE_KW) as eng:
        c = _gen(eng, "a", logprobs=-1, max_tokens=3)
        vocab = eng._vocab_size
        for pos in c.logprobs:
            assert len(pos) == vocab
            assert math.isclose(sum(math.exp(lp.logprob) for lp in pos.values()), 1.0, rel_tol=1e-3)
        out = eng.generate("abc", SamplingParams(prompt_logprobs=-1, max_tokens=1)).result()
        assert all(len(p) == vocab for p in out.prompt_logprobs[1:])


@pytest.mark.parametrize("mode", ["raw_logits", "processed_logprobs", "processed_logits"])
def test_logprobs_mode(tiny_model: Path, mode: str) -> None:
    with nb.Engine(str(tiny_model), dtype="float32", logprobs_mode=mode, **ENGINE_KW) as eng:
        # allowed_token_ids is processing: processed_* see only those tokens.
        c = _gen(eng, "a", logprobs=3, allowed_token_ids=[3, 4], **GREEDY)
        for _tid, pos in zip(c.token_ids, c.logprobs):
            top = {t for t, lp in pos.items() if lp.rank <= 3}
            if mode.startswith("processed"):
                finite = {t for t, lp in pos.items() if lp.logprob > -1e30}  # masked: ~ -inf
                assert finite <= {3, 4}
                if mode == "processed_logprobs":
                    assert (
                        math.isclose(
                            sum(math.exp(pos[t].logprob) for t in finite), 1.0, rel_tol=1e-4
                        )
                        or len(finite) < 2
                    )
            else:
                assert not top <= {3, 4}  # the model's own top tokens
    with pytest.raises(ValueError, match="logprobs_mode"):
        nb.Engine(str(tiny_model), logprobs_mode="cooked", **ENGINE_KW)


def test_raw_logits_are_logits(tiny_model: Path) -> None:
    with nb.Engine(
        str(tiny_model), dtype="float32", logprobs_mode="raw_logits", **ENGINE_KW
    ) as eng:
        c = _gen(eng, "a", logprobs=5, **GREEDY)
        values = [lp.logprob for lp in c.logprobs[0].values()]
        # log-probabilities are all <= 0 and exp-sum to <= 1; logits need not be.
        assert sum(math.exp(v) for v in values) > 1.0 or max(values) > 0


def test_detokenize_false_returns_ids_only(engine: nb.Engine) -> None:
    c = _gen(engine, "Hello", detokenize=False, logprobs=2, **GREEDY)
    ref = _gen(engine, "Hello", **GREEDY)
    assert c.text == "" and c.token_ids == ref.token_ids
    assert all(lp.decoded_token is None for pos in c.logprobs for lp in pos.values())
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(detokenize=False, stop="x")


def test_extra_args_pass_through(engine: nb.Engine) -> None:
    args = {"tenant": "a", "nested": {"k": [1, 2]}}
    params = SamplingParams(extra_args=args, **GREEDY)
    h = engine.generate("x", params)
    h.result()
    assert params.extra_args == args
    assert engine._inputs.prepare("x", params, None, 0).params.extra_args == args


def test_logits_processor_classic_signature(engine: nb.Engine) -> None:
    calls: list[int] = []

    def force_next(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        calls.append(len(output_ids))
        out = torch.full_like(logits, float("-inf"))
        out[(len(output_ids) * 7 + 3) % logits.shape[0]] = 0.0
        return out

    c = _gen(engine, "x", logits_processors=[force_next], max_tokens=6, ignore_eos=True)
    assert c.token_ids == [(i * 7 + 3) for i in range(6)]
    assert calls == list(range(6))

    def three(prompt_ids: list[int], output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        logits[:] = float("-inf")
        logits[prompt_ids[-1]] = 0
        return logits

    c = _gen(engine, [11, 12, 13], logits_processors=[three], max_tokens=3, ignore_eos=True)
    assert c.token_ids == [13, 13, 13]


def test_a_failing_logits_processor_fails_only_its_request(engine: nb.Engine) -> None:
    def boom(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom")

    other = engine.generate("y", SamplingParams(**GREEDY))
    bad = engine.generate("x", SamplingParams(logits_processors=[boom], **GREEDY)).result()
    assert bad.outputs[0].finish_reason == "error"
    assert other.result().outputs[0].finish_reason == "length"
    assert engine.generate("z", SamplingParams(max_tokens=2)).result().finished


def test_prompt_dicts(engine: nb.Engine) -> None:
    a = engine.generate({"prompt": "Hello"}, SamplingParams(**GREEDY)).result()
    b = engine.generate("Hello", SamplingParams(**GREEDY)).result()
    ids = b.prompt_token_ids
    c = engine.generate({"prompt_token_ids": ids}, SamplingParams(**GREEDY)).result()
    assert a.outputs[0].token_ids == b.outputs[0].token_ids == c.outputs[0].token_ids
    with pytest.raises(ValueError, match="prompt"):
        engine.generate({"prompt": "a", "prompt_token_ids": [1]})
    with pytest.raises(TypeError, match="prompt_token_ids"):
        engine.generate({"prompt_token_ids": "abc"})


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(bad_words="abc"), TypeError, "bad_words"),
        (dict(bad_words=["ok", " "]), TypeError, "bad_words"),
        (dict(allowed_token_ids=[]), ValueError, "allowed_token_ids"),
        (dict(allowed_token_ids=[1, -2]), ValueError, "allowed_token_ids"),
        (dict(allowed_token_ids=["a"]), TypeError, "allowed_token_ids"),
        (dict(truncate_prompt_tokens=0), ValueError, "truncate_prompt_tokens"),
        (dict(truncate_prompt_tokens=1.5), TypeError, "truncate_prompt_tokens"),
        (dict(logprobs=-2), ValueError, "logprobs"),
        (dict(detokenize=0), TypeError, "detokenize"),
        (dict(spaces_between_special_tokens="no"), TypeError, "spaces_between_special_tokens"),
        (dict(extra_args=[1]), TypeError, "extra_args"),
        (dict(extra_args={1: 2}), TypeError, "extra_args"),
        (dict(logits_processors=[1]), TypeError, "logits_processors"),
        (dict(logits_processors=[lambda x: x]), TypeError, "logits_processors"),
        (dict(bad_words_token_ids=[[]]), TypeError, "bad_words_token_ids"),
    ],
)
def test_new_fields_are_validated_naming_the_field(kwargs: dict, exc: type, match: str) -> None:
    with pytest.raises(exc, match=match):
        SamplingParams(**kwargs)


def test_out_of_vocab_allowed_token_ids_fail_at_generate(engine: nb.Engine) -> None:
    with pytest.raises(ValueError, match="allowed_token_ids"):
        engine.generate("a", SamplingParams(allowed_token_ids=[10**6]))
    assert engine.num_unfinished_requests() == 0


def test_reset_prefix_cache_and_cache_salt(tiny_model: Path) -> None:
    ids = list(range(1, 70))  # four full blocks of 16
    params = SamplingParams(max_tokens=1)
    with nb.Engine(str(tiny_model), dtype="float32", **ENGINE_KW) as eng:
        first = eng.generate(ids, params).result()
        assert first.num_cached_tokens == 0
        assert eng.generate(ids, params).result().num_cached_tokens == 64
        # Another tenant's salt shares nothing; the same salt shares its own blocks.
        salted = {"prompt_token_ids": ids, "cache_salt": "tenant-a"}
        assert eng.generate(salted, params).result().num_cached_tokens == 0
        assert eng.generate(salted, params).result().num_cached_tokens == 64
        other = {"prompt_token_ids": ids, "cache_salt": "tenant-b"}
        assert eng.generate(other, params).result().num_cached_tokens == 0
        assert eng.reset_prefix_cache() is True
        assert eng.generate(ids, params).result().num_cached_tokens == 0
        # While a request holds blocks the reset is refused and forgets nothing.
        h = eng.generate(ids, SamplingParams(max_tokens=10_000, ignore_eos=True))
        stream = iter(h)  # kept: a dropped stream aborts its request
        next(stream)
        assert eng.reset_prefix_cache() is False
        h.cancel()
        assert eng.generate(ids, params).result().num_cached_tokens == 64
        with pytest.raises(TypeError, match="cache_salt"):
            eng.generate({"prompt": "a", "cache_salt": 3})


@pytest.mark.parametrize(
    "arch, special", [("llama", "</s>"), ("gpt2", "<|endoftext|>"), ("qwen2", "<|im_start|>")]
)
def test_skip_special_tokens_for_every_tokenizer_family(
    tmp_path: Path, arch: str, special: str
) -> None:
    model = make_tiny_model(tmp_path / arch, arch=arch)
    with nb.Engine(str(model), dtype="float32", **ENGINE_KW) as eng:
        sid = eng.tokenizer.backend.token_to_id(special)
        word = eng.tokenizer.encode("the", add_special_tokens=False)[0]
        forced = [word, sid, word]

        def force(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
            out = torch.full_like(logits, float("-inf"))
            out[forced[len(output_ids)]] = 0.0
            return out

        base = dict(max_tokens=3, ignore_eos=True, logits_processors=[force])
        shown = _gen(eng, "a", skip_special_tokens=False, **base)
        hidden = _gen(eng, "a", skip_special_tokens=True, **base)
        assert shown.token_ids == hidden.token_ids == forced
        assert special in shown.text
        assert special not in hidden.text
        assert hidden.text and shown.text.replace(special, "").strip() == hidden.text.strip()
