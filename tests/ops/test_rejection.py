"""Speculative decoding's acceptance sampler keeps the target distribution.

On a vocabulary of 5 tokens, a one-hot draft ``x`` is verified thousands of times with
the sampler as the runner calls it (one row per verified position, each row's request
seeing the drafts before it: core/spec_decode.py ``prefix_view``). The first emitted
token must follow the target ``p`` (chi-square), the draft must be accepted with
probability ``p(x)``, and the token after an accepted draft must follow the target at
that longer prefix, penalties included. Fixed seeds: the counts are the same every run.
"""

from __future__ import annotations

import pytest
import torch

from nbengine.core.request import Request
from nbengine.core.spec_decode import prefix_view
from nbengine.ops.rejection import accepted_drafts
from nbengine.ops.sampling import Sampler
from nbengine.sampling_params import SamplingParams

V = 5
TRIALS = 4000
# chi-square critical values at alpha = 0.001 by degrees of freedom
CHI2_CRIT = {3: 16.27, 4: 18.47}


def chi_square(counts: list[int], probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic over the tokens of non-zero probability, and its dof."""
    n = sum(counts)
    stat, cells = 0.0, 0
    for c, p in zip(counts, probs.tolist()):
        if p <= 0:
            assert c == 0, "a token of zero probability was emitted"
            continue
        expected = n * p
        stat += (c - expected) ** 2 / expected
        cells += 1
    return stat, cells - 1


def make_request(params: SamplingParams, output: list[int]) -> Request:
    return Request(
        request_id="r",
        prompt_token_ids=[0, 1],
        sampling_params=params,
        eos_token_ids=frozenset(),
        arrival_time=0.0,
        output_token_ids=list(output),
        all_token_ids=[0, 1, *output],
    )


LOGITS0 = torch.tensor([1.0, 0.2, -0.5, 0.6, 0.0])
LOGITS1 = torch.tensor([0.3, -0.2, 0.9, 0.1, -1.0])


@pytest.mark.parametrize(
    ("params", "target0", "target1"),
    [
        (
            SamplingParams(temperature=1.0, seed=11),
            LOGITS0.softmax(-1),
            LOGITS1.softmax(-1),
        ),
        (
            # Temperature, top-k and a presence penalty: the bonus position's target sees
            # the accepted draft (token 3) in the output.
            SamplingParams(temperature=0.8, top_k=4, presence_penalty=0.7, seed=12),
            None,
            None,
        ),
    ],
)
def test_accepted_and_emitted_tokens_follow_the_target(params, target0, target1) -> None:
    draft = 3
    if target0 is None:
        # The processed targets, computed independently: top-4 of (logits - penalty) / T.
        def processed(logits: torch.Tensor, present: list[int]) -> torch.Tensor:
            x = logits.clone()
            for t in set(present):
                x[t] -= params.presence_penalty
            x = x / params.temperature
            keep = x.topk(params.top_k).indices
            out = torch.full_like(x, float("-inf"))
            out[keep] = x[keep]
            return out.softmax(-1)

        target0 = processed(LOGITS0, [4])
        target1 = processed(LOGITS1, [4, draft])
    sampler = Sampler(seed=0)
    req = make_request(params, [4])
    req.generator = torch.Generator().manual_seed(params.seed)
    logits = torch.stack([LOGITS0, LOGITS1])
    first = [0] * V
    bonus = [0] * V
    accepted = 0
    for _ in range(TRIALS):
        views = [req, prefix_view(req, [draft])]
        tokens, _ = sampler(logits.clone(), views)
        m = accepted_drafts([draft], tokens)
        kept = tokens[: m + 1]
        first[kept[0]] += 1
        if m == 1:
            accepted += 1
            bonus[kept[1]] += 1
    stat, dof = chi_square(first, target0)
    assert stat < CHI2_CRIT[dof], (first, target0)
    # Acceptance probability p(x): within 4 standard deviations of the binomial.
    p_x = float(target0[draft])
    sd = (TRIALS * p_x * (1 - p_x)) ** 0.5
    assert abs(accepted - TRIALS * p_x) < 4 * sd
    stat, dof = chi_square(bonus, target1)
    assert stat < CHI2_CRIT[dof], (bonus, target1)


def test_greedy_rows_accept_while_the_argmax_matches() -> None:
    assert accepted_drafts([5, 6, 7], [5, 6, 9, 1]) == 2
    assert accepted_drafts([5, 6, 7], [5, 6, 7, 1]) == 3
    assert accepted_drafts([5], [4, 5]) == 0
    assert accepted_drafts([], [4]) == 0
    with pytest.raises(ValueError, match="sampled"):
        accepted_drafts([5, 6], [5, 6])
