"""Compare xgrammar and llguidance on this CPU: grammar compile time and per-step mask cost.

Run: ``python scripts/compare_grammar_engines.py`` (needs both packages installed). Uses the
shipped default model's tokenizer (about 49k tokens). The numbers are recorded in
docs/structured-outputs.md ("Choice of grammar engine").

For each grammar kind (a JSON schema, a regex, a choice) it measures:
- compile: from the spec to a ready matcher (first call, caches cleared);
- mask: mean time to fill the next-token bitmask, over the steps of a greedy walk that
  always takes the first allowed token (so both engines walk the same kind of path).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

TOKENIZER = Path(__file__).resolve().parents[1] / "nbengine" / "default_model" / "tokenizer.json"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "active"],
    "additionalProperties": False,
}
REGEX = r"\d{3}-\d{4} [A-Z][a-z]{2,8}"
CHOICE = ["positive", "negative", "neutral"]
STEPS = 40


def _walk(fill, accept, first_allowed, done, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        if done():
            break
        t0 = time.perf_counter()
        mask = fill()
        times.append(time.perf_counter() - t0)
        tok = first_allowed(mask)
        if tok is None or not accept(tok):
            break
    return times


def _first_allowed(mask: torch.Tensor, vocab: int) -> int | None:
    bits = ((mask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:vocab]
    nz = bits.nonzero()
    # Prefer the last allowed token (usually a longer piece) so the walk moves forward.
    return int(nz[-1]) if len(nz) else None


def bench_llguidance(tok_json: str, vocab: int, eos: int) -> dict[str, tuple[float, float]]:
    import llguidance
    import llguidance.torch as lgt

    t0 = time.perf_counter()
    tok = llguidance.LLTokenizer(tok_json, n_vocab=vocab, eos_token=eos)
    tok_s = time.perf_counter() - t0
    specs = {
        "json": llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA)),
        "regex": llguidance.LLMatcher.grammar_from_regex(REGEX),
        "choice": llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c) for c in CHOICE)
        ),
    }
    out: dict[str, tuple[float, float]] = {"tokenizer": (tok_s, 0.0)}
    for name, grammar in specs.items():
        t0 = time.perf_counter()
        m = llguidance.LLMatcher(tok, grammar)
        assert not m.is_error(), m.get_error()
        compile_s = time.perf_counter() - t0
        bm = lgt.allocate_token_bitmask(1, vocab)

        def fill(m: Any = m, bm: torch.Tensor = bm) -> torch.Tensor:
            lgt.fill_next_token_bitmask(m, bm, 0)
            return bm[0]

        ts = _walk(fill, m.consume_token, lambda mk: _first_allowed(mk, vocab), m.is_stopped, STEPS)
        out[name] = (compile_s, statistics.mean(ts))
    return out


def bench_xgrammar(tok_json: str, vocab: int, eos: int) -> dict[str, tuple[float, float]]:
    import tokenizers
    import xgrammar as xgr

    backend = tokenizers.Tokenizer.from_str(tok_json)
    t0 = time.perf_counter()
    encoded = [backend.id_to_token(i) for i in range(vocab)]
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(tok_json)
    info = xgr.TokenizerInfo(
        encoded,
        vocab_type=meta["vocab_type"],
        vocab_size=vocab,
        stop_token_ids=[eos],
        add_prefix_space=meta["add_prefix_space"],
    )
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    tok_s = time.perf_counter() - t0
    out: dict[str, tuple[float, float]] = {"tokenizer": (tok_s, 0.0)}
    makers = {
        "json": lambda: compiler.compile_json_schema(json.dumps(SCHEMA)),
        "regex": lambda: compiler.compile_regex(REGEX),
        "choice": lambda: compiler.compile_grammar(
            "root ::= " + " | ".join(json.dumps(c) for c in CHOICE)
        ),
    }
    for name, make in makers.items():
        t0 = time.perf_counter()
        m = xgr.GrammarMatcher(make())
        compile_s = time.perf_counter() - t0
        bm = xgr.allocate_token_bitmask(1, vocab)

        def fill(m: Any = m, bm: torch.Tensor = bm) -> torch.Tensor:
            m.fill_next_token_bitmask(bm, 0)
            return bm[0]

        ts = _walk(
            fill, m.accept_token, lambda mk: _first_allowed(mk, vocab), m.is_terminated, STEPS
        )
        out[name] = (compile_s, statistics.mean(ts))
    return out


def _large_tokenizer(vocab: int) -> str:
    """A byte-level BPE tokenizer of ``vocab`` tokens, trained on the Python sources of the
    installed packages (the default model's own vocabulary is only 6k tokens); cached."""
    import sys

    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    cache = Path("/tmp") / f"nbengine-bpe-{vocab}.json"
    if cache.is_file():
        return cache.read_text(encoding="utf-8")
    site = Path(torch.__file__).resolve().parents[1]
    files = sorted(str(p) for p in site.rglob("*.py"))[:20000]
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    print(f"training a {vocab}-token BPE on {len(files)} files of {site} ...", file=sys.stderr)
    tok.train(files, trainer)
    text = tok.to_str()
    cache.write_text(text, encoding="utf-8")
    return text


def main() -> None:
    import sys

    import tokenizers

    torch.set_num_threads(1)
    sources = [("default model", TOKENIZER.read_text(encoding="utf-8"))]
    if "--default-only" not in sys.argv:
        sources.append(("49k BPE", _large_tokenizer(49152)))
    for label, tok_json in sources:
        backend = tokenizers.Tokenizer.from_str(tok_json)
        vocab = backend.get_vocab_size(with_added_tokens=True)
        print(f"== {label}: {vocab} tokens; up to {STEPS} steps per grammar; one thread")
        _compare(tok_json, vocab)


def _compare(tok_json: str, vocab: int) -> None:
    for name, fn in (("llguidance", bench_llguidance), ("xgrammar", bench_xgrammar)):
        try:
            res = fn(tok_json, vocab, 0)
        except ImportError as exc:
            print(f"{name}: not installed ({exc})")
            continue
        tok_s = res.pop("tokenizer")[0]
        print(f"{name}: tokenizer setup {tok_s * 1e3:.0f} ms")
        for kind, (c, m) in res.items():
            print(f"  {kind:6s} compile {c * 1e3:8.1f} ms   mask {m * 1e6:8.1f} us/step")


if __name__ == "__main__":
    main()
