"""Sampling parameters, with vLLM's field names and meanings.

Every field is validated in ``__post_init__``; an invalid value raises ``ValueError``
(or ``TypeError`` for a wrong type) naming the field, at the call that built it.

``SamplingParams`` is frozen: change a copy with ``params.replace(max_tokens=32)``.
``Engine.generate`` validates the params again and keeps its own copy, so nothing a
caller does to the object (or to a list or dict inside it) afterwards reaches a
running request (docs/lifecycle.md, "What generate() keeps").

Numeric ranges are those the sampler can represent: it computes in float32, so a
value that is finite in Python but overflows float32 (``temperature=1e39``) or rounds
to zero there (``top_p=1e-40``) is refused here, naming the field.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from nbengine.structured_outputs import StructuredOutputsParams
from nbengine.validation import is_int, is_number

_GREEDY_EPS = 1e-5

MAX_N = 1024
"""The most completions one request may ask for (``n``)."""

SEED_MIN = -(2**63)
SEED_MAX = 2**64 - 1
"""``seed`` spans what ``torch.Generator.manual_seed`` takes: signed or unsigned 64 bits."""

FLOAT32_MAX = 3.4028234663852886e38  # the largest finite float32
FLOAT32_TINY = 1.1754943508222875e-38  # the smallest normal float32


LogitsProcessor = Callable[..., Any]
"""A per-request logits processor, vLLM's classic signature:
``fn(output_token_ids: list[int], logits: torch.Tensor) -> torch.Tensor`` or
``fn(prompt_token_ids, output_token_ids, logits) -> torch.Tensor``; ``logits`` is the
row of one request (float32, ``[vocab]``)."""


class RequestOutputKind(enum.Enum):
    """How a streaming request reports its progress."""

    CUMULATIVE = 0  # every output carries all text and tokens so far
    DELTA = 1  # every output carries only what is new since the previous one
    FINAL_ONLY = 2  # a single output, when the request finishes


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """How to sample one completion (or ``n`` of them) for a prompt.

    ``temperature=0`` means greedy decoding. ``seed`` makes sampling reproducible
    whatever else shares the batch. ``stop`` strings are matched on the detokenized
    text and may span token boundaries; ``stop_token_ids`` end the request on a
    sampled token. ``logprobs=k`` returns the top-k log-probabilities plus the
    sampled token's for every output position; ``prompt_logprobs=k`` does the same
    for prompt positions.

    Frozen: ``replace(**changes)`` returns a validated copy with some fields changed.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    stream_interval: int = 1
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None
    detokenize: bool = True
    spaces_between_special_tokens: bool = True
    extra_args: dict[str, Any] | None = None
    logits_processors: list[LogitsProcessor] | None = None
    # The token sequences ``bad_words`` bans; filled in by the engine from its tokenizer.
    bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False)
    # vLLM's older spelling of ``structured_outputs``; moved there by __post_init__.
    guided_decoding: StructuredOutputsParams | None = field(default=None, repr=False, compare=False)
    # Normalised forms, filled in by __post_init__.
    stop_strings: list[str] = field(default_factory=list, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_int("n", self.n, minimum=1)
        if self.n > MAX_N:
            raise ValueError(f"n must be at most {MAX_N}, got {self.n}.")
        _check_float("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        _check_float32("temperature", self.temperature)
        _check_float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        _check_float32("top_p", self.top_p)
        _check_int("top_k", self.top_k)
        if self.top_k < -1:
            raise ValueError(f"top_k must be 0 or -1 (disabled) or at least 1, got {self.top_k}.")
        if self.top_k == -1:
            self._set("top_k", 0)
        _check_float("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.seed is not None:
            _check_int("seed", self.seed)
            if not SEED_MIN <= self.seed <= SEED_MAX:
                raise ValueError(
                    f"seed must be a 64-bit integer (from -2**63 to 2**64 - 1), got {self.seed}."
                )
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens)
            if self.max_tokens < 1:
                raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        _check_int("min_tokens", self.min_tokens, minimum=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                f"got {self.min_tokens}."
            )
        self._set("stop_strings", _normalise_stop(self.stop))
        if isinstance(self.stop, list):
            self._set("stop", list(self.stop))
        if self.stop_token_ids is not None:
            if isinstance(self.stop_token_ids, (str, bytes)) or not isinstance(
                self.stop_token_ids, Sequence
            ):
                raise TypeError("stop_token_ids must be a list of ints.")
            for t in self.stop_token_ids:
                _check_int("stop_token_ids", t, minimum=0)
            self._set("stop_token_ids", list(self.stop_token_ids))
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_float(name, value)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}.")
        _check_float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0.0:
            raise ValueError(
                f"repetition_penalty must be greater than zero, got {self.repetition_penalty}."
            )
        _check_float32("repetition_penalty", self.repetition_penalty)
        if self.logprobs is not None:  # -1: the whole vocabulary (bounded by max_logprobs)
            _check_int("logprobs", self.logprobs, minimum=-1)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, minimum=-1)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise TypeError("logit_bias must be a dict mapping token ids to floats.")
            for tok, bias in self.logit_bias.items():
                _check_int("logit_bias", tok, minimum=0)
                _check_float("logit_bias", bias)
                if abs(bias) > FLOAT32_MAX:
                    raise ValueError(
                        f"logit_bias of token {tok} must be within +-{FLOAT32_MAX:.4g} (float32, "
                        f"which the sampler computes in), got {bias}."
                    )
            self._set("logit_bias", {int(k): float(v) for k, v in self.logit_bias.items()})
        if not isinstance(self.output_kind, RequestOutputKind):
            raise TypeError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}.")
        _check_int("stream_interval", self.stream_interval, minimum=1)
        if self.guided_decoding is not None:
            if self.structured_outputs is not None:
                raise ValueError(
                    "Set structured_outputs or its older spelling guided_decoding, not both."
                )
            self._set("structured_outputs", self.guided_decoding)
            self._set("guided_decoding", None)
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise TypeError(
                "structured_outputs must be a StructuredOutputsParams, got "
                f"{type(self.structured_outputs).__name__}."
            )
        self._check_vllm_fields()
        for name in (
            "ignore_eos",
            "include_stop_str_in_output",
            "skip_special_tokens",
            "detokenize",
            "spaces_between_special_tokens",
        ):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}.")

    def _check_vllm_fields(self) -> None:
        """bad_words, allowed_token_ids, truncate_prompt_tokens, extra_args,
        logits_processors (docs/api.md, "SamplingParams")."""
        if self.bad_words is not None:
            if isinstance(self.bad_words, (str, bytes)) or not isinstance(self.bad_words, Sequence):
                raise TypeError("bad_words must be a list of strings.")
            for w in self.bad_words:
                if not isinstance(w, str) or not w.strip():
                    raise TypeError(f"bad_words must hold non-blank strings, got {w!r}.")
            self._set("bad_words", list(self.bad_words))
        if self.bad_words_token_ids is not None:
            if not isinstance(self.bad_words_token_ids, Sequence):
                raise TypeError("bad_words_token_ids must be a list of lists of token ids.")
            seqs = []
            for seq in self.bad_words_token_ids:
                if not isinstance(seq, Sequence) or not seq:
                    raise TypeError("bad_words_token_ids must hold non-empty lists of token ids.")
                for t in seq:
                    _check_int("bad_words_token_ids", t, minimum=0)
                seqs.append(list(seq))
            self._set("bad_words_token_ids", seqs)
        if self.allowed_token_ids is not None:
            if isinstance(self.allowed_token_ids, (str, bytes)) or not isinstance(
                self.allowed_token_ids, Sequence
            ):
                raise TypeError("allowed_token_ids must be a list of ints.")
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty (no token could be chosen).")
            for t in self.allowed_token_ids:
                _check_int("allowed_token_ids", t, minimum=0)
            self._set("allowed_token_ids", list(self.allowed_token_ids))
        if self.truncate_prompt_tokens is not None:
            _check_int("truncate_prompt_tokens", self.truncate_prompt_tokens)
            if self.truncate_prompt_tokens < 1 and self.truncate_prompt_tokens != -1:
                raise ValueError(
                    "truncate_prompt_tokens must be at least 1, or -1 (keep the last "
                    f"max_model_len tokens), got {self.truncate_prompt_tokens}."
                )
        if not isinstance(self.detokenize, bool):
            raise TypeError(f"detokenize must be True or False, got {self.detokenize!r}.")
        if not self.detokenize and self.stop_strings:
            raise ValueError("stop strings need detokenize=True (they are matched on the text).")
        if self.extra_args is not None:
            if not isinstance(self.extra_args, dict):
                raise TypeError("extra_args must be a dict with string keys.")
            for k in self.extra_args:
                if not isinstance(k, str):
                    raise TypeError(f"extra_args keys must be strings, got {k!r}.")
        if self.logits_processors is not None:
            if not isinstance(self.logits_processors, Sequence):
                raise TypeError("logits_processors must be a list of callables.")
            for fn in self.logits_processors:
                if not callable(fn):
                    raise TypeError(f"logits_processors must hold callables, got {fn!r}.")
                _check_processor_arity(fn)
            self._set("logits_processors", list(self.logits_processors))

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax."""
        return self.temperature < _GREEDY_EPS or self.top_k == 1

    def _set(self, name: str, value: object) -> None:
        """Normalise a field during ``__post_init__`` (the dataclass is frozen after it)."""
        object.__setattr__(self, name, value)

    def replace(self, **changes: Any) -> SamplingParams:
        """A copy with ``changes`` applied, validated like a new instance.

        Lists and dicts are copied too, so the copy shares nothing mutable with ``self``.
        """
        # Logits processors are kept by reference (a callable may hold a model or a lock).
        values: dict[str, Any] = {
            f.name: (
                list(getattr(self, f.name) or []) or None
                if f.name == "logits_processors"
                else copy.deepcopy(getattr(self, f.name))
            )
            for f in dataclasses.fields(self)
            if f.init
        }
        values.update(changes)
        return SamplingParams(**values)

    def clone(self) -> SamplingParams:
        """A validated deep copy (vLLM's name); ``Engine.generate`` keeps one of these."""
        return self.replace()


def processor_arity(fn: LogitsProcessor) -> int:
    """2 for ``fn(output_ids, logits)``, 3 for ``fn(prompt_ids, output_ids, logits)``."""
    try:
        params = [
            p
            for p in inspect.signature(fn).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):  # a builtin without a signature: the classic form
        return 2
    return 3 if len(params) == 3 else 2


def _check_processor_arity(fn: LogitsProcessor) -> None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    positional = [
        p for p in sig.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    varargs = any(p.kind == p.VAR_POSITIONAL for p in sig.parameters.values())
    if not varargs and len(positional) not in (2, 3):
        raise TypeError(
            "logits_processors must take (output_token_ids, logits) or (prompt_token_ids, "
            f"output_token_ids, logits); {fn!r} takes {len(positional)} positional arguments."
        )


def _normalise_stop(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)):
        raise TypeError(f"stop must be a string or a list of strings, got {type(stop).__name__}.")
    for s in stop:
        if not isinstance(s, str):
            raise TypeError(f"stop must contain only strings, got {s!r}.")
        if not s:
            raise ValueError("stop must not contain an empty string.")
    return list(stop)


def _check_int(name: str, value: object, minimum: int | None = None) -> None:
    if not is_int(value):
        raise TypeError(f"{name} must be an int, got {value!r}.")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}.")


def _check_float(name: str, value: object) -> None:
    if not is_number(value):
        raise TypeError(f"{name} must be a number, got {value!r}.")
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"{name} must be finite, got {value}.")


def _check_float32(name: str, value: float) -> None:
    """``value`` (finite, non-negative) keeps its meaning in float32: no overflow, and a
    positive value does not round to zero."""
    if value > FLOAT32_MAX:
        raise ValueError(
            f"{name} must be at most {FLOAT32_MAX:.4g} (the largest float32; the sampler "
            f"computes in float32), got {value}."
        )
    if 0 < value < FLOAT32_TINY:
        raise ValueError(
            f"{name} must be 0 or at least {FLOAT32_TINY:.4g} (smaller values round to zero "
            f"in float32, which the sampler computes in), got {value}."
        )
