"""Engine.chat and LLM.chat on a tiny Qwen2 model that has a ChatML chat template."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import nbengine as nb
from nbengine.model.chat_template import ChatTemplateError, NoChatTemplateError
from nbengine.testing import QWEN_CHAT_TEMPLATE, TINY_LLAMA, make_tiny_model

from support.models import ENGINE_KW

transformers = pytest.importorskip("transformers")

CONV = [
    {"role": "system", "content": "You tell short stories."},
    {"role": "user", "content": "Once upon a time"},
]


@pytest.fixture(scope="module")
def qwen_chat(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(
        tmp_path_factory.mktemp("qwen") / "chat",
        "qwen2",
        chat_template=QWEN_CHAT_TEMPLATE,
        **TINY_LLAMA,
    )


@pytest.fixture(scope="module")
def chat_engine(qwen_chat: Path) -> Iterator[nb.Engine]:
    with nb.Engine(str(qwen_chat), **ENGINE_KW) as eng:
        yield eng


def test_chat_prompt_is_the_rendered_conversation(chat_engine: nb.Engine, qwen_chat: Path) -> None:
    hf = transformers.AutoTokenizer.from_pretrained(qwen_chat)
    want = list(
        hf.apply_chat_template(CONV, tokenize=True, add_generation_prompt=True, return_dict=False)
    )
    h = chat_engine.chat(CONV, nb.SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    out = h.result(timeout=60)
    assert out.prompt_token_ids == want
    assert h.prompt == hf.apply_chat_template(CONV, tokenize=False, add_generation_prompt=True)
    assert h.prompt.endswith("<|im_start|>assistant\n")
    assert len(out.outputs[0].token_ids) == 5
    # The same ids through generate() give the same greedy reply.
    again = chat_engine.generate(
        want, nb.SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    ).result(timeout=60)
    assert again.outputs[0].token_ids == out.outputs[0].token_ids


def test_chat_stops_at_the_end_of_turn_token(chat_engine: nb.Engine) -> None:
    tok = chat_engine.tokenizer
    im_end = tok.backend.token_to_id("<|im_end|>")
    # <|im_end|> is not tokenizer_config's eos (<|endoftext|>): it comes from
    # generation_config.json's eos list, as in Qwen's own repos.
    assert tok.backend.token_to_id("<|endoftext|>") != im_end
    params = nb.SamplingParams(
        temperature=0, max_tokens=50, min_tokens=3, logit_bias={im_end: 100.0}
    )
    out = chat_engine.chat(CONV, params).result(timeout=60)
    c = out.outputs[0]
    assert c.finish_reason == "stop" and len(c.token_ids) == 4 and c.token_ids[-1] == im_end
    assert "<|im_end|>" not in c.text


def test_chat_rejects_bad_input_before_registering(chat_engine: nb.Engine, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="empty"):
        chat_engine.chat([])
    with pytest.raises(TypeError, match="SamplingParams"):
        chat_engine.chat(CONV, params="greedy")  # type: ignore[arg-type]
    assert chat_engine.num_unfinished_requests() == 0
    plain = make_tiny_model(tmp_path / "plain", "llama", **TINY_LLAMA)
    with nb.Engine(str(plain), **ENGINE_KW) as eng:
        with pytest.raises(NoChatTemplateError, match="chat_template="):
            eng.chat(CONV)
        h = eng.chat(
            CONV,
            nb.SamplingParams(max_tokens=2),
            chat_template="{% for m in messages %}{{ m['content'] }}\n{% endfor %}",
        )
        assert h.result(timeout=60).prompt_token_ids == eng.tokenizer.encode(
            "You tell short stories.\nOnce upon a time\n", add_special_tokens=False
        )


@pytest.mark.timeout(300)  # a hang-guard: the loop below would run 10**10 iterations
def test_chat_arguments_and_runaway_templates_fail_at_the_call(chat_engine: nb.Engine) -> None:
    # Each is refused by chat() itself, naming the argument, with no request left behind.
    lone = [CONV[0], {"role": "user", "content": "Once upon a \ud800 time"}]
    with pytest.raises(ValueError, match=r"messages\[1\]\['content'\] is not valid Unicode"):
        chat_engine.chat(lone)
    looped: dict[str, object] = {"role": "user", "content": "hi"}
    looped["self"] = looped
    with pytest.raises(ValueError, match=r"messages\[0\] contains itself"):
        chat_engine.chat([looped])
    with pytest.raises(TypeError, match="tools must be a list of JSON-schema dicts, got int"):
        chat_engine.chat(CONV, tools=5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="chat_template_kwargs must be a dict"):
        chat_engine.chat(CONV, chat_template_kwargs=[1, 2])  # type: ignore[arg-type]
    with pytest.raises(ChatTemplateError, match="size bound") as info:
        chat_engine.chat(CONV, chat_template="{{ 'a' * 10**10 }}")
    assert "MemoryError" not in str(info.value)
    loops = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    with pytest.raises(ChatTemplateError, match="steps|time bound"):
        chat_engine.chat(CONV, chat_template=loops)
    with pytest.raises(ChatTemplateError) as failed:
        chat_engine.chat(CONV, chat_template="{{ 1 / 0 }}")
    assert isinstance(failed.value.__cause__, ZeroDivisionError)
    assert chat_engine.num_unfinished_requests() == 0
    # The engine is unharmed: the next chat runs.
    out = chat_engine.chat(CONV, nb.SamplingParams(max_tokens=2, ignore_eos=True)).result(
        timeout=60
    )
    assert len(out.outputs[0].token_ids) == 2


def test_llm_chat_one_or_many_conversations(qwen_chat: Path) -> None:
    other = [{"role": "user", "content": "The dog ran"}]
    greedy = nb.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with nb.LLM(str(qwen_chat), **ENGINE_KW) as llm:
        many = llm.chat([CONV, other], greedy, use_tqdm=False)
        one = llm.chat(other, greedy, use_tqdm=False)
        cont = llm.chat(
            [*other, {"role": "assistant", "content": "and ran"}],
            greedy,
            use_tqdm=False,
            add_generation_prompt=False,
            continue_final_message=True,
        )
    assert len(many) == 2 and len(one) == 1
    assert (
        many[1].prompt == one[0].prompt
        and many[1].outputs[0].token_ids == one[0].outputs[0].token_ids
    )
    assert "Once upon a time" in many[0].prompt and "The dog ran" in many[1].prompt
    assert cont[0].prompt.endswith("<|im_start|>assistant\nand ran")


# ---------------------------------------------------------------- tool calls

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
ASK = [{"role": "user", "content": "Weather in Oslo?"}]
# A short template in Qwen's style (the module's model has max_model_len=256): tools in
# the system turn, calls as <tool_call> blocks, results as <tool_response>.
TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}"
    "{% endfor %}. Call as <tool_call>JSON</tool_call>.<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role + '\\n' }}"
    "{%- if m.role == 'tool' %}<tool_response>\n{{ m.content }}\n</tool_response>"
    "{%- else %}{{ m.content }}{% endif %}"
    "{%- for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>"
    "{%- endfor %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CALL_TEXT = (
    'Checking.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
)


def _scripted_params(engine: nb.Engine, text: str, **kw: object) -> nb.SamplingParams:
    from support.scripted import eos_id, scripted

    proc = scripted(engine.tokenizer, text, eos_id(engine.tokenizer))
    return nb.SamplingParams(max_tokens=200, logits_processors=[proc], **kw)  # type: ignore[arg-type]


def test_chat_with_tools_returns_the_parsed_calls(chat_engine: nb.Engine) -> None:
    params = _scripted_params(chat_engine, CALL_TEXT)
    # The template shows the <tool_call> format: the hermes parser by default.
    h = chat_engine.chat(ASK, params, tools=TOOLS, chat_template=TOOL_TEMPLATE)
    streamed = list(h)[-1]  # FINAL_ONLY: the stream's one output is the full final one
    for out in (h.result(timeout=60), streamed):
        c = out.outputs[0]
        assert c.text == CALL_TEXT  # the model's whole reply, as generated
        assert c.content == "Checking."
        assert c.tool_calls is not None and [(t.name, t.args) for t in c.tool_calls] == [
            ("weather", {"city": "Oslo"})
        ]
        assert c.tool_calls[0].id.startswith("call_") and c.tool_calls[0].type == "function"
    # One request's outputs name the same call by the same id.
    assert streamed.outputs[0].tool_calls == h.result().outputs[0].tool_calls
    # The template shows no tool format and no parser is named: nothing is parsed.
    plain = chat_engine.chat(ASK, params, tools=TOOLS).result(timeout=60).outputs[0]
    assert plain.text == CALL_TEXT and plain.tool_calls is None and plain.content is None
    # Naming a parser parses with it (a malformed call is content).
    llama = _scripted_params(chat_engine, '{"name": "weather", "parameters": {"city": "Oslo"}}')
    got = chat_engine.chat(ASK, llama, tools=TOOLS, tool_call_parser="llama3_json").result(
        timeout=60
    )
    assert [(t.name, t.args) for t in got.outputs[0].tool_calls or []] == [
        ("weather", {"city": "Oslo"})
    ]
    assert got.outputs[0].content is None
    bad = chat_engine.chat(ASK, params, tools=TOOLS, tool_call_parser="llama3_json").result(
        timeout=60
    )
    assert bad.outputs[0].tool_calls == [] and bad.outputs[0].content == CALL_TEXT


def test_chat_tool_call_history_reaches_the_template_with_decoded_arguments(
    chat_engine: nb.Engine,
) -> None:
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "weather", "arguments": '{"city": "Oslo"}'},
    }
    history = [
        *ASK,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "21 C"},
    ]
    h = chat_engine.chat(
        history, nb.SamplingParams(max_tokens=1), tools=TOOLS, chat_template=TOOL_TEMPLATE
    )
    h.result(timeout=60)
    assert '"arguments": {"city": "Oslo"}' in (h.prompt or "")  # a dict, not JSON text
    assert "<tool_response>\n21 C\n</tool_response>" in (h.prompt or "")
    with pytest.raises(ValueError, match=r"messages\[1\]\['tool_calls'\]\[0\]\['function'\]"):
        broken = {**call, "function": {"name": "weather", "arguments": "{oops"}}
        chat_engine.chat([*ASK, {"role": "assistant", "content": "", "tool_calls": [broken]}])
    with pytest.raises(ValueError, match="tool_call_parser must be one of"):
        chat_engine.chat(ASK, tools=TOOLS, tool_call_parser="qwen")
    assert chat_engine.num_unfinished_requests() == 0


def test_finish_with_completes_a_final_output_that_has_already_arrived(
    chat_engine: nb.Engine,
) -> None:
    h = chat_engine.generate("x", nb.SamplingParams(max_tokens=1, ignore_eos=True))
    out = h.result(timeout=60)
    h.finish_with(lambda o: setattr(o.outputs[0], "content", "seen"))
    assert out.outputs[0].content == "seen" and h.final_output is out


def test_llm_chat_with_tools_parses_each_output(qwen_chat: Path) -> None:
    with nb.LLM(str(qwen_chat), **ENGINE_KW) as llm:
        params = _scripted_params(llm.engine, CALL_TEXT)
        outs = llm.chat([ASK, ASK], params, use_tqdm=False, tools=TOOLS, tool_call_parser="hermes")
    for out in outs:
        assert [(t.name, t.args) for t in out.outputs[0].tool_calls or []] == [
            ("weather", {"city": "Oslo"})
        ]
        assert out.outputs[0].content == "Checking."
