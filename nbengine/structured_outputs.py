"""Structured outputs: constrain a request's tokens to a JSON schema, regex, choice or grammar.

``StructuredOutputsParams`` (vLLM's name; ``GuidedDecodingParams`` is the older spelling)
says what the output must match; it goes into ``SamplingParams(structured_outputs=...)``.

The grammar engine is llguidance (docs/structured-outputs.md says why). The work is split
so that the engine core never compiles (docs/architecture.md, "Structured outputs"):

- ``GrammarCompiler`` (frontend, on the thread that calls ``generate()``): turns the spec
  into an llguidance grammar, builds it against the tokenizer under ``GRAMMAR_LIMITS``,
  computes its first token mask (which builds the lexer) and walks its first
  ``PROBE_STEPS`` tokens: a bad schema or regex, a grammar that no output can satisfy,
  or one over a limit is a ``ValueError`` at the call. The built matcher is cached by
  its spec; each request gets a copy of it, so repeating a schema costs a copy.
- ``GrammarMatcher`` (core): per step the sampler asks it for the allowed-token bitmask
  of its row (llguidance bounds that step's work by ``GRAMMAR_LIMITS``); the scheduler
  feeds it each sampled token and finishes the request (finish_reason "stop") once the
  grammar has matched and cannot continue, or in error (finish_reason "error", with the
  grammar engine's message) if the grammar engine failed.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    import llguidance

_KINDS = ("json", "regex", "choice", "grammar", "json_object")

BOUNDED_WHITESPACE = r"(?: |\n[ \t]{0,8})?"
"""The whitespace a JSON grammar allows between two tokens by default: nothing, one space,
or one newline and an indent of at most 8 spaces or tabs (compact or pretty-printed
JSON). Free whitespace (``any_whitespace=True``) lets a small model spend its whole
budget on blank runs (docs/structured-outputs.md, "Whitespace")."""

MAX_SCHEMA_DEPTH = 100
"""The deepest nesting of objects and arrays a JSON schema may have (the grammar engine
reads at most 124 levels)."""

PROBE_STEPS = 4
"""Tokens of each new grammar walked at compile time, on the caller's thread: the first
masks are where a lexer blows up or an unsatisfiable grammar fails."""

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

    Whitespace between the tokens of JSON (``json``, ``json_object``): by default one
    space, or one newline and an indent of up to 8 (``BOUNDED_WHITESPACE``), so compact
    and pretty-printed JSON both fit and a model cannot drift into endless blank runs.

    - ``disable_any_whitespace``: ``True`` for JSON with no optional whitespace at all
      (vLLM's option).
    - ``any_whitespace``: ``True`` for any run of spaces, tabs and newlines between
      tokens (vLLM's default, named after its ``disable_any_whitespace``).

    A schema's own ``"x-guidance"`` whitespace settings (llguidance's
    ``whitespace_flexible`` / ``whitespace_pattern``), if it has any, win over both.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    any_whitespace: bool = False

    def __post_init__(self) -> None:
        set_ = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of json, regex, choice, grammar, "
                f"json_object; got {set_ or 'none'}."
            )
        if self.json is not None:
            parsed = _checked_schema(self.json)
            if isinstance(self.json, dict):  # a private copy, in plain JSON types
                object.__setattr__(self, "json", parsed)
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
        for name in ("disable_any_whitespace", "any_whitespace"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"structured_outputs.{name} must be True or False.")
        if self.disable_any_whitespace and self.any_whitespace:
            raise ValueError(
                "structured_outputs: set disable_any_whitespace (no whitespace) or "
                "any_whitespace (free whitespace), not both."
            )

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
        return json.dumps(
            [self.kind, value, self.disable_any_whitespace, self.any_whitespace], sort_keys=True
        )

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


def _too_deep(depth: int | str) -> ValueError:
    return ValueError(
        f"structured_outputs.json is nested {depth} levels deep; at most {MAX_SCHEMA_DEPTH} "
        "levels of objects and arrays are supported."
    )


def _checked_schema(value: object) -> Any:
    """``value`` (a schema dict or its JSON text) as plain JSON values, or the error.

    Depth is measured without recursion before anything recursive (``json``) sees the
    value, so a schema nested thousands deep is a ValueError, not a RecursionError.
    """
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except RecursionError:
            raise _too_deep(_text_depth(value)) from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"structured_outputs.json is not valid JSON: {exc}.") from None
    elif isinstance(value, dict):
        parsed = value
    else:
        raise TypeError(
            "structured_outputs.json must be a JSON schema (a dict or its JSON text), "
            f"got {type(value).__name__}."
        )
    depth = _nesting_depth(parsed)
    if depth > MAX_SCHEMA_DEPTH:
        raise _too_deep(depth)
    if isinstance(value, dict):
        try:
            parsed = json.loads(json.dumps(value))
        except (TypeError, ValueError) as exc:
            raise TypeError(f"structured_outputs.json must be JSON-serialisable: {exc}.") from None
    if not isinstance(parsed, (dict, bool)):
        raise ValueError("structured_outputs.json must be a JSON schema object.")
    return parsed


def _nesting_depth(value: object) -> int:
    """How deep dicts and lists nest in ``value`` (1 for a flat dict), iteratively.

    A container that holds itself is a ValueError (JSON cannot express it).
    """
    if not isinstance(value, (dict, list)):
        return 0
    deepest = 0
    on_path: set[int] = set()  # ids of the containers enclosing the one being visited
    stack: list[tuple[object, int, bool]] = [(value, 1, False)]
    while stack:
        node, depth, leaving = stack.pop()
        if leaving:
            on_path.discard(id(node))
            continue
        if id(node) in on_path:
            raise ValueError("structured_outputs.json contains itself (a cycle of dicts or lists).")
        deepest = max(deepest, depth)
        on_path.add(id(node))
        stack.append((node, depth, True))
        children = node.values() if isinstance(node, dict) else node
        assert isinstance(children, Iterable)
        stack.extend((c, depth + 1, False) for c in children if isinstance(c, (dict, list)))
    return deepest


def _text_depth(text: str) -> int:
    """How deep brackets nest in JSON text, outside its strings."""
    depth = deepest = 0
    for m in re.finditer(r'"(?:[^"\\]|\\.)*"|[\[{]|[\]}]', text):
        bracket = m.group()
        if bracket in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif bracket in "]}":
            depth -= 1
    return deepest


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError as exc:  # pragma: no cover - the dev extra installs it
        raise ImportError(INSTALL_HINT) from exc
    return llguidance


def _whitespace_options(spec: StructuredOutputsParams, schema: Any) -> dict[str, Any]:
    """llguidance's JSON whitespace options for ``spec`` (docs/structured-outputs.md)."""
    own = schema.get("x-guidance") if isinstance(schema, dict) else None
    if isinstance(own, dict) and {"whitespace_flexible", "whitespace_pattern"} & set(own):
        return {}  # the schema's own settings apply
    if spec.disable_any_whitespace:
        return {"whitespace_flexible": False}
    if spec.any_whitespace:
        return {"whitespace_flexible": True}
    return {"whitespace_pattern": BOUNDED_WHITESPACE}


def grammar_text(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar for ``spec`` (not yet validated)."""
    llg = _llguidance()
    matcher = llg.LLMatcher
    kind = spec.kind
    if kind in ("json", "json_object"):
        schema = spec.schema() if kind == "json" else {"type": "object"}
        ws = _whitespace_options(spec, schema)
        return matcher.grammar_from_json_schema(json.dumps(schema), defaults=ws)
    if kind == "regex":
        return matcher.grammar_from_regex(spec.regex)
    if kind == "choice":
        assert spec.choice is not None
        # One lexeme (a terminal) of all the choices: the lexer matches it, so the
        # grammar engine's cap on alternatives in one parser row (max_items_in_row)
        # does not apply, and thousands of choices work.
        alts = " | ".join(json.dumps(c) for c in spec.choice)
        return matcher.grammar_from_lark(f"start: CHOICE\nCHOICE: {alts}\n")
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


GRAMMAR_LIMITS: dict[str, int] = {
    "max_items_in_row": 2000,  # alternatives alive in one parser row
    "initial_lexer_fuel": 1_000_000,  # building the lexer (grammar size)
    "step_lexer_fuel": 200_000,  # lexer work in one mask step
    "step_max_items": 50_000,  # parser items in one mask step
    "max_lexer_states": 250_000,  # lexer states (memory)
    "max_grammar_size": 500_000,  # symbols in the grammar
}
"""llguidance's limits by name (its defaults); ``grammar_error`` names the one an error
hit."""


def grammar_limits() -> llguidance.LLParserLimits:
    """The grammar engine's resource limits, for every matcher nbengine builds.

    llguidance's defaults, which bound a grammar's size, its lexer's construction and
    the work of one mask step (a step over them puts the matcher in error instead of
    running on); errors without the parser-state dump.
    """
    return _llguidance().LLParserLimits(
        max_items_in_row=GRAMMAR_LIMITS["max_items_in_row"],
        initial_lexer_fuel=GRAMMAR_LIMITS["initial_lexer_fuel"],
        step_lexer_fuel=GRAMMAR_LIMITS["step_lexer_fuel"],
        step_max_items=GRAMMAR_LIMITS["step_max_items"],
        max_lexer_states=GRAMMAR_LIMITS["max_lexer_states"],
        max_grammar_size=GRAMMAR_LIMITS["max_grammar_size"],
        verbose_errors=False,
    )


# Which limit a grammar engine message is about, for the ValueError / request error.
_LIMIT_MESSAGES = (
    ("too many expressions constructed", "step_lexer_fuel"),
    ("too many states", "max_lexer_states"),
    ("Too many items", "step_max_items"),
    ("items; max is", "max_items_in_row"),
    ("initial lexer configuration", "initial_lexer_fuel"),
    ("fuel exhausted", "initial_lexer_fuel"),
    ("grammar size", "max_grammar_size"),
)


def grammar_error(message: str) -> str:
    """The grammar engine's error ``message``, readable: without its dump marker, with
    the limit it hit named, and "no output can satisfy it" for a dead end."""
    text = message.replace("<non-verbose/>", "").strip()
    if text.startswith("NoExtension"):
        return f"no output can satisfy it (the grammar engine found no way on: {text})"
    for needle, name in _LIMIT_MESSAGES:
        if needle in text:
            return f"{text} (limit: {name}={GRAMMAR_LIMITS[name]})"
    return text


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
        """Write the allowed tokens into ``row`` (int32, one bit per token).

        If the grammar engine fails here (a step over its limits), the matcher enters
        its error state and allows only EOS; ``error()`` then says why.
        """
        assert row.dtype == torch.int32 and row.is_contiguous()
        self._m.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)

    def consume(self, token_id: int) -> str | None:
        """Consume a sampled token; None on success, else why the request must fail
        (the grammar engine failed on an earlier mask, or rejected this token)."""
        if self._m.is_error():
            return self.error()
        if self._m.consume_token(token_id):
            return None
        return self.error() or f"the grammar rejected token {token_id}"

    def error(self) -> str | None:
        """Why the grammar engine failed (its message, the limit named), or None."""
        if not self._m.is_error():
            return None
        return grammar_error(self._m.get_error()) or "the grammar engine failed"

    def is_terminated(self) -> bool:
        """The grammar has matched and cannot continue: the request ends "stop".

        A matcher in error is stopped too, but that is a failure (``error()``), never a
        match.
        """
        return bool(self._m.is_stopped() and not self._m.is_error())

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        # Crossing a process (the Ray backend) it arrives as None: the core builds its own.
        return (_no_matcher, ())


def _no_matcher() -> None:
    return None


class GrammarCompiler:
    """Compiles and validates grammars for one tokenizer; caches them by spec (thread-safe).

    ``vocab_size`` is the model's logit width (it may exceed the tokenizer's vocabulary).
    The cache holds, per spec, a matcher at its start whose lexer is built (its first
    mask computed); every request gets a copy, so the core never builds a lexer.
    """

    def __init__(
        self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int], cache_size: int = 256
    ) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._lltok: Any = None
        self._cache: OrderedDict[str, Any] = OrderedDict()  # spec key -> LLMatcher
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

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """The ready matcher of ``spec`` at its start (cached; never handed out: copy it).

        Raises ValueError naming the field when the grammar does not compile, is over a
        limit of the grammar engine, or fails within its first ``PROBE_STEPS`` tokens.
        All of it runs here, on the caller's thread (llguidance drops the GIL meanwhile).
        """
        key = spec.cache_key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return hit
            tok = self._ll_tokenizer()
        llg = _llguidance()
        field = f"structured_outputs.{spec.kind}"
        try:
            grammar = grammar_text(spec)
        except ValueError as exc:
            raise ValueError(f"{field} is invalid: {exc}") from None
        template = llg.LLMatcher(tok, grammar, log_level=0, limits=grammar_limits())
        if template.is_error():
            raise ValueError(f"{field} is invalid: {grammar_error(template.get_error())}")
        failure = self._probe(template)
        if failure is not None:
            raise ValueError(f"{field} cannot be generated: {failure}")
        with self._lock:
            self.misses += 1
            self._cache[key] = template
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return template

    def _probe(self, template: Any) -> str | None:
        """Build ``template``'s lexer (its first mask) and walk a copy of it for
        ``PROBE_STEPS`` tokens, each the lowest-id token its mask allows other than EOS;
        the grammar engine's error on the way (None if there is none)."""
        row = torch.zeros(bitmask_words(self.vocab_size), dtype=torch.int32)
        walker = template
        for step in range(PROBE_STEPS):
            walker.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)
            if walker.is_error():
                return _failed_at(step, walker.get_error())
            if walker.is_stopped():
                return None  # it can only end here
            allowed = _allowed_ids(row, self.vocab_size)
            token = next((t for t in allowed if t not in self._eos), None)
            if token is None:
                return None  # only EOS: the grammar may end here
            if walker is template:
                walker = template.deep_copy()  # the template stays at its start
            if not walker.consume_token(token):
                return _failed_at(step, walker.get_error())
        return None

    def matcher(self, spec: StructuredOutputsParams) -> GrammarMatcher:
        """A fresh matcher for one request (compiles or reuses the grammar)."""
        template = self.compile(spec)
        with self._lock:  # one copy at a time of a shared template
            m = template.deep_copy()
        return GrammarMatcher(m, spec.kind, spec.describe())


def _failed_at(step: int, message: str) -> str:
    return f"the grammar engine fails at output token {step + 1}: {grammar_error(message)}"


def _allowed_ids(row: torch.Tensor, vocab_size: int) -> list[int]:
    """The token ids whose bit is set in one bitmask row."""
    bits = ((row.unsqueeze(-1) >> _BITS) & 1).view(-1)[:vocab_size]
    return bits.nonzero().flatten().tolist()


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
