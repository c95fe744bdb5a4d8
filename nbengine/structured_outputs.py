"""Structured outputs: constrain a request's tokens to a JSON schema, regex, choice or grammar.

``StructuredOutputsParams`` (vLLM's name; ``GuidedDecodingParams`` is the older spelling)
says what the output must match; it goes into ``SamplingParams(structured_outputs=...)``.

The grammar engine is llguidance (docs/structured-outputs.md says why). The work is split
so that the engine core never compiles (docs/architecture.md, "Structured outputs"):

- ``GrammarCompiler`` (frontend, on the thread that calls ``generate()``): turns the spec
  into an llguidance grammar, validates it against the tokenizer (a bad schema or regex
  is a ``ValueError`` at the call) and builds the request's ``GrammarMatcher``. Grammars
  are cached by their spec, so repeating a schema costs only the matcher.
- ``GrammarMatcher`` (core): per step the sampler asks it for the allowed-token bitmask
  of its row; the scheduler feeds it each sampled token and finishes the request
  (finish_reason "stop") once the grammar has matched and cannot continue.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    import llguidance

_KINDS = ("json", "regex", "choice", "grammar", "json_object")

INSTALL_HINT = "Structured outputs need the llguidance package: pip install 'nbengine[structured]'."


@dataclass(slots=True, frozen=True)
class StructuredOutputsParams:
    """What a constrained request's output must match; set exactly one of the first five.

    - ``json``: a JSON schema (a dict, or its JSON text); the output is one JSON value
      that validates against it.
    - ``regex``: the output fully matches this regular expression (Rust ``regex`` syntax:
      no look-around or back-references).
    - ``choice``: the output is exactly one of these strings.
    - ``grammar``: a context-free grammar, in Lark syntax (llguidance's) or GBNF/EBNF
      (``root ::= ...``, as llama.cpp and xgrammar write it).
    - ``json_object``: ``True`` for any JSON object.
    - ``disable_any_whitespace``: JSON without optional whitespace (vLLM's option; by
      default the JSON grammar allows flexible whitespace between tokens).
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        set_ = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of json, regex, choice, grammar, "
                f"json_object; got {set_ or 'none'}."
            )
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    parsed = json.loads(self.json)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {exc}.") from None
            elif isinstance(self.json, dict):
                parsed = self.json
                try:
                    object.__setattr__(self, "json", json.loads(json.dumps(self.json)))
                except (TypeError, ValueError) as exc:
                    raise TypeError(
                        f"structured_outputs.json must be JSON-serialisable: {exc}."
                    ) from None
            else:
                raise TypeError(
                    "structured_outputs.json must be a JSON schema (a dict or its JSON text), "
                    f"got {type(self.json).__name__}."
                )
            if not isinstance(parsed, (dict, bool)):
                raise ValueError("structured_outputs.json must be a JSON schema object.")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise TypeError(
                    f"structured_outputs.{name} must be a non-empty string, got {value!r}."
                )
        if self.choice is not None:
            if isinstance(self.choice, (str, bytes)) or not isinstance(self.choice, Sequence):
                raise TypeError("structured_outputs.choice must be a list of strings.")
            if not self.choice:
                raise ValueError("structured_outputs.choice must not be empty.")
            for c in self.choice:
                if not isinstance(c, str) or not c:
                    raise TypeError(
                        f"structured_outputs.choice must hold non-empty strings, got {c!r}."
                    )
            object.__setattr__(self, "choice", list(self.choice))
        if self.json_object is not None and self.json_object is not True:
            raise TypeError(
                f"structured_outputs.json_object must be True or None, got {self.json_object!r}."
            )
        if not isinstance(self.disable_any_whitespace, bool):
            raise TypeError("structured_outputs.disable_any_whitespace must be True or False.")

    @property
    def kind(self) -> str:
        """Which constraint this is: "json", "regex", "choice", "grammar" or "json_object"."""
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    def schema(self) -> Any:
        """The JSON schema as a Python value (``json`` parsed when given as text)."""
        return json.loads(self.json) if isinstance(self.json, str) else self.json

    def cache_key(self) -> str:
        """A canonical text of the spec: equal specs share one compiled grammar (a schema
        given as text and as a dict, in any key order, are the same spec)."""
        value = self.schema() if self.kind == "json" else getattr(self, self.kind)
        return json.dumps([self.kind, value, self.disable_any_whitespace], sort_keys=True)

    def describe(self, width: int = 60) -> str:
        """A short human-readable form, for the dashboard (``json: {"type": ...}``)."""
        value = getattr(self, self.kind)
        text = value if isinstance(value, str) else json.dumps(value, sort_keys=False)
        if self.kind == "json_object":
            text = "any object"
        text = " ".join(str(text).split())
        if len(text) > width:
            text = text[: width - 1] + "…"
        return f"{self.kind}: {text}"


GuidedDecodingParams = StructuredOutputsParams
"""vLLM's older name for ``StructuredOutputsParams``."""


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError as exc:  # pragma: no cover - the dev extra installs it
        raise ImportError(INSTALL_HINT) from exc
    return llguidance


def grammar_text(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar for ``spec`` (not yet validated)."""
    llg = _llguidance()
    matcher = llg.LLMatcher
    ws = {"whitespace_flexible": not spec.disable_any_whitespace}
    kind = spec.kind
    if kind == "json":
        return matcher.grammar_from_json_schema(json.dumps(spec.schema()), defaults=ws)
    if kind == "json_object":
        return matcher.grammar_from_json_schema('{"type": "object"}', defaults=ws)
    if kind == "regex":
        return matcher.grammar_from_regex(spec.regex)
    if kind == "choice":
        assert spec.choice is not None
        alts = " | ".join(json.dumps(c) for c in spec.choice)
        return matcher.grammar_from_lark(f"start: {alts}\n")
    assert spec.grammar is not None
    text = spec.grammar
    if "::=" in text:  # GBNF / EBNF (llama.cpp, xgrammar): converted to Lark
        from llguidance.gbnf_to_lark import gbnf_to_lark

        try:
            text = gbnf_to_lark(text)
        except Exception as exc:
            raise ValueError(
                f"structured_outputs.grammar is not a valid GBNF grammar: {exc}"
            ) from None
    return matcher.grammar_from_lark(text)


class GrammarMatcher:
    """One request's grammar state: the allowed-token mask and the tokens consumed so far.

    Owned by the engine core's ``Request`` once added (one thread at a time).
    """

    __slots__ = ("_m", "kind", "description")

    def __init__(self, matcher: llguidance.LLMatcher, kind: str, description: str) -> None:
        self._m = matcher
        self.kind = kind
        self.description = description

    def fill_bitmask(self, row: torch.Tensor) -> None:
        """Write the allowed tokens into ``row`` (int32, one bit per token)."""
        assert row.dtype == torch.int32 and row.is_contiguous()
        self._m.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)

    def accept(self, token_id: int) -> bool:
        """Consume a sampled token; False if the grammar rejected it."""
        return bool(self._m.consume_token(token_id))

    def is_terminated(self) -> bool:
        """The grammar has matched and cannot continue (or failed): the request ends."""
        return bool(self._m.is_stopped() or self._m.is_error())

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        # Crossing a process (the Ray backend) it arrives as None: the core builds its own.
        return (_no_matcher, ())


def _no_matcher() -> None:
    return None


class GrammarCompiler:
    """Compiles and validates grammars for one tokenizer; caches them by spec (thread-safe).

    ``vocab_size`` is the model's logit width (it may exceed the tokenizer's vocabulary).
    """

    def __init__(
        self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int], cache_size: int = 256
    ) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._lltok: Any = None
        self._cache: OrderedDict[str, str] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def _ll_tokenizer(self) -> Any:
        if self._lltok is None:
            llg = _llguidance()
            backend = getattr(self._tokenizer, "backend", self._tokenizer)
            to_str = getattr(backend, "to_str", None)
            if to_str is None:
                raise ValueError("Structured outputs need a `tokenizers`-based tokenizer.")
            kwargs: dict[str, Any] = {"n_vocab": self.vocab_size}
            if self._eos:
                kwargs["eos_token"] = self._eos if len(self._eos) > 1 else self._eos[0]
            self._lltok = llg.LLTokenizer(to_str(), **kwargs)
        return self._lltok

    def compile(self, spec: StructuredOutputsParams) -> str:
        """The validated grammar for ``spec`` (cached); ValueError naming the problem."""
        key = spec.cache_key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return hit
            tok = self._ll_tokenizer()
        llg = _llguidance()
        try:
            grammar = grammar_text(spec)
        except ValueError as exc:
            raise ValueError(f"structured_outputs.{spec.kind} is invalid: {exc}") from None
        err = llg.LLMatcher.validate_grammar(grammar, tok)
        if err:
            raise ValueError(f"structured_outputs.{spec.kind} is invalid: {err.strip()}")
        with self._lock:
            self.misses += 1
            self._cache[key] = grammar
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return grammar

    def matcher(self, spec: StructuredOutputsParams) -> GrammarMatcher:
        """A fresh matcher for one request (compiles or reuses the grammar)."""
        grammar = self.compile(spec)
        llg = _llguidance()
        m = llg.LLMatcher(self._ll_tokenizer(), grammar, log_level=0)
        if m.is_error():
            raise ValueError(f"structured_outputs.{spec.kind} is invalid: {m.get_error()}")
        return GrammarMatcher(m, spec.kind, spec.describe())


def bitmask_words(vocab_size: int) -> int:
    """int32 words per row of a token bitmask."""
    return (vocab_size + 31) // 32


_BITS = torch.arange(32, dtype=torch.int32)


def apply_bitmask(
    logits: torch.Tensor, rows: Sequence[int] | torch.Tensor, bitmask: torch.Tensor
) -> None:
    """Set to -inf, in place, every logit of ``rows`` whose bit in ``bitmask`` is clear.

    ``rows`` and ``bitmask`` may already be on the logits' device (the runner's device
    path copies them there with the step's other inputs).
    """
    n, vocab = bitmask.shape[0], logits.shape[1]
    bits = (
        _BITS
        if bitmask.device.type == "cpu"
        else torch.arange(32, dtype=torch.int32, device=bitmask.device)
    )
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).view(n, -1)[:, :vocab].bool()
    idx = rows if isinstance(rows, torch.Tensor) else torch.tensor(list(rows), dtype=torch.int64)
    logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))
