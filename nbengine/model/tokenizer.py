"""The tokenizer of a Hugging Face-format model directory, through the `tokenizers` library.

Only ``tokenizer.json`` is required. ``tokenizer_config.json`` supplies the bos/eos token
strings; ``generation_config.json`` and ``config.json`` supply the eos ids. The union of
all eos ids found is ``eos_token_ids`` (as vLLM does with generation_config's list).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import tokenizers

from nbengine.model.errors import ModelLoadError
from nbengine.model.files import is_regular_file, read_json_object
from nbengine.validation import is_int

logger = logging.getLogger(__name__)


class TokenizerLoadError(ModelLoadError):
    """The directory has no usable tokenizer.json."""


def _token_content(value: object) -> str | None:
    """tokenizer_config stores special tokens as strings or as AddedToken dicts."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _as_id_list(value: object) -> list[int]:
    if isinstance(value, bool) or value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if is_int(v)]
    return []


class Tokenizer:
    """A thin wrapper over ``tokenizers.Tokenizer`` with the model's special ids."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        eos_token_ids: frozenset[int] = frozenset(),
        bos_token_id: int | None = None,
    ) -> None:
        self.backend = backend
        self.eos_token_ids = frozenset(eos_token_ids)
        self.bos_token_id = bos_token_id
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.all_special_ids: frozenset[int] = frozenset(
            tid for tid, tok in backend.get_added_tokens_decoder().items() if tok.special
        )
        self.path: Path | None = None  # the model directory, when loaded from one (chat templates)

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load ``tokenizer.json`` (and tokenizer_config.json, generation_config.json,
        config.json)."""
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not is_regular_file(tok_file, TokenizerLoadError):
            raise TokenizerLoadError(
                f"No tokenizer.json in {path}: nbengine needs a Hugging Face fast-tokenizer "
                "file (tokenizer.json) next to config.json."
            )
        try:
            backend = tokenizers.Tokenizer.from_file(str(tok_file))
        except Exception as exc:  # the Rust library raises a plain Exception
            raise TokenizerLoadError(f"Cannot load {tok_file}: {exc}") from exc
        tok_cfg = read_json_object(path / "tokenizer_config.json", TokenizerLoadError)
        gen_cfg = read_json_object(path / "generation_config.json", TokenizerLoadError)
        model_cfg = read_json_object(path / "config.json", TokenizerLoadError)

        eos: set[int] = set()
        eos.update(_as_id_list(gen_cfg.get("eos_token_id")))
        eos.update(_as_id_list(model_cfg.get("eos_token_id")))
        eos_str = _token_content(tok_cfg.get("eos_token"))
        if eos_str is not None:
            eos_id = backend.token_to_id(eos_str)
            if eos_id is not None:
                eos.add(eos_id)

        bos_id: int | None = None
        bos_str = _token_content(tok_cfg.get("bos_token"))
        if bos_str is not None:
            bos_id = backend.token_to_id(bos_str)
        if bos_id is None:
            ids = _as_id_list(gen_cfg.get("bos_token_id")) or _as_id_list(
                model_cfg.get("bos_token_id")
            )
            bos_id = ids[0] if ids else None
        tokenizer = cls(backend, frozenset(eos), bos_id)
        tokenizer.path = path
        return tokenizer

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (with the tokenizer's post-processor specials when asked)."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``token_ids``."""
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, token_ids: Sequence[int]) -> list[str]:
        """The vocabulary strings of ``token_ids`` (``""`` for an id outside the vocab)."""
        out: list[str] = []
        for tid in token_ids:
            tok = self.backend.id_to_token(int(tid))
            out.append(tok if tok is not None else "")
        return out

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token_id}, "
            f"eos={sorted(self.eos_token_ids)})"
        )
