"""Tool calls in a model's text: parsers per model family, and the tool-choice grammars.

A chat model asked to call a tool writes the call in its own format. The parsers here
(named as vLLM's ``--tool-call-parser`` names them) split a reply into its content and
its calls:

- ``"hermes"`` (Hermes, Qwen2.5, Qwen3): ``<tool_call>\\n{"name": ..., "arguments":
  {...}}\\n</tool_call>``, one block per call;
- ``"llama3_json"`` (Llama 3.x): the reply is ``{"name": ..., "parameters": {...}}``,
  optionally after ``<|python_tag|>``, several separated by ``;``;
- ``"mistral"``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``, or the newer
  ``[TOOL_CALLS]name[ARGS]{...}``.

Every parser works on the whole text (``extract``) and incrementally (``ToolCallStream``,
for streamed replies): both run the same ``scan``, which splits a text into content
pieces and complete calls, holding back (while the reply is unfinished) the tail that
may still become a call. Invariant: what ``scan`` returns for an unfinished text is a
prefix of what it returns for any longer text, so a stream's calls and content, put
together, are the finished reply's. A call that does not parse (bad JSON, no name,
arguments that are not an object, a block never closed) is returned as content, never
an error.

``tool_choice_schema`` is the other half: the JSON schema that makes a reply *be* tool
calls ("required" or a named function), enforced by structured outputs
(nbengine/structured_outputs.py; docs/serving.md, "Tools").
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

__all__ = [
    "PARSERS",
    "ExtractedToolCalls",
    "FunctionCall",
    "ToolCall",
    "ToolCallStream",
    "ToolParser",
    "default_parser",
    "get_parser",
    "new_call_id",
    "template_messages",
    "tool_choice_schema",
]


def new_call_id() -> str:
    """A fresh tool-call id: ``call_`` and 24 hex digits (OpenAI's form)."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True, slots=True)
class FunctionCall:
    """A call as the text wrote it: the function's name and its arguments as JSON text."""

    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One tool call of a reply (OpenAI's shape): ``arguments`` is the JSON text of an
    object; ``args`` is it decoded."""

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)
    type: str = "function"

    @property
    def args(self) -> Any:
        """The arguments decoded (a dict for every call a parser returns)."""
        return json.loads(self.arguments)

    def to_openai(self) -> dict[str, Any]:
        """``{"id", "type": "function", "function": {"name", "arguments"}}``."""
        return {
            "id": self.id,
            "type": self.type,
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True, slots=True)
class ExtractedToolCalls:
    """A finished reply split: its calls, and the rest of its text (None when only calls
    and whitespace were left)."""

    tool_calls: list[ToolCall]
    content: str | None


Segment = str | FunctionCall


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _call_from(obj: object, arg_keys: Sequence[str]) -> FunctionCall | None:
    """The call ``obj`` (decoded JSON) stands for, or None if it is not one: an object
    with a non-empty string ``name`` and its arguments (an object, or JSON text of one)
    under the first of ``arg_keys`` present (none: no arguments)."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    args: Any = {}
    for key in arg_keys:
        if key in obj:
            args = obj[key]
            break
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return FunctionCall(name, _dumps(args))


def _decode(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def _json_end(text: str, start: int) -> int | None:
    """The index just past the bracket that closes the one at ``start`` (``{`` or ``[``),
    strings skipped; None if the text ends first (brackets are counted, not matched by
    kind: the decoder judges the value afterwards)."""
    depth = 0
    i = start
    n = len(text)
    while i < n:
        c = text[i]
        if c == '"':
            i += 1
            while i < n and text[i] != '"':
                i += 2 if text[i] == "\\" else 1
            if i >= n:
                return None
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def _partial_marker(tail: str, marker: str) -> int:
    """How many characters at the end of ``tail`` could begin ``marker``."""
    for k in range(min(len(marker) - 1, len(tail)), 0, -1):
        if tail.endswith(marker[:k]):
            return k
    return 0


def _scan_array(
    text: str, start: int, final: bool, arg_keys: Sequence[str]
) -> tuple[list[FunctionCall], int | None, int | None]:
    """Calls in the JSON array of call objects at ``start`` (``[``), each as soon as it is
    complete: (the calls, the index past the array or None if it has not ended, where the
    array went wrong or None). It goes wrong where an element is not a call, the array
    is malformed, or (``final``) it is cut short; the caller keeps the calls before that
    point and treats the text from it as content (``start`` if there are none)."""
    calls: list[FunctionCall] = []
    i = _skip_ws(text, start + 1)
    part_at = start  # where the element being read begins, with its separator
    while True:
        bad = start if not calls else part_at
        if i >= len(text):
            return calls, None, bad if final else None
        c = text[i]
        if c == "]" and not calls:
            return calls, i + 1, None
        if c != "{":
            return calls, None, bad
        end = _json_end(text, i)
        if end is None:
            return calls, None, bad if final else None
        call = _call_from(_decode(text[i:end]), arg_keys)
        if call is None:
            return calls, None, bad
        calls.append(call)
        part_at = end
        i = _skip_ws(text, end)
        if i >= len(text):
            return calls, None, part_at if final else None
        if text[i] == "]":
            return calls, i + 1, None
        if text[i] != ",":
            return calls, None, part_at
        i = _skip_ws(text, i + 1)


class ToolParser:
    """A model family's tool-call format; ``scan`` is the whole of a parser."""

    name: ClassVar[str] = ""
    # False where the format's markers are special tokens, which detokenizing with
    # skip_special_tokens=True would drop from the text (Mistral's [TOOL_CALLS]).
    skip_special_tokens: ClassVar[bool] = True

    def scan(self, text: str, final: bool) -> list[Segment]:
        """``text`` as content pieces and calls, in order. With ``final=False`` the tail
        that may still become a call is left out; what is returned then is a prefix of
        what any longer text returns (the module docstring's invariant)."""
        raise NotImplementedError

    def extract(self, text: str) -> ExtractedToolCalls:
        """The calls and the content of the finished reply ``text``."""
        return _extracted(self.scan(text, final=True))


def _extracted(segments: list[Segment]) -> ExtractedToolCalls:
    content = "".join(s for s in segments if isinstance(s, str)).strip()
    calls = [ToolCall(s.name, s.arguments) for s in segments if isinstance(s, FunctionCall)]
    return ExtractedToolCalls(calls, content or None)


class HermesToolParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Hermes, Qwen)."""

    name = "hermes"
    OPEN = "<tool_call>"
    CLOSE = "</tool_call>"

    def scan(self, text: str, final: bool) -> list[Segment]:
        out: list[Segment] = []
        pos = 0
        while True:
            start = text.find(self.OPEN, pos)
            if start < 0:
                tail = text[pos:]
                if not final:
                    tail = tail[: len(tail) - _partial_marker(tail, self.OPEN)]
                out.append(tail)
                return out
            out.append(text[pos:start])
            body_at = start + len(self.OPEN)
            close = text.find(self.CLOSE, body_at)
            if close < 0:
                if final:  # a last block left open: a call if its body is one
                    call = _call_from(_decode(text[body_at:].strip()), ("arguments", "parameters"))
                    out.append(call if call is not None else text[start:])
                return out
            end = close + len(self.CLOSE)
            call = _call_from(_decode(text[body_at:close].strip()), ("arguments", "parameters"))
            out.append(call if call is not None else text[start:end])
            pos = end


class Llama3JsonToolParser(ToolParser):
    """Llama 3.x JSON calls: the reply is ``{"name": ..., "parameters": {...}}`` (after an
    optional ``<|python_tag|>``), several separated by ``;``. A reply that does not begin
    so is content; from the first part that is not a call on, the text is content."""

    name = "llama3_json"
    TAG = "<|python_tag|>"  # a special token: often not in the text, and not needed

    def scan(self, text: str, final: bool) -> list[Segment]:
        i = _skip_ws(text, 0)
        rest = text[i:]
        if not final and (not rest or (self.TAG.startswith(rest) and rest != self.TAG)):
            return []  # nothing yet, or the tag still arriving
        if rest.startswith(self.TAG):
            i = _skip_ws(text, i + len(self.TAG))
            if i >= len(text) and not final:
                return []
        if not text.startswith("{", i):
            return [text]
        out: list[Segment] = []
        part_at = 0  # where the part being read began (content from there if it fails)
        while True:
            end = _json_end(text, i)
            if end is None:
                if final:
                    out.append(text[part_at:])
                return out
            call = _call_from(_decode(text[i:end]), ("parameters", "arguments"))
            if call is None:
                out.append(text[part_at:])
                return out
            out.append(call)
            part_at = end
            i = _skip_ws(text, end)
            if i >= len(text):
                return out
            if text[i] != ";":
                out.append(text[part_at:])
                return out
            i = _skip_ws(text, i + 1)
            if i >= len(text):
                if final:
                    out.append(text[part_at:])
                return out
            if text[i] != "{":
                out.append(text[part_at:])
                return out


# The name of the newer Mistral form, and an optional [CALL_ID] after it.
_MISTRAL_NAME_RE = re.compile(r"([A-Za-z0-9_.\-]+)(?:\[CALL_ID\][A-Za-z0-9]+)?\[ARGS\]")
# What may still grow into the name form while the reply is unfinished.
_MISTRAL_PARTIAL_RE = re.compile(r"[A-Za-z0-9_.\-]*(?:\[[A-Z_]*\]?[A-Za-z0-9]*)*\[?[A-Z_]*")


class MistralToolParser(ToolParser):
    """Mistral's ``[TOOL_CALLS]`` then a JSON array of calls, or ``name[ARGS]{...}``."""

    name = "mistral"
    MARK = "[TOOL_CALLS]"
    skip_special_tokens = False  # [TOOL_CALLS] is a special token

    def scan(self, text: str, final: bool) -> list[Segment]:
        out: list[Segment] = []
        pos = 0
        while True:
            at = text.find(self.MARK, pos)
            if at < 0:
                tail = text[pos:]
                if not final:
                    tail = tail[: len(tail) - _partial_marker(tail, self.MARK)]
                out.append(tail)
                return out
            out.append(text[pos:at])
            i = _skip_ws(text, at + len(self.MARK))
            if i >= len(text):
                if final:
                    out.append(text[at:])
                return out
            if text[i] == "[":
                calls, end, bad = _scan_array(text, i, final, ("arguments", "parameters"))
                out.extend(calls)
                if bad is not None:
                    out.append(text[bad if calls else at :])
                    return out
                if end is None:
                    return out
                pos = end
                continue
            m = _MISTRAL_NAME_RE.match(text, i)
            if m is None:
                if not final and _MISTRAL_PARTIAL_RE.fullmatch(text, i) is not None:
                    return out
                out.append(text[at:])
                return out
            j = _skip_ws(text, m.end())
            if j >= len(text) or text[j] != "{":
                if not final and j >= len(text):
                    return out
                out.append(text[at:])
                return out
            end = _json_end(text, j)
            if end is None:
                if final:
                    out.append(text[at:])
                return out
            args = _decode(text[j:end])
            if not isinstance(args, dict):
                out.append(text[at:])
                return out
            out.append(FunctionCall(m.group(1), _dumps(args)))
            pos = end


class JsonToolCallsParser(ToolParser):
    """The reply a tool-choice grammar enforces (``tool_choice_schema``): a JSON array of
    ``{"name", "arguments"}`` objects, or one such object (``parallel=False``)."""

    name = "json"

    def __init__(self, parallel: bool) -> None:
        self.parallel = parallel

    def scan(self, text: str, final: bool) -> list[Segment]:
        i = _skip_ws(text, 0)
        if i >= len(text):
            return [text] if final else []
        if self.parallel:
            if text[i] != "[":
                return [text]
            calls, _end, bad = _scan_array(text, i, final, ("arguments",))
            out: list[Segment] = list(calls)
            if bad is not None:
                out.append(text[bad:] if calls else text)
            return out
        if text[i] != "{":
            return [text]
        end = _json_end(text, i)
        if end is None:
            return [text] if final else []
        call = _call_from(_decode(text[i:end]), ("arguments",))
        return [call] if call is not None else [text]


PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)
}
"""The auto-choice parsers by name (vLLM's ``--tool-call-parser`` names)."""


def get_parser(name: str) -> ToolParser:
    """The parser called ``name`` (a key of ``PARSERS``); ValueError naming the choices."""
    if not isinstance(name, str):
        raise TypeError(f"tool_call_parser must be a string, got {type(name).__name__}.")
    cls = PARSERS.get(name)
    if cls is None:
        raise ValueError(f"tool_call_parser must be one of {sorted(PARSERS)}, got {name!r}.")
    return cls()


def default_parser(template: str | None) -> str | None:
    """The parser for a chat template's tool-call format (its Jinja source), or None if
    the template shows none: ``<tool_call>`` -> hermes, ``[TOOL_CALLS]`` -> mistral,
    ``<|python_tag|>`` or Llama 3's header tokens with tools -> llama3_json."""
    if not template:
        return None
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or ("<|start_header_id|>" in template and "tools" in template):
        return "llama3_json"
    return None


@dataclass(frozen=True, slots=True)
class StreamDelta:
    """What one step of a stream adds: content text and calls complete since the last."""

    content: str
    tool_calls: list[ToolCall]


class ToolCallStream:
    """A reply's calls and content as its text arrives (one per streamed choice).

    ``feed`` takes each text delta and returns what became certain: content (surrounding
    whitespace held back, as ``extract`` strips it) and calls, each once, with its id.
    """

    def __init__(self, parser: ToolParser) -> None:
        self._parser = parser
        self._text = ""
        self._content_sent = 0  # characters of the stripped content sent
        self.tool_calls: list[ToolCall] = []  # the calls sent so far

    def feed(self, delta: str, final: bool = False) -> StreamDelta:
        """Add ``delta``; ``final=True`` with the reply's last delta (the rest then goes
        out: an unfinished call as content)."""
        self._text += delta
        segments = self._parser.scan(self._text, final)
        content = "".join(s for s in segments if isinstance(s, str)).lstrip()
        # Trailing whitespace waits: it is content only if more content follows it.
        content = content.rstrip()
        new_content = content[self._content_sent :]
        self._content_sent = max(self._content_sent, len(content))
        calls = [s for s in segments if isinstance(s, FunctionCall)]
        new_calls = [ToolCall(c.name, c.arguments) for c in calls[len(self.tool_calls) :]]
        self.tool_calls.extend(new_calls)
        return StreamDelta(new_content, new_calls)


# ------------------------------------------------------------ messages to templates


def template_messages(messages: Any) -> Any:
    """``messages`` with each assistant tool call's ``function.arguments`` decoded from
    JSON text to a dict, as chat templates expect (the Hugging Face convention; OpenAI
    clients send the text). Messages that need no change are passed as they are (the
    others copied); anything not shaped so is left for the template's own checks.
    ValueError naming the call if the text is not JSON."""
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        return messages
    out: list[Any] = []
    for i, msg in enumerate(messages):
        calls = msg.get("tool_calls") if isinstance(msg, Mapping) else None
        if not isinstance(calls, Sequence) or not any(_text_arguments(c) for c in calls):
            out.append(msg)
            continue
        decoded = []
        for j, call in enumerate(calls):
            if _text_arguments(call):
                fn = call["function"]
                try:
                    args = json.loads(fn["arguments"])
                except ValueError as exc:
                    raise ValueError(
                        f"messages[{i}]['tool_calls'][{j}]['function']['arguments'] is not "
                        f"JSON: {exc}."
                    ) from None
                call = {**call, "function": {**fn, "arguments": args}}
            decoded.append(call)
        out.append({**msg, "tool_calls": decoded})
    return out


def _text_arguments(call: object) -> bool:
    fn = call.get("function") if isinstance(call, Mapping) else None
    return isinstance(fn, Mapping) and isinstance(fn.get("arguments"), str)


# ------------------------------------------------------------ tool-choice grammars


def tool_functions(tools: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The ``function`` objects of OpenAI-shaped ``tools`` (``{"type": "function",
    "function": {"name", "parameters", ...}}``); ValueError/TypeError naming the tool."""
    out: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping):
            raise TypeError(f"tools[{i}] must be a dict, got {type(tool).__name__}.")
        if tool.get("type", "function") != "function":
            raise ValueError(f"tools[{i}].type must be 'function', got {tool.get('type')!r}.")
        fn = tool.get("function")
        if not isinstance(fn, Mapping):
            raise TypeError(f"tools[{i}].function must be a dict with a 'name'.")
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
            raise ValueError(
                f"tools[{i}].function.name must be 1-64 letters, digits, _ . or -, got {name!r}."
            )
        params = fn.get("parameters")
        if params is not None and not isinstance(params, Mapping):
            raise TypeError(f"tools[{i}].function.parameters must be a JSON schema object.")
        out.append(dict(fn))
    return out


def _parameters(fn: Mapping[str, Any]) -> dict[str, Any]:
    """A function's parameter schema; a function without one takes no arguments."""
    params = fn.get("parameters")
    if params is None:
        return {"type": "object", "properties": {}, "additionalProperties": False}
    return dict(params)


def tool_choice_schema(
    functions: Sequence[Mapping[str, Any]], name: str | None, parallel: bool
) -> dict[str, Any]:
    """The JSON schema a reply must match to be tool calls of ``functions``.

    ``name`` given (a named tool choice): the reply is that function's arguments object.
    Otherwise ("required"): ``{"name": <one of them>, "arguments": <its parameters>}``,
    an array of one or more of those when ``parallel`` (``JsonToolCallsParser`` reads it).
    """
    if name is not None:
        fn = next((f for f in functions if f.get("name") == name), None)
        if fn is None:
            raise ValueError(f"tool_choice names {name!r}, which is not one of the tools.")
        return _parameters(fn)
    one = {
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"const": f["name"]}, "arguments": _parameters(f)},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for f in functions
        ]
    }
    if not parallel:
        return one
    return {"type": "array", "items": one, "minItems": 1}
