"""The sampler: every SamplingParams field changes the sampled tokens as vLLM's does."""

from __future__ import annotations

import math

import pytest
import torch

from nbengine.core.request import Request
from nbengine.ops.sampling import Sampler
from nbengine.sampling_params import SamplingParams

V = 16
EOS = 15


def _req(
    params: SamplingParams,
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    key: str = "r",
) -> Request:
    r = Request(key, list(prompt or [1, 2]), params, frozenset({EOS}), 0.0)
    for t in output or []:
        r.append_output_token(t)
    return r


def _probs_logits(probs: list[float]) -> torch.Tensor:
    p = torch.tensor(probs + [1e-9] * (V - len(probs)))
    return (p / p.sum()).log()


def _draw(params: SamplingParams, logits: torch.Tensor, n: int = 400, seed: int = 0) -> list[int]:
    s = Sampler(seed)
    reqs = [_req(params, key=str(i)) for i in range(n)]
    toks, _ = s(logits.expand(n, V).clone(), reqs)
    return toks


def test_greedy_takes_argmax_for_every_row() -> None:
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(0))
    toks, lps = Sampler(0)(
        logits, [_req(SamplingParams(temperature=0), key=str(i)) for i in range(5)]
    )
    assert toks == logits.argmax(-1).tolist() and lps == [None] * 5


def test_sampling_follows_the_distribution_and_temperature_flattens_it() -> None:
    logits = _probs_logits([0.6, 0.3, 0.1])
    toks = _draw(SamplingParams(temperature=1.0), logits, n=2000)
    freq = [toks.count(i) / len(toks) for i in range(3)]
    assert abs(freq[0] - 0.6) < 0.05 and abs(freq[1] - 0.3) < 0.05 and abs(freq[2] - 0.1) < 0.04
    cold = _draw(SamplingParams(temperature=0.2), logits, n=2000)
    hot = _draw(SamplingParams(temperature=3.0), logits, n=2000)
    assert cold.count(0) > 0.95 * len(cold)
    assert hot.count(0) < 0.5 * len(hot) and len(set(hot)) > 3  # the tail gets mass too


def test_top_k_keeps_only_the_k_most_likely() -> None:
    logits = _probs_logits([0.3, 0.25, 0.2, 0.15, 0.1])
    assert set(_draw(SamplingParams(top_k=2), logits)) == {0, 1}
    assert len(set(_draw(SamplingParams(top_k=0), logits))) >= 5


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    logits = _probs_logits([0.5, 0.3, 0.1, 0.05, 0.05])
    assert set(_draw(SamplingParams(top_p=0.75), logits)) == {0, 1}
    assert set(_draw(SamplingParams(top_p=0.85), logits)) == {0, 1, 2}
    assert set(_draw(SamplingParams(top_p=0.4), logits)) == {0}


def test_min_p_drops_tokens_below_fraction_of_max() -> None:
    logits = _probs_logits([0.4, 0.3, 0.15, 0.1, 0.05])
    assert set(_draw(SamplingParams(min_p=0.5), logits)) == {0, 1}
    assert set(_draw(SamplingParams(min_p=0.3), logits)) == {0, 1, 2}


def test_seeded_rows_do_not_depend_on_the_batch() -> None:
    logits = _probs_logits([0.2] * 5)
    params = SamplingParams(temperature=1.0, seed=1234)

    def run(batch_extra: int, global_seed: int) -> list[int]:
        s = Sampler(global_seed)
        mine = _req(params, key="mine")
        others = [
            _req(SamplingParams(temperature=1.0, seed=(7 if i % 2 else None)), key=f"o{i}")
            for i in range(batch_extra)
        ]
        out = []
        for _ in range(12):
            reqs = others + [mine] + others[:1]
            toks, _ = s(logits.expand(len(reqs), V).clone(), reqs)
            out.append(toks[len(others)])
        return out

    alone = run(0, 0)
    assert run(5, 99) == alone
    assert len(set(alone)) > 1
    other_seed = SamplingParams(temperature=1.0, seed=4321)
    s = Sampler(0)
    r = _req(other_seed)
    assert [s(logits[None].clone(), [r])[0][0] for _ in range(12)] != alone


def test_presence_and_frequency_penalties_use_output_tokens_only() -> None:
    logits = torch.zeros(V)
    logits[3], logits[4], logits[5] = 3.0, 2.5, 2.0
    greedy = dict(temperature=0.0)
    # Token 3 in the prompt only: presence/frequency do not touch it.
    r = _req(SamplingParams(presence_penalty=1.0, **greedy), prompt=[3, 3])
    assert Sampler()(logits[None].clone(), [r])[0] == [3]
    r = _req(SamplingParams(presence_penalty=1.0, **greedy), output=[3])
    assert Sampler()(logits[None].clone(), [r])[0] == [4]
    # Frequency scales with the count: one 3 -> 3 - 0.4 = 2.6 > 2.5; two -> 2.2 < 2.5.
    r1 = _req(SamplingParams(frequency_penalty=0.4, **greedy), output=[3])
    r2 = _req(SamplingParams(frequency_penalty=0.4, **greedy), output=[3, 3])
    assert Sampler()(logits.expand(2, V).clone(), [r1, r2])[0] == [3, 4]


def test_repetition_penalty_covers_prompt_and_divides_or_multiplies() -> None:
    logits = torch.zeros(V)
    logits[3], logits[4] = 3.0, 2.0
    logits[6], logits[7] = -1.0, -1.5
    r = _req(SamplingParams(temperature=0, repetition_penalty=2.0), prompt=[3])
    assert Sampler()(logits[None].clone(), [r])[0] == [4]  # 3/2 = 1.5 < 2
    # Negative logits are multiplied: with everything else masked, 7 (-1.5) beats 6 (-2).
    only_neg = torch.full((V,), -100.0)
    only_neg[6], only_neg[7] = -1.0, -1.5
    r = _req(SamplingParams(temperature=0, repetition_penalty=2.0), prompt=[6])
    assert Sampler()(only_neg[None].clone(), [r])[0] == [7]


def test_logit_bias_forces_or_bans_tokens() -> None:
    logits = torch.randn(V, generator=torch.Generator().manual_seed(3))
    best = int(logits.argmax())
    r = _req(SamplingParams(temperature=0, logit_bias={9: 100.0}))
    assert Sampler()(logits[None].clone(), [r])[0] == [9]
    r = _req(SamplingParams(temperature=0, logit_bias={best: -100.0}))
    assert Sampler()(logits[None].clone(), [r])[0] != [best]


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    logits = torch.zeros(V)
    logits[EOS], logits[8], logits[2] = 5.0, 4.0, 3.0
    p = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[8])
    assert Sampler()(logits[None].clone(), [_req(p, output=[1])])[0] == [2]
    assert Sampler()(logits[None].clone(), [_req(p, output=[1, 1])])[0] == [EOS]
    # ignore_eos: EOS is not a stop token then, so it stays available; stop ids are still masked.
    p = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[8], ignore_eos=True)
    assert Sampler()(logits[None].clone(), [_req(p)])[0] == [EOS]


def test_logprobs_are_raw_topk_with_ranks() -> None:
    logits = torch.randn(V, generator=torch.Generator().manual_seed(4))
    raw = logits.log_softmax(-1)
    order = raw.argsort(descending=True).tolist()
    # Temperature and penalties do not change the reported (raw) logprobs.
    p = SamplingParams(temperature=0.7, logprobs=3, seed=5, presence_penalty=1.0)
    toks, lps = Sampler()(logits[None].clone(), [_req(p, output=[order[0]])])
    d = lps[0]
    assert d is not None and toks[0] in d
    for rank, t in enumerate(order[:3], start=1):
        assert d[t].rank == rank and math.isclose(d[t].logprob, float(raw[t]), abs_tol=1e-6)
    assert d[toks[0]].rank == order.index(toks[0]) + 1
    assert len(d) in (3, 4)
    # logprobs=0: only the sampled token.
    toks, lps = Sampler()(logits[None].clone(), [_req(SamplingParams(temperature=0, logprobs=0))])
    assert list(lps[0]) == toks and lps[0][toks[0]].rank == 1


@pytest.mark.parametrize("seed", [0, 1])
def test_mixed_batch_greedy_rows_unaffected_by_random_rows(seed: int) -> None:
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(seed))
    reqs = [
        _req(SamplingParams(temperature=0), key="g0"),
        _req(SamplingParams(top_p=0.9), key="r1"),
        _req(SamplingParams(temperature=0), key="g2"),
        _req(SamplingParams(top_k=3), key="r3"),
    ]
    toks, _ = Sampler(seed)(logits.clone(), reqs)
    assert toks[0] == int(logits[0].argmax()) and toks[2] == int(logits[2].argmax())
    assert toks[3] in logits[3].topk(3).indices.tolist()


@pytest.mark.parametrize("peaked", [False, True])
def test_candidate_tiers_equal_full_sort(peaked: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    import nbengine.ops.sampling as sampling

    g = torch.Generator().manual_seed(11)
    vocab, n = 5000, 120
    logits = torch.randn(n, vocab, generator=g) * (4.0 if peaked else 1.0)
    params = [
        SamplingParams(
            top_p=[0.5, 0.9, 1.0][i % 3], top_k=[0, 5, 300, 3000][i % 4], temperature=0.9
        )
        for i in range(n)
    ]
    u = torch.rand(n, generator=g)
    fast = sampling._sample_rows(logits, params, u)
    monkeypatch.setattr(sampling, "_CANDIDATE_TIERS", ())
    full = sampling._sample_rows(logits, params, u)
    assert fast == full
    for p, row, t in zip(params, logits, fast):
        if p.top_k:
            assert t in row.topk(p.top_k).indices.tolist()
