"""Speculative decoding seen from the frontend (docs/speculative-decoding.md).

Stop strings inside an accepted run (several tokens in one core output) truncate there:
text, tokens and logprobs as with one token per step; ``step_stats()`` and
``request_stats()`` carry the draft and accepted counts, as do a handle's metrics;
``LLM`` passes ``speculative_config`` through; the abort/re-add race holds with
speculation on (the id is reusable at once, exact counts).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import race_worker
from fe_util import byte_token_ids
from test_output_processor import Harness

import nbengine as nb
from nbengine.core.messages import EngineCoreOutput
from nbengine.model.tokenizer import Tokenizer
from nbengine.outputs import Logprob

from support.scenarios import abort_and_readd_race
from support.spec_policies import always_draft

SPEC = {"method": "ngram", "num_speculative_tokens": 4}
KW = dict(num_kv_blocks=256, block_size=16, max_num_seqs=8, dtype="float32")
# A passage quoted twice: the tiny model's greedy output loops, which lookup also catches.
PROMPT = "Once upon a time there was a cat. Once upon a time there was a cat. Once"


def greedy(n: int = 40, **kw: object) -> nb.SamplingParams:
    return nb.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def engines(tiny_model: Path):
    with nb.Engine(str(tiny_model), **KW) as plain:
        with nb.Engine(str(tiny_model), speculative_config=SPEC, **KW) as spec:
            always_draft(spec)  # drafts on every step, whatever the host's timing
            yield plain, spec


def test_stats_show_drafts_and_accepted_tokens(engines) -> None:
    plain, spec = engines
    ref = plain.generate(PROMPT, greedy()).result()
    h = spec.generate(PROMPT, greedy(), request_id="counted")
    out = h.result()
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    accepted = out.metrics.num_spec_accepted_tokens
    assert accepted > 0
    assert h.snapshot()["num_spec_accepted_tokens"] == accepted
    steps = spec.step_stats()
    assert steps["spec_draft_tokens"].sum() >= steps["spec_accepted_tokens"].sum() > 0
    rows = spec.request_stats()
    row = rows[rows["request_id"] == "counted"].iloc[0]
    assert row["spec_accepted_tokens"] == accepted
    assert plain.step_stats()["spec_draft_tokens"].sum() == 0


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("min_tokens", [0, 5])
def test_stop_string_inside_a_multi_token_step_truncates_there(
    tiny_model: Path, include: bool, min_tokens: int
) -> None:
    """The core delivers an accepted run as one output of several tokens: the stop
    string, text, tokens and logprobs must be those of one token per step."""
    tok = Tokenizer.from_dir(tiny_model)
    ids = byte_token_ids(tok, b"abcdefgcdhij")
    lps = [{t: Logprob(-0.1 * (i + 1), 1)} for i, t in enumerate(ids)]
    params = nb.SamplingParams(
        max_tokens=50, stop="cd", include_stop_str_in_output=include, min_tokens=min_tokens
    )
    finals = []
    for sizes in ([1] * len(ids), [5, 7], [len(ids)], [2, 3, 4, 3]):
        hn = Harness(tok)
        h = hn.add("r", params.replace(logprobs=0))
        at = 0
        for n in sizes:
            out = EngineCoreOutput("r#0", ids[at : at + n], new_logprobs=lps[at : at + n])
            hn.step([out])
            at += n
        hn.step(finished=["r#0"])  # the core confirms the stop string's abort
        comp = h.result(timeout=0).outputs[0]
        finals.append((comp.text, comp.stop_reason, comp.token_ids, comp.logprobs))
    assert finals[0][1] == "cd"
    assert finals[0][0] == ("abcdefgcd" if min_tokens else "abcd")[: None if include else -2]
    assert all(f == finals[0] for f in finals), finals


def test_stop_strings_agree_with_and_without_speculation(engines) -> None:
    plain, spec = engines
    text = plain.generate(PROMPT, greedy(80)).result().outputs[0].text
    for stop in {text[i : i + 2] for i in range(20, 60, 7)}:
        params = greedy(80, stop=[stop], logprobs=1)
        want = plain.generate(PROMPT, params).result().outputs[0]
        got = spec.generate(PROMPT, params).result().outputs[0]
        assert (got.text, got.stop_reason, got.token_ids) == (
            want.text,
            want.stop_reason,
            want.token_ids,
        )
        assert got.logprobs is not None and want.logprobs is not None
        assert [sorted(p) for p in got.logprobs] == [sorted(p) for p in want.logprobs]


def test_llm_passes_speculative_config_through(tiny_model: Path) -> None:
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        nb.LLM(str(tiny_model), speculative_config={"method": "ngram"})
    with nb.LLM(str(tiny_model), speculative_config=SPEC, **KW) as llm:
        assert llm.engine.config.speculative.num_speculative_tokens == 4
        always_draft(llm.engine)
        out = llm.generate([PROMPT], greedy(), use_tqdm=False)[0]
        assert out.metrics is not None and out.metrics.num_spec_accepted_tokens > 0


def test_abort_and_readd_race_with_speculation(engines) -> None:
    _, spec = engines
    abort_and_readd_race(spec, "spec-race", rounds=10)
    core = spec._core
    assert core.scheduler.kv.num_free_blocks == core.scheduler.kv.num_blocks


def test_race_reproducer_with_speculation(tiny_model: Path) -> None:
    for _ in range(3):
        _, n, old, new = race_worker.run_race(str(tiny_model), speculative_config=SPEC)
        assert (n, old, new) == (3, "abort", "length")
