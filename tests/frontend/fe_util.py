"""Byte-level token helpers of the frontend tests (the detokenizer's edge cases)."""

from __future__ import annotations

from nbengine.model.tokenizer import Tokenizer


def byte_token_ids(tok: Tokenizer, data: bytes) -> list[int]:
    """One token per byte (byte-level BPE's alphabet), splitting every multi-byte char."""
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = sorted(ByteLevel.alphabet())
    # GPT-2's bytes_to_unicode: printable bytes map to themselves, the rest to 256+.
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(0xA1, 0xAC + 1))
        + list(range(0xAE, 0xFF + 1))
    )
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
