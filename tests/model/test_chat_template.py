"""Chat templates: nbengine's prompt ids equal transformers' apply_chat_template ids.

Each family's real chat template (tests/model/chat_templates.py) is written into a test
tokenizer that has that family's control tokens, and the same conversations are rendered
by nbengine (``render_chat``) and by transformers (``apply_chat_template(...,
tokenize=True)``), the oracle.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import chat_templates as T
import pytest
from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

from nbengine.frontend.chat import render_chat
from nbengine.model import Tokenizer
from nbengine.model.chat_template import ChatTemplate, ChatTemplateError, NoChatTemplateError
from nbengine.testing import make_tiny_model

transformers = pytest.importorskip("transformers")

# family: (template, control tokens added as special, other added tokens, bos, eos)
FAMILIES: dict[str, tuple[str, list[str], list[str], str | None, str]] = {
    "llama3": (
        T.LLAMA_3,
        [
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
        ],
        [],
        "<|begin_of_text|>",
        "<|eot_id|>",
    ),
    "llama3.2": (
        T.LLAMA_3_2,
        [
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
        ],
        [],
        "<|begin_of_text|>",
        "<|eot_id|>",
    ),
    "qwen2.5": (
        T.QWEN_2_5,
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        [],
        None,
        "<|im_end|>",
    ),
    "qwen3": (
        T.QWEN_3,
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        ["<think>", "</think>"],
        None,
        "<|im_end|>",
    ),
    "mistral": (T.MISTRAL, ["<unk>", "<s>", "</s>"], [], "<s>", "</s>"),
    "gemma": (
        T.GEMMA,
        ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"],
        [],
        "<bos>",
        "<eos>",
    ),
    "smollm2": (
        T.SMOLLM2,
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        [],
        "<|im_start|>",
        "<|im_end|>",
    ),
}

SYSTEM = {"role": "system", "content": "You are terse. Ünïcödé is fine."}
TURNS = [
    {"role": "user", "content": "Once upon a time, what did Lily find?"},
    {"role": "assistant", "content": "A small blue stone in the river."},
    {"role": "user", "content": "  And what did her grandmother say?  "},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city — «today»",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


def _tokenizer_dir(
    base: Path, tmp: Path, family: str, *, as_file: bool = False, named: bool = False
) -> Path:
    template, specials, added, bos, eos = FAMILIES[family]
    d = tmp / family
    d.mkdir(parents=True, exist_ok=True)
    tok = HFTokenizer.from_file(str(base / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    if added:
        tok.add_tokens([AddedToken(s, special=False, normalized=False) for s in added])
    tok.save(str(d / "tokenizer.json"))
    cfg: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": eos,
        "bos_token": bos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1 << 20,
    }
    if as_file:
        (d / "chat_template.jinja").write_text(template)
    elif named:
        cfg["chat_template"] = [
            {"name": "default", "template": template},
            {"name": "tool_use", "template": T.QWEN_2_5},
        ]
    else:
        cfg["chat_template"] = template
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # The qwen tiny model's byte-level BPE: every family's control tokens are added to it.
    return make_tiny_model(tmp_path_factory.mktemp("base"), "qwen2")


def _hf_ids(d: Path, messages: Any, **kw: Any) -> list[int]:
    tok = transformers.AutoTokenizer.from_pretrained(d)
    return list(tok.apply_chat_template(messages, tokenize=True, return_dict=False, **kw))


def _our_ids(d: Path, messages: Any, **kw: Any) -> list[int]:
    template_kwargs = {
        k: kw.pop(k)
        for k in list(kw)
        if k not in ("add_generation_prompt", "continue_final_message", "tools", "chat_template")
    }
    return render_chat(
        Tokenizer.from_dir(d), messages, chat_template_kwargs=template_kwargs, **kw
    ).token_ids


CASES: list[tuple[str, list[dict[str, Any]], dict[str, Any]]] = [
    ("llama3", [SYSTEM, *TURNS], {}),
    ("llama3.2", [SYSTEM, *TURNS], {"date_string": "26 Jul 2024"}),
    ("llama3.2", TURNS, {"date_string": "01 Jan 2025", "tools": TOOLS}),
    ("qwen2.5", [SYSTEM, *TURNS], {}),
    ("qwen2.5", TURNS, {"tools": TOOLS}),
    ("qwen3", [SYSTEM, *TURNS], {}),
    ("qwen3", TURNS, {"enable_thinking": False}),
    (
        "qwen3",
        [
            *TURNS[:1],
            {
                "role": "assistant",
                "content": "Stone.",
                "reasoning_content": "She found it in the river.",
            },
            TURNS[2],
        ],
        {"enable_thinking": True},
    ),
    ("mistral", TURNS, {}),
    ("gemma", TURNS, {}),
    ("smollm2", TURNS, {}),
    ("smollm2", [SYSTEM, *TURNS], {}),
]


@pytest.mark.parametrize(
    "family,messages,kw", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)]
)
def test_prompt_ids_equal_transformers(
    base: Path, tmp_path: Path, family: str, messages: list[dict[str, Any]], kw: dict[str, Any]
) -> None:
    d = _tokenizer_dir(base, tmp_path, family)
    for add_generation_prompt in (True, False):
        ours = _our_ids(d, messages, add_generation_prompt=add_generation_prompt, **dict(kw))
        assert ours == _hf_ids(d, messages, add_generation_prompt=add_generation_prompt, **kw)
    # The control tokens are single special ids, never spelled out in pieces.
    specials = set(FAMILIES[family][1])
    text = Tokenizer.from_dir(d).decode(ours, skip_special_tokens=False)
    for s in specials:
        if s in text:
            assert Tokenizer.from_dir(d).backend.token_to_id(s) in ours


def test_continue_final_message_matches_transformers(base: Path, tmp_path: Path) -> None:
    prefill = [*TURNS, {"role": "assistant", "content": "She said: "}]
    for family in ("qwen2.5", "llama3", "gemma"):
        d = _tokenizer_dir(base, tmp_path, family)
        ours = _our_ids(d, prefill, add_generation_prompt=False, continue_final_message=True)
        assert ours == _hf_ids(d, prefill, add_generation_prompt=False, continue_final_message=True)
        text = Tokenizer.from_dir(d).decode(ours, skip_special_tokens=False)
        assert text.rstrip().endswith("She said:")  # open: no end-of-turn after the prefill


def test_template_file_and_named_templates(base: Path, tmp_path: Path) -> None:
    d = _tokenizer_dir(base, tmp_path / "file", "smollm2", as_file=True)
    assert json.loads((d / "tokenizer_config.json").read_text()).get("chat_template") is None
    assert _our_ids(d, TURNS, add_generation_prompt=True) == _hf_ids(
        d, TURNS, add_generation_prompt=True
    )

    d = _tokenizer_dir(base, tmp_path / "named", "qwen3", named=True)
    for kw in ({}, {"tools": TOOLS}, {"chat_template": "tool_use"}):
        assert _our_ids(d, TURNS, add_generation_prompt=True, **kw) == _hf_ids(
            d, TURNS, add_generation_prompt=True, **kw
        )
    assert "# Tools" in ChatTemplate.from_dir(d).render(TURNS, tools=TOOLS)  # the tool_use one


def test_template_errors_are_clear(base: Path, tmp_path: Path) -> None:
    gemma = ChatTemplate.from_dir(_tokenizer_dir(base, tmp_path, "gemma"))
    with pytest.raises(ChatTemplateError, match="System role not supported"):
        gemma.render([SYSTEM, *TURNS])
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        gemma.render([TURNS[0], TURNS[0]])
    with pytest.raises(ValueError, match="choose one"):
        gemma.render(TURNS, add_generation_prompt=True, continue_final_message=True)
    with pytest.raises(ValueError, match="empty"):
        gemma.render([])
    with pytest.raises(TypeError, match="list of dicts"):
        gemma.render("hello")  # type: ignore[arg-type]
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    smol = ChatTemplate.from_dir(_tokenizer_dir(base, tmp_path, "smollm2"))
    with pytest.raises(ChatTemplateError, match="content as a string"):
        smol.render(parts)  # SmolLM2's template concatenates content with strings

    plain = make_tiny_model(tmp_path / "plain", "llama")  # no chat template
    with pytest.raises(NoChatTemplateError, match="chat_template=") as info:
        render_chat(Tokenizer.from_dir(plain), TURNS)
    assert "tokenizer_config.json" in str(info.value)
    custom = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    prompt = render_chat(Tokenizer.from_dir(plain), TURNS[:1], chat_template=custom)
    assert prompt.text == "user: Once upon a time, what did Lily find?\nassistant:"


def test_sandbox_and_helpers(base: Path, tmp_path: Path) -> None:
    t = ChatTemplate()
    with pytest.raises(ChatTemplateError):  # the sandbox refuses Python internals
        t.render(TURNS, chat_template="{{ messages.__class__.__mro__ }}")
    today = t.render(TURNS, chat_template="{{ strftime_now('%Y-%m-%d') }}")
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", today)
    out = t.render(
        TURNS,
        tools=TOOLS,
        chat_template="{% for x in [1, 2, 3] %}{% if x == 2 %}{% break %}{% endif %}"
        "{{ x }}{% endfor %}|{{ tools[0] | tojson(indent=2) }}",
    )
    assert out == "1|" + json.dumps(TOOLS[0], ensure_ascii=False, indent=2)
    assert "«today»" in out and "\\u00ab" not in out  # ensure_ascii=False, as transformers
