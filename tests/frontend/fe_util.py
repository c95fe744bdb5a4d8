"""Helpers shared by the frontend tests."""

from __future__ import annotations

import nbengine as nb
from nbengine.model.tokenizer import Tokenizer
from nbengine.testing import TINY_LLAMA

TINY = {**TINY_LLAMA, "max_position_embeddings": 8192}
ENGINE_KW = dict(num_kv_blocks=1024, block_size=16, max_num_seqs=64, max_num_batched_tokens=512)


def byte_token_ids(tok: Tokenizer, data: bytes) -> list[int]:
    """One token per byte (byte-level BPE's alphabet), splitting every multi-byte char."""
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = sorted(ByteLevel.alphabet())
    # GPT-2's bytes_to_unicode: printable bytes map to themselves, the rest to 256+.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    b2u = {b: chr(c) for b, c in zip(bs, cs)}
    assert set(b2u.values()) == set(alphabet)
    ids = [tok.backend.token_to_id(b2u[b]) for b in data]
    assert all(i is not None for i in ids)
    return ids


def long_params(**kw: object) -> nb.SamplingParams:
    """A request that runs until aborted."""
    return nb.SamplingParams(max_tokens=100_000, ignore_eos=True, **kw)  # type: ignore[arg-type]
