"""Chat requests: a conversation rendered by the model's chat template, then generated.

``Engine.chat`` and ``LLM.chat`` are thin calls into this module. The conversation is
rendered with the model's chat template (nbengine/model/chat_template.py) and tokenized
without adding special tokens; the ids then go through ``Engine.generate``'s token-id
path, so validation, request ids, aborts and the end-of-generation rules are exactly
those of ``generate()``. Generation stops at the model's eos ids, which include the
template's end-of-turn token where the model declares it (``generation_config.json``'s
eos list and ``tokenizer_config.json``'s ``eos_token``; docs/models.md).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nbengine.model.chat_template import ChatTemplate

if TYPE_CHECKING:
    from nbengine.frontend.engine import Engine
    from nbengine.frontend.handles import RequestHandle
    from nbengine.llm import LLM
    from nbengine.lora.request import LoRARequest
    from nbengine.outputs import RequestOutput
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
        messages,
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


def engine_chat(
    engine: Engine,
    messages: Conversation,
    params: SamplingParams | None,
    request_id: str | None,
    lora_request: LoRARequest | None = None,
    **template_options: Any,
) -> RequestHandle:
    """``Engine.chat``: render, then ``engine.generate`` the ids; the handle's ``prompt``
    is the rendered text."""
    prompt = render_chat(engine.tokenizer, messages, **template_options)
    handle = engine.generate(
        prompt.token_ids, params, request_id=request_id, lora_request=lora_request
    )
    handle.prompt = prompt.text  # generate() saw ids only; show the user what was sent
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
    **template_options: Any,
) -> list[RequestOutput]:
    """``LLM.chat``: every conversation rendered first (a bad one leaves no request
    behind), then one ``LLM.generate`` batch; each output's ``prompt`` is its rendered text."""
    prompts = [
        render_chat(llm.tokenizer, conv, **template_options) for conv in _conversations(messages)
    ]
    if not prompts:
        return []
    outputs = llm.generate([p.token_ids for p in prompts], sampling_params, use_tqdm=use_tqdm)
    for out, prompt in zip(outputs, prompts):
        out.prompt = prompt.text
    return outputs
