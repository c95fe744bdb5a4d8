"""Tool calls on /v1/chat/completions: ``tools``, ``tool_choice``, ``parallel_tool_calls``.

What the request asks for becomes a ``ToolSetup`` (docs/serving.md, "Tools"):

- ``"none"``: the tools are still rendered into the chat template (vLLM's default) but
  the reply is plain content, never parsed;
- ``"auto"`` (the default with tools): the reply is parsed by the server's tool-call
  parser (nbengine/tool_parsers.py; ``engine.serve(tool_call_parser=...)``, default from
  the chat template); a call that does not parse is content;
- ``"required"`` and a named function (``{"type": "function", "function": {"name"}}``):
  a JSON schema built from the functions' parameters is enforced by structured outputs,
  so the reply always parses; it is rendered as tool calls whatever the template's own
  format. A named function's reply is its arguments object, streamed as it is written;
  "required" is an array of ``{"name", "arguments"}`` (one object when
  ``parallel_tool_calls`` is false).

With ``parallel_tool_calls: false`` at most one call is returned (the first).
Replies carry ``message.tool_calls`` (ids ``call_<hex>``), ``content: null`` when only
calls were made, and ``finish_reason: "tool_calls"`` when the model stopped after calls.
A streamed call is a ``delta.tool_calls`` entry ``{"index", "id", "type": "function",
"function": {"name", "arguments": ""}}`` followed by entries of the same ``index`` with
pieces of ``arguments``; they add up to the non-streamed call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from nbengine.outputs import CompletionOutput
from nbengine.sampling_params import SamplingParams
from nbengine.server.protocol import ProtocolError
from nbengine.structured_outputs import StructuredOutputsParams
from nbengine.tool_parsers import (
    JsonToolCallsParser,
    ToolCall,
    ToolCallStream,
    ToolParser,
    new_call_id,
    template_messages,
    tool_choice_schema,
    tool_functions,
)

__all__ = ["ChoiceStream", "ToolSetup", "server_parser", "tool_messages", "tool_setup"]

Mode = Literal["none", "auto", "required", "named"]


def _bad(message: str, param: str) -> ProtocolError:
    return ProtocolError(400, message, param=param)


def _choice(tool_choice: object, has_tools: bool) -> tuple[Mode, str | None]:
    """(the mode, the named function) of ``tool_choice``; ProtocolError 400 if bad."""
    if tool_choice is None:
        return ("auto" if has_tools else "none"), None
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise _bad(
                "tool_choice must be 'none', 'auto', 'required' or "
                f'{{"type": "function", "function": {{"name": ...}}}}, got {tool_choice!r}.',
                "tool_choice",
            )
        mode: Mode = tool_choice  # type: ignore[assignment]
        if mode != "none" and not has_tools:
            raise _bad(f"tool_choice {tool_choice!r} needs tools.", "tool_choice")
        return mode, None
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if (
        not isinstance(tool_choice, dict)
        or tool_choice.get("type") != "function"
        or not isinstance(name, str)
    ):
        raise _bad(
            'tool_choice naming a function must be {"type": "function", "function": '
            '{"name": ...}}.',
            "tool_choice",
        )
    if not has_tools:
        raise _bad("tool_choice names a function, but there are no tools.", "tool_choice")
    return "named", name


@dataclass
class ToolSetup:
    """One request's tool handling (see the module docstring)."""

    mode: Mode
    parser: ToolParser | None  # what splits the reply (None: "none", or named)
    name: str | None = None  # the named function
    parallel: bool = True
    schema: dict[str, Any] | None = None  # enforced for "required" / named
    template_tools: list[dict[str, Any]] | None = field(default=None, repr=False)

    @property
    def parses(self) -> bool:
        """True when replies are turned into tool calls."""
        return self.mode != "none"

    def sampling(self, params: SamplingParams) -> SamplingParams:
        """``params`` with what the mode needs: the tool-choice grammar, or special
        tokens kept where the parser's markers are ones."""
        if self.schema is not None:
            if params.structured_outputs is not None:
                raise _bad(
                    f"tool_choice {self.mode!r} is enforced by a grammar and cannot be "
                    "combined with another structured output (response_format, guided_*).",
                    "tool_choice",
                )
            try:
                spec = StructuredOutputsParams(json=self.schema)
            except (ValueError, TypeError) as exc:
                raise _bad(f"tools: a parameter schema is refused: {exc}", "tools") from None
            return params.replace(structured_outputs=spec)
        if self.parser is not None and not self.parser.skip_special_tokens:
            return params.replace(skip_special_tokens=False)
        return params

    def _calls(self, text: str) -> tuple[list[ToolCall], str | None]:
        if self.mode == "named":  # the text is the arguments (none written: no call)
            assert self.name is not None
            return ([ToolCall(self.name, text)] if text else []), None
        assert self.parser is not None
        got = self.parser.extract(text)
        calls = got.tool_calls if self.parallel else got.tool_calls[:1]
        return calls, got.content

    def message(
        self, c: CompletionOutput, text: str | None = None
    ) -> tuple[dict[str, Any], str | None]:
        """The reply's ``message`` and ``finish_reason``, for ``c``'s text or ``text``
        (what is left of it once a reasoning parser took the thinking)."""
        text = c.text if text is None else text
        if not self.parses:
            return {"role": "assistant", "content": text}, c.finish_reason
        calls, content = self._calls(text)
        if not calls:  # as a stream sends it: surrounding whitespace stripped
            return {"role": "assistant", "content": content or ""}, c.finish_reason
        message = {
            "role": "assistant",
            "content": content,
            "tool_calls": [t.to_openai() for t in calls],
        }
        return message, _finish(c.finish_reason, True)

    def stream(self) -> ChoiceStream:
        """The state of one streamed choice."""
        return ChoiceStream(self)


def _finish(reason: str | None, called: bool) -> str | None:
    return "tool_calls" if called and reason == "stop" else reason


class ChoiceStream:
    """One streamed choice's deltas: content and ``tool_calls`` entries, as the module
    docstring describes them."""

    def __init__(self, setup: ToolSetup) -> None:
        self._setup = setup
        self._stream = ToolCallStream(setup.parser) if setup.parser is not None else None
        self._sent = 0  # tool calls sent
        self._named_id: str | None = None

    def delta(self, text: str, finished: bool) -> dict[str, Any]:
        """The ``delta`` for the text ``text`` (``finished``: the choice's last)."""
        setup = self._setup
        if not setup.parses:
            return {"content": text} if text else {}
        if setup.mode == "named":
            return self._named(text)
        assert self._stream is not None
        got = self._stream.feed(text, finished)
        out: dict[str, Any] = {}
        if got.content:
            out["content"] = got.content
        entries: list[dict[str, Any]] = []
        for call in got.tool_calls:
            if not setup.parallel and self._sent >= 1:
                break
            entries += _call_entries(self._sent, call)
            self._sent += 1
        if entries:
            out["tool_calls"] = entries
        return out

    def _named(self, text: str) -> dict[str, Any]:
        if not text:  # the call starts with its first text, as in ToolSetup._calls
            return {}
        entries: list[dict[str, Any]] = []
        if self._named_id is None:
            self._named_id = new_call_id()
            entries.append(_header(0, self._named_id, self._setup.name or ""))
            self._sent = 1
        entries.append({"index": 0, "function": {"arguments": text}})
        return {"tool_calls": entries}

    def finish_reason(self, reason: str | None) -> str | None:
        """The choice's ``finish_reason``: "tool_calls" when it stopped after calls."""
        return _finish(reason, self._sent > 0)


def _header(index: int, call_id: str, name: str) -> dict[str, Any]:
    return {
        "index": index,
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": ""},
    }


def _call_entries(index: int, call: ToolCall) -> list[dict[str, Any]]:
    return [
        _header(index, call.id, call.name),
        {"index": index, "function": {"arguments": call.arguments}},
    ]


def tool_setup(
    tools: Sequence[Any] | None,
    tool_choice: object,
    parallel_tool_calls: bool,
    parser: ToolParser | None,
) -> ToolSetup:
    """The ``ToolSetup`` of a request (ProtocolError 400 naming the field); ``parser``
    is the server's auto parser (None: the server has none)."""
    has_tools = bool(tools)
    mode, name = _choice(tool_choice, has_tools)
    functions: list[dict[str, Any]] = []
    if tools:
        try:
            functions = tool_functions(tools)
        except (ValueError, TypeError) as exc:
            raise _bad(str(exc), "tools") from None
    template_tools = list(tools) if tools else None
    if mode == "none":
        return ToolSetup("none", None, template_tools=template_tools)
    if mode == "auto":
        if parser is None:
            raise _bad(
                "tool_choice 'auto' needs the server's tool-call parser, and the chat "
                "template shows no tool-call format: start the server with "
                "tool_call_parser= (nbengine serve --tool-call-parser NAME: hermes, "
                "llama3_json or mistral), or send tool_choice 'required' or a named function.",
                "tool_choice",
            )
        return ToolSetup(
            "auto", parser, parallel=parallel_tool_calls, template_tools=template_tools
        )
    try:
        schema = tool_choice_schema(functions, name, parallel_tool_calls)
    except ValueError as exc:
        raise _bad(str(exc), "tool_choice") from None
    if mode == "named":
        return ToolSetup("named", None, name, False, schema, template_tools)
    return ToolSetup(
        "required",
        JsonToolCallsParser(parallel_tool_calls),
        None,
        parallel_tool_calls,
        schema,
        template_tools,
    )


def tool_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as templates take them: assistant tool calls' ``arguments`` decoded
    (ProtocolError 400 naming the message if one is not JSON)."""
    try:
        out: list[dict[str, Any]] = template_messages(messages)
    except ValueError as exc:
        raise _bad(str(exc), "messages") from None
    return out


def server_parser(tokenizer: Any, chat_template: str | None, name: str | None) -> ToolParser | None:
    """The server's auto parser: ``name`` (``tool_call_parser``; ValueError if unknown),
    else the one the chat template's tool format shows (None if it shows none)."""
    from nbengine.frontend.chat import tool_parser_for

    return tool_parser_for(tokenizer, name, chat_template, [{"type": "function"}])
