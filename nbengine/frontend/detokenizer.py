"""Incremental detokenization and stop-string detection for one completion.

Invariants kept by ``IncrementalDetokenizer`` (docs/lifecycle.md, "Text"):

- Output text is decoded *in the context of the prompt*: ``decode(prompt + output)`` is
  always ``decode(prompt) + text`` once finished (for byte-level BPE, SentencePiece-style
  Metaspace or Replace+Strip decoders, and WordPiece alike). Decoding the output ids
  alone would be wrong for the decoders that treat the first token of a text specially:
  SentencePiece's ``▁the`` starts a text as ``the`` but continues one as `` the``, and
  WordPiece joins words with spaces it never puts first. So the decode window starts
  with the last few prompt ids, as vLLM and text-generation-inference do.
- Decoding works on a sliding window ``[prefix_offset:]`` of prompt context + output
  ids; ``read_offset`` marks the end of the text already emitted. ``text`` grows by
  ``decode(window) - decode(window[:read_offset - prefix_offset])``, and only by text
  that ends on a complete character: a decode ending in U+FFFD (a UTF-8 character
  split across tokens) is held back until the character completes, or until
  ``finish()``.
- Stop strings are searched only in the newly decoded tail; the match that completes
  earliest wins. ``streamable_len()`` holds back ``max(len(stop)) - 1`` characters
  while the completion is live, so a delta that is emitted is never retracted.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from nbengine.sampling_params import SamplingParams

__all__ = ["IncrementalDetokenizer", "TokenizerLike"]

_REPLACEMENT = "\ufffd"
PROMPT_CONTEXT_TOKENS = 5
"""How many trailing prompt ids start the decode window (vLLM uses the same number):
enough for a decoder to see that the output continues a text, and for a character
split across the prompt's last tokens to decode whole."""


class TokenizerLike(Protocol):
    """What the frontend needs from a tokenizer (``nbengine.model.tokenizer.Tokenizer``)."""

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns the growing output token ids of one completion into text."""

    __slots__ = (
        "_tokenizer",
        "_skip_special",
        "token_ids",
        "_window_ids",
        "text",
        "_num_decoded",
        "_prefix_offset",
        "_read_offset",
        "_stop",
        "_include_stop",
        "_min_tokens",
        "_holdback",
        "stop_string",
        "finished",
        "_detokenize",
    )

    def __init__(
        self,
        tokenizer: TokenizerLike,
        params: SamplingParams,
        prompt_token_ids: Sequence[int] = (),
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = params.skip_special_tokens
        self._detokenize = params.detokenize  # False: token ids only, text stays ""
        self.token_ids: list[int] = []  # the output ids
        # Prompt context, then every output id; the offsets below index this list.
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._window_ids: list[int] = context
        self.text = ""
        self._num_decoded = len(context)  # ids covered by the decode window's end
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._stop = list(params.stop_strings)
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        # A partial stop string is never streamed: hold back all but one of its chars.
        self._holdback = (
            max(len(s) for s in self._stop) - 1 if self._stop and not self._include_stop else 0
        )
        self.stop_string: str | None = None  # the stop string that ended the completion
        self.finished = False

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def _advance(self, end: int, force: bool) -> str:
        """Decode the window up to ``end`` ids; return the new complete text (maybe "")."""
        window = self._window_ids[self._prefix_offset : end]
        prefix_len = self._read_offset - self._prefix_offset
        prefix_text = self._decode(window[:prefix_len]) if prefix_len else ""
        new_text = self._decode(window)
        if not force and (len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT)):
            return ""  # nothing new, or the last character is still incomplete
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = end
        return delta

    def update(self, new_token_ids: Sequence[int], exclude_last_text: bool = False) -> str | None:
        """Append new ids; return the stop string that ends the completion, if one matched.

        ``exclude_last_text`` keeps the last id out of the text (a stop token or EOS
        whose text is not to be shown, as vLLM does without include_stop_str_in_output).
        Once a stop string matched (or ``finish()`` ran) further ids are ignored.
        """
        if self.finished or not new_token_ids:
            return None
        self.token_ids.extend(new_token_ids)
        if not self._detokenize:
            return None
        self._window_ids.extend(new_token_ids)
        self._num_decoded = len(self._window_ids) - (1 if exclude_last_text else 0)
        if self._num_decoded <= self._read_offset:
            return None
        delta = self._advance(self._num_decoded, force=False)
        if not delta:
            return None
        self.text += delta
        if self._stop and len(self.token_ids) > self._min_tokens:
            return self._check_stop(len(delta))
        return None

    def _check_stop(self, new_chars: int) -> str | None:
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        text = self.text
        for stop in self._stop:
            start = max(0, len(text) - new_chars - len(stop) + 1)
            idx = text.find(stop, start)
            if idx < 0:
                continue
            cand = (idx + len(stop), idx, stop)
            if best is None or cand[:2] < best[:2]:
                best = cand
        if best is None:
            return None
        end, idx, stop = best
        self.text = text[:end] if self._include_stop else text[:idx]
        self.stop_string = stop
        self.finished = True
        return stop

    def finish(self) -> None:
        """Flush the held-back tail: ``text`` becomes the full decode of the decoded ids."""
        if self.finished:
            return
        self.finished = True
        if self._detokenize and self._num_decoded > self._read_offset:
            self.text += self._advance(self._num_decoded, force=True)

    def streamable_len(self, final: bool) -> int:
        """How many chars of ``text`` may be sent now (everything once final)."""
        if final or self.finished:
            return len(self.text)
        return max(0, len(self.text) - self._holdback)
