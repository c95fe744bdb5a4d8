"""Chat requests: a conversation rendered by the model's chat template, then generated.

``Engine.chat`` and ``LLM.chat`` are thin calls into this module. The conversation is
rendered with the model's chat template (nbengine/model/chat_template.py) and tokenized
without adding special tokens; the ids then go through ``Engine.generate``'s token-id
path, so validation, request ids, aborts and the end-of-generation rules are exactly
those of ``generate()``. Generation stops at the model's eos ids, which include the
template's end-of-turn token where the model declares it (``generation_config.json``'s
eos list and ``tokenizer_config.json``'s ``eos_token``; docs/models.md).

With ``tools``, the reply's tool calls are parsed from its text by the model family's
parser (``tool_call_parser``, default from the chat template: nbengine/tool_parsers.py)
and attached to the final output (``CompletionOutput.tool_calls`` / ``.content``), and
assistant messages' ``tool_calls`` reach the template with their ``arguments`` decoded
(the Hugging Face convention; docs/api.md, "Tool calls").
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nbengine.model.chat_template import ChatTemplate, NoChatTemplateError
from nbengine.tool_parsers import (
    ExtractedToolCalls,
    ToolParser,
    default_parser,
    get_parser,
    template_messages,
)

if TYPE_CHECKING:
    from nbengine.frontend.engine import Engine
    from nbengine.frontend.handles import RequestHandle
    from nbengine.llm import LLM
    from nbengine.lora.request import LoRARequest
    from nbengine.outputs import CompletionOutput, RequestOutput
    from nbengine.sampling_params import SamplingParams

__all__ = ["ChatPrompt", "chat_template_of", "engine_chat", "llm_chat", "render_chat"]

Conversation = Sequence[Mapping[str, Any]]

# One ChatTemplate per tokenizer (read from its model directory on first use).
_templates: weakref.WeakKeyDictionary[Any, ChatTemplate] = weakref.WeakKeyDictionary()


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """A rendered conversation: the prompt text and its token ids."""

    text: str
    token_ids: list[int]


def chat_template_of(tokenizer: Any) -> ChatTemplate:
    """The chat template(s) of the model ``tokenizer`` was loaded from."""
    template = _templates.get(tokenizer)
    if template is None:
        path = getattr(tokenizer, "path", None)
        if path is not None:
            template = ChatTemplate.from_dir(path)
        else:
            template = ChatTemplate(source="a tokenizer that was not loaded from a model directory")
        _templates[tokenizer] = template
    return template


def render_chat(
    tokenizer: Any,
    messages: Conversation,
    *,
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> ChatPrompt:
    """Render ``messages`` with the model's chat template and tokenize the text.

    The template writes the special tokens it wants (``bos_token`` ...), so none are
    added when tokenizing: the ids equal transformers' ``apply_chat_template(...,
    tokenize=True)`` for the same tokenizer files and messages.
    """
    text = chat_template_of(tokenizer).render(
        template_messages(messages),
        chat_template=chat_template,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        tools=tools,
        chat_template_kwargs=chat_template_kwargs,
    )
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    if not ids:
        raise ValueError("The chat template rendered the conversation as an empty prompt.")
    return ChatPrompt(text, ids)


def tool_parser_for(
    tokenizer: Any,
    tool_call_parser: str | None,
    chat_template: str | None,
    tools: object,
) -> ToolParser | None:
    """The parser of a chat's tool calls: ``tool_call_parser`` by name ("none": no
    parsing), else (with tools) the one the chat template's format shows; None when
    there is none to use."""
    if tool_call_parser == "none":
        return None
    if tool_call_parser is not None:
        return get_parser(tool_call_parser)
    if not tools:
        return None
    try:
        source = chat_template_of(tokenizer).select(chat_template, tools)
    except (NoChatTemplateError, TypeError):
        return None  # render_chat reports it
    name = default_parser(source)
    return get_parser(name) if name is not None else None


def attach_tool_calls(
    parser: ToolParser,
    out: RequestOutput,
    seen: dict[tuple[int, str], ExtractedToolCalls] | None = None,
) -> None:
    """Set each completion's ``tool_calls`` and ``content`` from its text, in place.
    ``seen`` (by index and text) gives the outputs of one request the same calls, ids
    included (the final output and the stream's last one are separate objects)."""
    for comp in out.outputs:
        _attach(parser, comp, {} if seen is None else seen)


def _attach(
    parser: ToolParser, comp: CompletionOutput, seen: dict[tuple[int, str], ExtractedToolCalls]
) -> None:
    key = (comp.index, comp.text)
    got = seen.get(key)
    if got is None:
        got = seen[key] = parser.extract(comp.text)
    comp.tool_calls = list(got.tool_calls)
    comp.content = got.content


def _for_parser(params: SamplingParams, parser: ToolParser | None) -> SamplingParams:
    """``params``, keeping special tokens in the text where the parser's markers are ones."""
    if parser is None or parser.skip_special_tokens or not params.skip_special_tokens:
        return params
    return params.replace(skip_special_tokens=False)


def engine_chat(
    engine: Engine,
    messages: Conversation,
    params: SamplingParams | None,
    request_id: str | None,
    tool_call_parser: str | None = None,
    lora_request: LoRARequest | None = None,
    **template_options: Any,
) -> RequestHandle:
    """``Engine.chat``: render, then ``engine.generate`` the ids; the handle's ``prompt``
    is the rendered text; with a tool parser, its final output carries the calls."""
    parser = tool_parser_for(
        engine.tokenizer,
        tool_call_parser,
        template_options.get("chat_template"),
        template_options.get("tools"),
    )
    prompt = render_chat(engine.tokenizer, messages, **template_options)
    if parser is not None:
        params = _for_parser(params or engine.get_default_sampling_params(), parser)
    handle = engine.generate(
        prompt.token_ids, params, request_id=request_id, lora_request=lora_request
    )
    handle.prompt = prompt.text  # generate() saw ids only; show the user what was sent
    if parser is not None:
        seen: dict[tuple[int, str], ExtractedToolCalls] = {}
        handle.finish_with(lambda out: attach_tool_calls(parser, out, seen))
    return handle


def _conversations(messages: Conversation | Sequence[Conversation]) -> list[Conversation]:
    """One conversation (a list of message dicts) or a list of them -> a list of them."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TypeError(
            "messages must be a conversation (a list of {'role', 'content'} dicts) or a list "
            f"of conversations, got {type(messages).__name__}."
        )
    if messages and all(isinstance(m, Mapping) for m in messages):
        return [messages]  # type: ignore[list-item]
    return list(messages)  # type: ignore[arg-type]


def llm_chat(
    llm: LLM,
    messages: Conversation | Sequence[Conversation],
    sampling_params: SamplingParams | Sequence[SamplingParams] | None,
    use_tqdm: bool,
    tool_call_parser: str | None = None,
    **template_options: Any,
) -> list[RequestOutput]:
    """``LLM.chat``: every conversation rendered first (a bad one leaves no request
    behind), then one ``LLM.generate`` batch; each output's ``prompt`` is its rendered
    text; with a tool parser, each carries its calls (as ``engine_chat``)."""
    parser = tool_parser_for(
        llm.tokenizer,
        tool_call_parser,
        template_options.get("chat_template"),
        template_options.get("tools"),
    )
    prompts = [
        render_chat(llm.tokenizer, conv, **template_options) for conv in _conversations(messages)
    ]
    if not prompts:
        return []
    if parser is not None and not parser.skip_special_tokens:
        sampling_params = _specials_kept(llm, sampling_params, parser)
    outputs = llm.generate([p.token_ids for p in prompts], sampling_params, use_tqdm=use_tqdm)
    for out, prompt in zip(outputs, prompts):
        out.prompt = prompt.text
        if parser is not None:
            attach_tool_calls(parser, out)
    return outputs


def _specials_kept(
    llm: LLM,
    sampling_params: SamplingParams | Sequence[SamplingParams] | None,
    parser: ToolParser,
) -> SamplingParams | list[SamplingParams]:
    if sampling_params is None:
        return _for_parser(llm.engine.get_default_sampling_params(), parser)
    if isinstance(sampling_params, Sequence):
        return [_for_parser(p, parser) for p in sampling_params]
    return _for_parser(sampling_params, parser)
