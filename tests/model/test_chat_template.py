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
import jinja2
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


# -- Chat templates are untrusted code: a render is bounded, and every failure is clear --

# Each of these would build gigabytes (MemoryError, or the kernel killed without a memory
# cap) or run for hours; each must stop at a bound with a ChatTemplateError naming it.
SIZE_BOMBS = {
    "str-times": "{{ 'a' * 10**10 }}",
    "list-times": "{{ (['a'] * 10**9)|length }}",
    "doubling-tilde": "{% set ns = namespace(s='ab') %}{% for i in range(40) %}"
    "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}",
    "doubling-plus": "{% set ns = namespace(s='ab') %}{% for i in range(40) %}"
    "{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s|length }}",
    "nested-list-doubling": "{% set ns = namespace(l=['ab']) %}{% for i in range(40) %}"
    "{% set ns.l = [ns.l, ns.l] %}{% endfor %}{{ ns.l }}",
    "int-squaring": "{% set ns = namespace(n=10) %}{% for i in range(40) %}"
    "{% set ns.n = ns.n * ns.n %}{% endfor %}{{ ns.n > 0 }}",
    "power": "{{ 10 ** 100000000 }}",
    "str.ljust": "{{ 'a'.ljust(10**10) }}",
    "str.zfill": "{{ '1'.zfill(10**10) }}",
    "str.expandtabs": "{{ ('\t' * 1000).expandtabs(10**8) }}",
    "str.format": "{{ '{:>10000000000}'.format('a') }}",
    "str.replace": "{{ ('a' * 1000).replace('', 'b' * 100000) }}",
    "str.translate": "{{ ('a' * 100000).translate({97: 'b' * 1000}) }}",
    "str.join": "{{ ('x' * 100000).join(range(100000)|map('string')) }}",
    "percent": "{{ '%10000000000d' % 1 }}",
    "filter-center": "{{ 'a'|center(10**10) }}",
    "folded-while-compiling": "{{ 'a'|center(10000000000) }}",
    "filter-indent": "{{ 'a\nb'|indent(10**10) }}",
    "filter-replace": "{{ ('a' * 1000)|replace('', 'b' * 100000) }}",
    "filter-join": "{{ range(100000)|map('string')|join('x' * 100000) }}",
    "filter-wordwrap": "{{ ('a ' * 10000)|wordwrap(1, wrapstring='b' * 1000) }}",
    "filter-format": "{{ '%10000000000s'|format('a') }}",
    "filter-slice": "{{ range(3)|slice(10**9)|list|length }}",
    "filter-batch": "{{ range(3)|batch(10**9, 'x')|list|length }}",
    "filter-tojson": "{{ messages|tojson(indent=10**10) }}",
    "lipsum": "{{ lipsum(10**8) }}",
    "many-outputs": "{% for i in range(100000) %}{% for j in range(100) %}{{ 'x' * 1000 }}"
    "{% endfor %}{% endfor %}",
    "template-text": "{% for i in range(100000) %}{% for j in range(100) %}"
    + "x" * 1000
    + "{% endfor %}{% endfor %}",
}


@pytest.mark.timeout(120)  # a hang-guard: each stops at once
@pytest.mark.parametrize("source", SIZE_BOMBS.values(), ids=SIZE_BOMBS.keys())
def test_output_bombs_stop_at_the_size_bound(source: str) -> None:
    import tracemalloc

    tracemalloc.start()
    try:
        with pytest.raises(ChatTemplateError) as info:
            ChatTemplate().render(TURNS, chat_template=source)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    message = str(info.value)
    # It stopped at the bound before building the value, not at a MemoryError.
    assert "bound" in message and "MemoryError" not in message, message
    assert re.search(r"characters|bits", message), message
    assert peak < 300 * 2**20, f"the render held {peak / 2**20:.0f} MiB"


RUNAWAY_LOOPS = {
    "nested-loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
    "{% endfor %}",
    "nested-map": "{% for i in range(100000) %}{% for j in range(100000)|map('string') %}"
    "{% endfor %}{% endfor %}done",
    "macro-fanout": "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}"
    "{% endmacro %}{{ f(40) }}",
    "recursive-loop": "{% for x in range(100000) recursive %}{% if loop.depth < 12 %}"
    "{{ loop(range(100000)) }}{% endif %}{% endfor %}",
}


@pytest.mark.timeout(300)  # a hang-guard: 10**10 iterations stop at the step bound
@pytest.mark.parametrize("source", RUNAWAY_LOOPS.values(), ids=RUNAWAY_LOOPS.keys())
def test_runaway_loops_stop_at_the_step_bound(source: str) -> None:
    with pytest.raises(ChatTemplateError, match=r"steps|time bound") as info:
        ChatTemplate().render(TURNS, chat_template=source)
    assert "bound" in str(info.value)


@pytest.mark.timeout(300)
def test_slow_steps_stop_at_the_time_bound() -> None:
    import threading

    from nbengine.model.chat_template import RenderLimits

    # Few steps (100k, under the step bound), each a replace over 2M characters: hours.
    source = (
        "{% set big = 'ab' * 1000000 %}{% for i in range(100000) %}"
        "{% set _ = big|replace('a', 'c') %}{% endfor %}"
    )
    threads = threading.active_count()
    with pytest.raises(ChatTemplateError, match=r"longer than 0.5 s, the time bound"):
        ChatTemplate(limits=RenderLimits(timeout_s=0.5)).render(TURNS, chat_template=source)
    assert threading.active_count() == threads  # rendered on the caller's thread


FAILING_TEMPLATES: dict[str, tuple[str, type[BaseException]]] = {
    "zero-division": ("{{ 1 / 0 }}", ZeroDivisionError),
    "float-overflow": ("{{ 2.0 ** 100000 }}", OverflowError),
    "recursion": ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", RecursionError),
    "range-too-big": ("{{ range(10**6)|list }}", OverflowError),
    "format-code": ("{{ '{:d}'.format('x') }}", ValueError),
    "compare": ("{{ 'a' < 1 }}", TypeError),
    "sandbox": ("{{ messages.__class__.__mro__ }}", jinja2.exceptions.SecurityError),
    "deep-source": ("{{ " + "(" * 3000 + "1" + ")" * 3000 + " }}", Exception),
}


@pytest.mark.parametrize("source,cause", FAILING_TEMPLATES.values(), ids=FAILING_TEMPLATES.keys())
def test_every_template_failure_is_a_chat_template_error(
    source: str, cause: type[BaseException]
) -> None:
    with pytest.raises(ChatTemplateError) as info:
        ChatTemplate().render(TURNS, chat_template=source)
    assert isinstance(info.value.__cause__, cause), repr(info.value.__cause__)
    # A template that writes a lone surrogate cannot be tokenized: refused here.
    with pytest.raises(ChatTemplateError, match="lone surrogate"):
        ChatTemplate().render(TURNS, chat_template="{{ 'a\\ud800' }}")


def _self_containing() -> dict[str, Any]:
    message: dict[str, Any] = {"role": "user", "content": "hi"}
    message["again"] = message
    return message


def _deep(levels: int) -> Any:
    value: Any = "leaf"
    for _ in range(levels):
        value = [value]
    return value


def _doubled(times: int) -> Any:
    value: Any = ["a"]
    for _ in range(times):
        value = [value, value]  # small in memory, 2**times values when copied
    return value


def _loop_content() -> list[Any]:
    content: list[Any] = []
    content.append(content)
    return content


USER = {"role": "user", "content": "hi"}
BAD_ARGUMENTS: dict[str, tuple[dict[str, Any], type[Exception], str]] = {
    "surrogate-content": (
        {"messages": [USER, {"role": "user", "content": "a\ud800b"}]},
        ValueError,
        r"messages\[1\]\['content'\] is not valid Unicode: it has a lone surrogate",
    ),
    "surrogate-part": (
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]},
        ValueError,
        r"messages\[0\]\['content'\]\[0\]\['text'\] is not valid Unicode",
    ),
    "surrogate-key": (
        {"messages": [{"role": "user", "content": "hi", "\ud800": 1}]},
        ValueError,
        r"A key of messages\[0\] is not valid Unicode",
    ),
    "surrogate-tool": (
        {"tools": [{"type": "function", "function": {"name": "\ud800"}}]},
        ValueError,
        r"tools\[0\]\['function'\]\['name'\] is not valid Unicode",
    ),
    "surrogate-kwarg": (
        {"chat_template_kwargs": {"x": "\ud800"}},
        ValueError,
        r"chat_template_kwargs\['x'\] is not valid Unicode",
    ),
    "self-containing": (
        {"messages": [USER, _self_containing()]},
        ValueError,
        r"messages\[1\] contains itself \(at messages\[1\]\['again'\]\)",
    ),
    "content-containing-itself": (
        {"messages": [{"role": "user", "content": _loop_content()}]},
        ValueError,
        r"messages\[0\]\['content'\] contains itself",
    ),
    "too-deep": (
        {"messages": [{"role": "user", "content": _deep(10000)}]},
        ValueError,
        r"messages\[0\]\['content'\] is nested more than \d+ deep",
    ),
    "expands-to-too-many": (
        {"messages": [{"role": "user", "content": "hi", "x": _doubled(40)}]},
        ValueError,
        r"messages\[0\]\['x'\] holds more than [\d,]+ values",
    ),
    "not-json": (
        {"messages": [{"role": "user", "content": {1, 2}}]},
        TypeError,
        r"messages\[0\]\['content'\] must be JSON-like .* got set",
    ),
    "role-not-str": (
        {"messages": [{"role": 5, "content": "hi"}]},
        TypeError,
        r"messages\[0\]\['role'\] must be a string, got int",
    ),
    "message-not-dict": ({"messages": [USER, 5]}, TypeError, r"messages\[1\] must be a dict"),
    "no-role": ({"messages": [{"content": "hi"}]}, ValueError, r"messages\[0\] has no 'role'"),
    "tools-int": ({"tools": 5}, TypeError, r"tools must be a list of JSON-schema dicts, got int"),
    "tools-str": ({"tools": "x"}, TypeError, r"tools must be a list .*got str"),
    "tool-int": ({"tools": [5]}, TypeError, r"tools\[0\] must be a dict, got int"),
    "kwargs-list": (
        {"chat_template_kwargs": [1, 2]},
        TypeError,
        r"chat_template_kwargs must be a dict of template variables, got list",
    ),
    "kwargs-int-key": (
        {"chat_template_kwargs": {1: 2}},
        TypeError,
        r"chat_template_kwargs keys must be strings, got 1",
    ),
    "kwargs-reserved": (
        {"chat_template_kwargs": {"messages": []}},
        ValueError,
        r"chat_template_kwargs may not set 'messages'",
    ),
    "kwargs-not-json": (
        {"chat_template_kwargs": {"x": object()}},
        TypeError,
        r"chat_template_kwargs\['x'\] must be JSON-like",
    ),
    "add_generation_prompt": (
        {"add_generation_prompt": "yes"},
        TypeError,
        r"add_generation_prompt must be a bool, got 'yes'",
    ),
    "continue_final_message": (
        {"continue_final_message": 1, "add_generation_prompt": False},
        TypeError,
        r"continue_final_message must be a bool, got 1",
    ),
}


@pytest.mark.timeout(120)  # a hang-guard: 2**40 copies are refused, not made
@pytest.mark.parametrize("kw,exc,match", BAD_ARGUMENTS.values(), ids=BAD_ARGUMENTS.keys())
def test_bad_arguments_are_refused_naming_the_argument(
    kw: dict[str, Any], exc: type[Exception], match: str
) -> None:
    kw = {"messages": TURNS, **kw}
    template = ChatTemplate({"default": "{% for m in messages %}{{ m['content'] }}{% endfor %}"})
    with pytest.raises(exc, match=match):
        template.render(kw.pop("messages"), **kw)
