"""Reasoning parsers: a thinking model's ``<think> ... </think>`` split from its answer.

As vLLM's ``--reasoning-parser`` does, a parser splits a completion's text into the
reasoning (between the think tags) and the content (after the closing tag); the server
returns them as ``message.reasoning_content`` and ``message.content`` (and streams
``delta.reasoning_content`` / ``delta.content``) when started with a parser
(docs/serving.md, "Reasoning"). In Python::

    from nbengine.reasoning import split_reasoning

    out = engine.chat(messages).result()
    reasoning, content = split_reasoning(out.outputs[0].text, "qwen3", prompt=out.prompt)

The parsers (``REASONING_PARSERS``):

- ``"qwen3"`` (Qwen3, SmolLM3 and other models that write both tags): the text is
  reasoning only if it opens with ``<think>`` (leading whitespace aside), or if the
  prompt already ends with an open ``<think>`` (a template that opens the thinking for
  the model); otherwise all of it is content.
- ``"deepseek_r1"``: the text always starts inside the thinking (DeepSeek-R1's template
  opens it); a ``<think>`` the model writes first anyway is dropped.

Only the first closing tag ends the reasoning: tags after it are content. Thinking that
never closes (``max_tokens`` reached) is all reasoning. A streamed text gives the same
split at every cut into chunks: text that may be the start of a tag is held back until
the next chunk decides it (at most the tag's length less one character).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "REASONING_PARSERS",
    "ReasoningParser",
    "ReasoningStream",
    "get_reasoning_parser",
    "split_reasoning",
]

THINK_START = "<think>"
THINK_END = "</think>"


@dataclass(frozen=True, slots=True)
class ReasoningParser:
    """How one model family marks its reasoning: the tags, and whether the text starts
    inside the thinking whatever the prompt (``starts_inside``)."""

    name: str
    start: str = THINK_START
    end: str = THINK_END
    starts_inside: bool = False

    def opened_in(self, prompt: str | None) -> bool:
        """True if the text after ``prompt`` starts inside the thinking: always for a
        ``starts_inside`` parser, else when ``prompt`` ends (whitespace aside) with an
        open start tag."""
        if prompt is not None and not isinstance(prompt, str):
            raise TypeError(f"prompt must be a str or None, got {type(prompt).__name__}.")
        if self.starts_inside:
            return True
        return prompt is not None and prompt.rstrip().endswith(self.start)

    def stream(self, prompt: str | None = None) -> ReasoningStream:
        """A splitter for one streamed completion of ``prompt`` (the rendered prompt, for
        the case where the template opened the thinking)."""
        return ReasoningStream(self, inside=self.opened_in(prompt))

    def split(self, text: str, prompt: str | None = None) -> tuple[str | None, str | None]:
        """``(reasoning, content)`` of a whole completion; None for an empty part."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}.")
        reasoning, content = self.stream(prompt).feed(text, final=True)
        return reasoning or None, content or None


REASONING_PARSERS: dict[str, ReasoningParser] = {
    "qwen3": ReasoningParser("qwen3"),
    "deepseek_r1": ReasoningParser("deepseek_r1", starts_inside=True),
}
"""The parsers by name, as ``engine.serve(reasoning_parser=...)`` and ``nbengine serve
--reasoning-parser`` take them."""


def get_reasoning_parser(name: str) -> ReasoningParser:
    """The parser named ``name`` (a key of ``REASONING_PARSERS``), or a ValueError."""
    parser = REASONING_PARSERS.get(name) if isinstance(name, str) else None
    if parser is None:
        raise ValueError(
            f"reasoning_parser must be one of {sorted(REASONING_PARSERS)}, got {name!r}."
        )
    return parser


def split_reasoning(
    text: str, parser: str = "qwen3", *, prompt: str | None = None
) -> tuple[str | None, str | None]:
    """``(reasoning, content)`` of a completion's ``text`` by the parser named ``parser``
    (None for an empty part). ``prompt``: the rendered prompt (``RequestOutput.prompt``),
    which tells whether the chat template already opened the thinking."""
    return get_reasoning_parser(parser).split(text, prompt)


# The stream's states: before the first character that decides whether the text opens
# with a start tag; inside the reasoning; in the content (for good).
_START, _REASONING, _CONTENT = range(3)


class ReasoningStream:
    """The split of one streamed completion: ``feed`` each text delta, get the delta's
    ``(reasoning, content)``; ``final=True`` on the last one releases held-back text."""

    def __init__(self, parser: ReasoningParser, *, inside: bool) -> None:
        self._parser = parser
        self._inside = inside  # where the text starts when it does not open with a tag
        self._state = _START
        self._held = ""  # text not yet given out: it may still be (part of) a tag

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        """The reasoning and content text that ``delta`` (after the text fed before)
        adds; each may be empty."""
        text = self._held + delta
        self._held = ""
        reasoning = ""
        if self._state == _START:
            text = self._opening(text, final)
            if self._state == _START:
                return "", ""
        if self._state == _REASONING:
            reasoning, text = self._reasoning(text, final)
        return reasoning, text  # what is left of the text is content

    def _opening(self, text: str, final: bool) -> str:
        """Decide, if ``text`` allows, whether it opens with the start tag (then drop the
        tag and whitespace before it); returns the text after what was decided."""
        start = self._parser.start
        body = text.lstrip()
        if body.startswith(start):
            self._state = _REASONING
            return body[len(start) :]
        if not final and start.startswith(body):  # whitespace, or part of the tag
            self._held = text
            return ""
        self._state = _REASONING if self._inside else _CONTENT
        return text

    def _reasoning(self, text: str, final: bool) -> tuple[str, str]:
        """``(reasoning, content)`` of ``text`` read inside the thinking; a tail that may
        begin the end tag is held back unless ``final``."""
        end = self._parser.end
        at = text.find(end)
        if at >= 0:
            self._state = _CONTENT
            return text[:at], text[at + len(end) :]
        keep = 0 if final else _partial_suffix(text, end)
        if keep:
            self._held = text[-keep:]
            text = text[:-keep]
        return text, ""


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag`` (shorter than it)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
