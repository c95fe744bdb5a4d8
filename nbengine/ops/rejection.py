"""Speculative decoding's acceptance rule for one-hot drafts (docs/speculative-decoding.md).

The verifier samples a token ``y_j`` at every drafted position ``j`` exactly as a normal
step would at that prefix (the sampler with the request's own parameters, penalties,
masks and generator, on the request's tokens extended by the drafts before ``j``), and
keeps the longest run where ``y_j`` equals draft ``x_j``, plus the first ``y`` after it:
the correction at the first mismatch, or the bonus token when every draft was accepted.

For an n-gram draft (a point mass on ``x``) this is the rejection sampler of the
speculative sampling papers: the draft is accepted with probability
``min(1, p(x) / q(x)) = p(x)`` (the chance that ``y == x``), and on a rejection the
emitted ``y`` is distributed as ``p`` with ``x`` removed and renormalised (``y`` given
``y != x``), the residual ``max(0, p - q)`` normalised. After k acceptances the bonus
is a plain sample from ``p``. So every emitted token has exactly the distribution of a
normal step at its prefix. Greedy rows are the special case where ``y`` is the argmax.

A seeded request draws one uniform per verified position from its own generator, in
position order; the runner then undoes the rejected positions' draws
(``ModelRunner._rewind_seeded``), so each position draws what its plain step would and
the request's tokens are those of a run without speculation.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["accepted_drafts"]


def accepted_drafts(drafts: Sequence[int], sampled: Sequence[int]) -> int:
    """How many leading ``drafts`` the verifier accepts, given the tokens ``sampled`` at
    the ``len(drafts) + 1`` verified positions (``sampled[j]`` follows ``drafts[:j]``).

    The tokens kept are ``sampled[: m + 1]`` for the returned ``m``: the accepted drafts
    (``sampled[j] == drafts[j]`` for ``j < m``) and the token after them.
    """
    if len(sampled) != len(drafts) + 1:
        raise ValueError(
            f"sampled has {len(sampled)} tokens; {len(drafts) + 1} expected (one per draft, "
            "plus the bonus position)."
        )
    m = 0
    while m < len(drafts) and sampled[m] == drafts[m]:
        m += 1
    return m
