"""``nbengine.reasoning``: think tags split from the content, whole and streamed."""

from __future__ import annotations

import pytest

from nbengine.reasoning import REASONING_PARSERS, get_reasoning_parser, split_reasoning

CASES = [
    # (parser, text, prompt, (reasoning, content))
    ("qwen3", "<think>a plan</think>The answer.", None, ("a plan", "The answer.")),
    ("qwen3", "\n<think>\nx\n</think>\n\nHi", None, ("\nx\n", "\n\nHi")),
    ("qwen3", "No thinking here.", None, (None, "No thinking here.")),
    ("qwen3", "a </think> b", None, (None, "a </think> b")),  # not opened: all content
    ("qwen3", "<think>cut off by max_tokens", None, ("cut off by max_tokens", None)),
    ("qwen3", "<think>r</think>", None, ("r", None)),
    ("qwen3", "<think>r</think>x<think>y</think>", None, ("r", "x<think>y</think>")),
    ("qwen3", "Hi <think>x</think>", None, (None, "Hi <think>x</think>")),
    ("qwen3", "<thin", None, (None, "<thin")),  # a tag that never completes is text
    ("qwen3", "", None, (None, None)),
    # The template opened the thinking: the text starts inside it.
    ("qwen3", "plan</think>Done.", "<|im_start|>assistant\n<think>\n", ("plan", "Done.")),
    ("qwen3", "plan</think>Done.", "<think>a</think>\nassistant\n", (None, "plan</think>Done.")),
    ("qwen3", "still thinking", "...<think>", ("still thinking", None)),
    # DeepSeek-R1: the text starts inside the thinking, with or without its own tag.
    ("deepseek_r1", "plan</think>Done.", None, ("plan", "Done.")),
    ("deepseek_r1", "<think>plan</think>Done.", None, ("plan", "Done.")),
    ("deepseek_r1", "never closed", None, ("never closed", None)),
    ("deepseek_r1", "</think>Only content", None, (None, "Only content")),
]


@pytest.mark.parametrize(("parser", "text", "prompt", "want"), CASES)
def test_split_reasoning(
    parser: str, text: str, prompt: str | None, want: tuple[str | None, str | None]
) -> None:
    assert split_reasoning(text, parser, prompt=prompt) == want


def _streamed(parser: str, chunks: list[str], prompt: str | None) -> tuple[str | None, str | None]:
    stream = get_reasoning_parser(parser).stream(prompt=prompt)
    reasoning: list[str] = []
    content: list[str] = []
    for i, chunk in enumerate(chunks):
        r, c = stream.feed(chunk, final=i == len(chunks) - 1)
        reasoning.append(r)
        content.append(c)
    joined_r, joined_c = "".join(reasoning), "".join(content)
    return joined_r or None, joined_c or None


@pytest.mark.parametrize(("parser", "text", "prompt", "want"), CASES)
def test_streamed_split_matches_the_whole_at_every_cut(
    parser: str, text: str, prompt: str | None, want: tuple[str | None, str | None]
) -> None:
    # Every cut into two chunks (so every tag split across chunks), and one chunk per
    # character.
    for cut in range(len(text) + 1):
        assert _streamed(parser, [text[:cut], text[cut:]], prompt) == want, cut
    assert _streamed(parser, [*text, ""], prompt) == want


def test_streamed_text_is_not_held_back_longer_than_a_possible_tag() -> None:
    stream = get_reasoning_parser("qwen3").stream()
    assert stream.feed("<thi") == ("", "")  # may still become <think>
    assert stream.feed("nk>I plan") == ("I plan", "")
    assert stream.feed(" more</th") == (" more", "")  # "</th" may be the end tag
    assert stream.feed("ink>Answer") == ("", "Answer")
    assert stream.feed(" <") == ("", " <")  # after the thinking, no tag is held back
    assert stream.feed("", final=True) == ("", "")


def test_an_unknown_parser_is_a_value_error_naming_the_choices() -> None:
    assert set(REASONING_PARSERS) == {"qwen3", "deepseek_r1"}
    with pytest.raises(ValueError, match=r"reasoning_parser must be one of .*'qwen3'"):
        get_reasoning_parser("nope")
    with pytest.raises(TypeError, match="text must be a str"):
        split_reasoning(b"<think>", "qwen3")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="prompt must be a str or None"):
        split_reasoning("x", "qwen3", prompt=[1, 2])  # type: ignore[arg-type]
