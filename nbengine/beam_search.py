"""Beam search, as vLLM's ``LLM.beam_search``: ``BeamSearchParams`` in, ``BeamSearchOutput`` out.

Built on ``Engine.generate`` like vLLM's: each step asks for one token with
``logprobs=2 * beam_width`` for every live beam of every prompt (all at once, so they
batch; the prefix cache makes each beam's prompt nearly free), extends every beam by each
of its candidate tokens, moves candidates that end in EOS to the finished set (unless
``ignore_eos``), and keeps the ``beam_width`` best of the rest. At the end the finished
and live beams are ranked by ``cum_logprob / len(tokens) ** length_penalty`` (the EOS
token not counted) and the best ``beam_width`` are returned, best first.

Without EOS in the way this is the same search as transformers' ``num_beams`` beam
search (the best ``2 * beam_width`` extensions over all beams, the best ``beam_width``
kept); tests/structured/test_beam_search.py checks the sequences against it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from nbengine.outputs import PositionLogprobs
from nbengine.sampling_params import SamplingParams, _check_float, _check_int

if TYPE_CHECKING:
    from nbengine.frontend.engine import Engine


@dataclass(slots=True, frozen=True)
class BeamSearchParams:
    """vLLM's beam-search parameters.

    ``beam_width`` beams are kept per prompt; each grows by at most ``max_tokens``
    tokens. ``temperature`` scales the logits whose log-probabilities rank the beams
    (0 or 1: the model's own). ``length_penalty`` divides a finished beam's cumulative
    logprob by its length to that power. ``ignore_eos`` keeps beams going past EOS.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        _check_int("beam_width", self.beam_width, minimum=1)
        _check_int("max_tokens", self.max_tokens, minimum=1)
        _check_float("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        _check_float("length_penalty", self.length_penalty)
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}.")


@dataclass(slots=True)
class BeamSearchSequence:
    """One beam: prompt + generated ``tokens``, per-step logprobs, score and text."""

    tokens: list[int]
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass(slots=True)
class BeamSearchOutput:
    """The best ``beam_width`` sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def beam_search_score(
    tokens: Sequence[int], cum_logprob: float, eos_token_ids: frozenset[int], length_penalty: float
) -> float:
    """``cum_logprob / len ** length_penalty``; a final EOS is not counted in the length."""
    n = len(tokens)
    if n and tokens[-1] in eos_token_ids:
        n -= 1
    return cum_logprob / (max(n, 1) ** length_penalty)


def beam_search(
    engine: Engine, prompts: Sequence[Any], params: BeamSearchParams
) -> list[BeamSearchOutput]:
    """Run beam search for every prompt (text, token ids, or a prompt dict)."""
    if not isinstance(params, BeamSearchParams):
        raise TypeError(f"params must be a BeamSearchParams, got {type(params).__name__}.")
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    width = params.beam_width
    max_lp = engine.config.model.max_logprobs
    if max_lp != -1 and 2 * width > max_lp:
        raise ValueError(
            f"beam_width={width} needs {2 * width} logprobs per step, more than "
            f"the engine's max_logprobs={max_lp}."
        )
    eos = engine.eos_token_ids
    step_params = SamplingParams(
        logprobs=2 * width, max_tokens=1, temperature=params.temperature, detokenize=False
    )
    # Validate and tokenize every prompt first: a bad one leaves nothing running.
    prompt_ids = [engine.encode_prompt(p, step_params) for p in prompts]
    beams = [[BeamSearchSequence(tokens=list(ids))] for ids in prompt_ids]
    finished: list[list[BeamSearchSequence]] = [[] for _ in prompts]

    def score(b: BeamSearchSequence) -> float:
        return beam_search_score(b.tokens, b.cum_logprob, eos, params.length_penalty)

    for _ in range(params.max_tokens):
        live = [(i, b) for i, bs in enumerate(beams) for b in bs]
        if not live:
            break
        handles = [engine.generate(b.tokens, step_params) for _, b in live]
        candidates: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        for (i, beam), h in zip(live, handles):
            out = h.result().outputs[0]
            assert out.logprobs is not None
            for tok, lp in out.logprobs[0].items():
                new = BeamSearchSequence(
                    tokens=beam.tokens + [tok],
                    logprobs=beam.logprobs + [out.logprobs[0]],
                    cum_logprob=beam.cum_logprob + lp.logprob,
                )
                if tok in eos and not params.ignore_eos:
                    new.finish_reason, new.stop_reason = "stop", None
                    finished[i].append(new)
                else:
                    candidates[i].append(new)
        beams = [sorted(c, key=score, reverse=True)[:width] for c in candidates]

    outputs: list[BeamSearchOutput] = []
    tok = engine.tokenizer
    for i, ids in enumerate(prompt_ids):
        for b in beams[i]:
            b.finish_reason = "length"
        best = sorted(finished[i] + beams[i], key=score, reverse=True)[:width]
        for b in best:
            gen = b.tokens[len(ids) :]
            if b.finish_reason == "stop" and not params.include_stop_str_in_output:
                gen = gen[:-1]
            b.text = tok.decode(b.tokens[: len(ids)] + gen, skip_special_tokens=True)
        outputs.append(BeamSearchOutput(sequences=best))
    return outputs
