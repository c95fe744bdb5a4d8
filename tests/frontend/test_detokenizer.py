"""The incremental detokenizer: exact text, no split characters, stop strings."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from nbengine.frontend.detokenizer import IncrementalDetokenizer
from nbengine.model.tokenizer import Tokenizer
from nbengine.sampling_params import SamplingParams

from fe_util import byte_token_ids


@pytest.fixture(scope="module")
def tok(tiny_model: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model)


def stream(detok: IncrementalDetokenizer, ids: list[int], chunk: int = 1) -> list[str]:
    """Feed ids; return the visible text after each update (what a consumer could see)."""
    seen = []
    for i in range(0, len(ids), chunk):
        detok.update(ids[i : i + chunk])
        seen.append(detok.text[: detok.streamable_len(False)])
        if detok.finished:
            break
    detok.finish()
    seen.append(detok.text)
    return seen


TEXTS = ["héllo wörld", "naïve café — 日本語 ok", "emoji 🎉🚀 done", "€uro ß ∑ 𝔘"]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 2])
def test_split_utf8_never_emitted_and_text_exact(tok: Tokenizer, text: str, chunk: int) -> None:
    ids = byte_token_ids(tok, text.encode())
    assert tok.decode(ids) == text
    detok = IncrementalDetokenizer(tok, SamplingParams())
    seen = stream(detok, ids, chunk)
    assert detok.text == text
    for s in seen:
        assert "\ufffd" not in s  # never half a character
        assert text.startswith(s)  # never retracted


def test_random_ids_match_full_decode(tok: Tokenizer) -> None:
    """Random (often invalid) byte/merge sequences: final text equals the full decode and
    every visible prefix is a prefix of it."""
    rng = random.Random(0)
    vocab = tok.vocab_size
    byte_ids = byte_token_ids(tok, bytes([0xE2, 0x82, 0xAC, 0xF0, 0x9F, 0x8E, 0x89, 0xC3, 0xA9]))
    for trial in range(200):
        ids = [
            rng.choice(byte_ids) if rng.random() < 0.6 else rng.randrange(vocab)
            for _ in range(rng.randrange(1, 40))
        ]
        detok = IncrementalDetokenizer(tok, SamplingParams())
        seen = stream(detok, ids, chunk=rng.choice([1, 1, 3]))
        full = tok.decode(ids)
        assert detok.text == full, (trial, ids)
        for s in seen:
            assert full.startswith(s)


def test_stop_string_across_tokens_truncates(tok: Tokenizer) -> None:
    ids = byte_token_ids(tok, b"abc STOP def")
    detok = IncrementalDetokenizer(tok, SamplingParams(stop=["STOP"]))
    seen = stream(detok, ids)
    assert detok.stop_string == "STOP"
    assert detok.text == "abc "
    for s in seen:
        assert "abc ".startswith(s)  # the partial "ST", "STO" never became visible
    detok = IncrementalDetokenizer(tok, SamplingParams(stop=["STOP"], include_stop_str_in_output=True))
    stream(detok, ids)
    assert detok.text == "abc STOP"


def test_earliest_stop_wins_and_min_tokens_gate(tok: Tokenizer) -> None:
    ids = byte_token_ids(tok, b"xx abcd yy")
    detok = IncrementalDetokenizer(tok, SamplingParams(stop=["bcd", "ab"]))
    detok.update(ids)  # one update with all the text: "ab" completes first
    assert detok.stop_string == "ab"
    assert detok.text == "xx "
    # Not checked before min_tokens: "ab" is complete at token 5, min_tokens=6.
    detok = IncrementalDetokenizer(tok, SamplingParams(stop=["ab"], min_tokens=6))
    for t in ids:
        detok.update([t])
    assert detok.stop_string is None
    assert detok.text == "xx abcd yy"


def test_hidden_stop_token_text(tok: Tokenizer) -> None:
    ids = byte_token_ids(tok, b"hi!")
    detok = IncrementalDetokenizer(tok, SamplingParams())
    detok.update(ids[:2])
    detok.update(ids[2:], exclude_last_text=True)
    detok.finish()
    assert detok.text == "hi"
    assert detok.token_ids == ids
