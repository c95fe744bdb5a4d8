"""The incremental detokenizer: exact text, no split characters, stop strings."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from fe_util import byte_token_ids

from nbengine.frontend.detokenizer import IncrementalDetokenizer
from nbengine.model.tokenizer import Tokenizer
from nbengine.sampling_params import SamplingParams


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
    detok = IncrementalDetokenizer(
        tok, SamplingParams(stop=["STOP"], include_stop_str_in_output=True)
    )
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


# ----------------------------------------------------------------- tokenizer families
# Output text is decoded in the context of the prompt, so that for every decoder
# decode(prompt + output) == decode(prompt) + text. Each family's tokenizer.json is
# built here with the `tokenizers` library, the way those models' files are made.

_CORPUS = [
    "Hello the the cat sat on the mat.",
    "The quick brown fox jumps over the lazy dog.",
    "A list is a sequence; the dict maps keys to values.",
    "naïve café résumé — ok",
    "for x in range(10): print(x)",
    "Hello world, hello there, the end.",
]


def _llama2_style() -> Tokenizer:
    """Llama 2 / TinyLlama: normalizer prepends and replaces spaces by ▁; the decoder
    replaces ▁ back, falls back to bytes and strips one leading space."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, normalizers, trainers

    backend = Backend(models.BPE(byte_fallback=True, unk_token="<unk>"))
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    backend.train_from_iterator(
        _CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=specials, show_progress=False)
    )
    return Tokenizer(backend)


def _metaspace() -> Tokenizer:
    """Mistral-style: Metaspace pre-tokenizer and decoder (prepend_scheme "first")."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers

    backend = Backend(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    backend.train_from_iterator(
        _CORPUS,
        trainers.BpeTrainer(
            vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
        ),
    )
    return Tokenizer(backend)


def _wordpiece() -> Tokenizer:
    """BERT-style WordPiece: words joined by spaces, continuations marked ##."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers

    backend = Backend(models.WordPiece(unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece(prefix="##")
    backend.train_from_iterator(
        _CORPUS,
        trainers.WordPieceTrainer(
            vocab_size=300, special_tokens=["[UNK]", "[CLS]", "[SEP]"], show_progress=False
        ),
    )
    return Tokenizer(backend)


def _byte_level() -> Tokenizer:
    """GPT-2 / Llama 3 / Qwen: byte-level BPE."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers

    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(
        _CORPUS,
        trainers.BpeTrainer(
            vocab_size=400,
            special_tokens=["<|endoftext|>"],
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    return Tokenizer(backend)


FAMILIES = {
    "llama2": _llama2_style,
    "metaspace": _metaspace,
    "wordpiece": _wordpiece,
    "byte-level": _byte_level,
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_tok(request: pytest.FixtureRequest) -> Tokenizer:
    return FAMILIES[request.param]()


@pytest.mark.parametrize("prompt", ["Hello", "The quick brown", "naïve", "x"])
@pytest.mark.parametrize("chunk", [1, 3])
def test_prompt_plus_output_text_is_the_full_decode(
    family_tok: Tokenizer, prompt: str, chunk: int
) -> None:
    tok = family_tok
    prompt_ids = tok.encode(prompt, add_special_tokens=False)
    rng = random.Random(len(prompt) * 7 + chunk)
    pool = tok.encode(
        "the the cat sat on the mat, hello there naïve café", add_special_tokens=False
    )
    for trial in range(10):
        out_ids = [rng.choice(pool) for _ in range(rng.randrange(1, 12))]
        detok = IncrementalDetokenizer(tok, SamplingParams(), prompt_ids)
        seen = stream(detok, out_ids, chunk)
        full = tok.decode(prompt_ids + out_ids)
        assert tok.decode(prompt_ids) + detok.text == full, (trial, out_ids)
        assert all(detok.text.startswith(s) for s in seen)


def test_sentencepiece_output_keeps_the_leading_space() -> None:
    """'Hello' + ['▁the', '▁the'] reads 'Hello the the': the output is ' the the', as
    vLLM and transformers give it, and a stop string on the first word matches."""
    tok = _llama2_style()
    prompt_ids = tok.encode("Hello", add_special_tokens=False)
    out_ids = tok.encode("the the", add_special_tokens=False)
    assert tok.backend.id_to_token(out_ids[0]).startswith("▁")
    detok = IncrementalDetokenizer(tok, SamplingParams(), prompt_ids)
    stream(detok, out_ids)
    assert detok.text == " the the"
    stopper = IncrementalDetokenizer(tok, SamplingParams(stop=[" the"]), prompt_ids)
    assert stopper.update(out_ids[:1]) == " the" and stopper.text == ""
