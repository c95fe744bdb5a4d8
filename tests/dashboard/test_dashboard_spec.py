"""The dashboard shows speculative decoding's draft acceptance rate
(docs/speculative-decoding.md), and nothing about it when speculation is off."""

from __future__ import annotations

from collections.abc import Callable

import nbengine as nb

from support.requests import wait_until

KW = dict(num_kv_blocks=256, block_size=16, max_num_seqs=4, dtype="float32")
PROMPT = "Once upon a time there was a cat. Once upon a time there was a cat. Once"


def test_kv_label_shows_the_draft_acceptance_rate(make_engine: Callable[..., nb.Engine]) -> None:
    spec = make_engine(speculative_config={"method": "ngram", "num_speculative_tokens": 4}, **KW)
    dash = spec.dashboard()
    params = nb.SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    spec.generate(PROMPT, params).result()
    steps = spec.step_stats()
    drafted, accepted = steps["spec_draft_tokens"].sum(), steps["spec_accepted_tokens"].sum()
    assert drafted > 0
    want = f"draft acceptance {100 * accepted / drafted:.0f}%"
    wait_until(lambda: want in dash.kv_label.value, what=want)

    plain = make_engine(**KW)
    dash2 = plain.dashboard()
    plain.generate(PROMPT, params).result()
    wait_until(lambda: "prefix-cache hit rate" in dash2.kv_label.value, what="the KV label")
    assert "draft acceptance" not in dash2.kv_label.value
