"""InputProcessor: validates and tokenizes a ``generate()`` call on the caller's thread.

Everything a caller can get wrong is checked here, before anything is registered: the
request id's type, the sampling parameters, the priority, the prompt (a non-empty str,
or non-empty token ids inside the vocabulary) and its length against ``max_model_len``,
the KV pool and (without chunked prefill) one step's token budget: a prompt the core
could never schedule is refused here rather than finished "length" with no tokens.
A bad call raises ``TypeError``/``ValueError`` naming the problem and leaves no state
behind; a good one becomes a ``PreparedRequest`` that the loop thread registers.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from nbengine.frontend.lora import BASE, ResolvedLoRA
from nbengine.sampling_params import SamplingParams
from nbengine.structured_outputs import GrammarCompiler, GrammarMatcher
from nbengine.validation import check_encodable, is_int


@dataclass(slots=True)
class PreparedRequest:
    """A validated request, ready to register (built on the caller's thread)."""

    request_id: str | None  # None: the engine picks one
    prompt: str | None  # the text, when the prompt was given as text
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    arrival: float = field(default_factory=time.monotonic)
    # Written on the loop thread only: the handle once registered, or withdrawn=True if
    # the caller was interrupted first (then it must never be registered).
    handle: Any = None
    withdrawn: bool = False
    # Structured outputs: one grammar matcher per completion (n), built on the caller's
    # thread so that the engine core never compiles a grammar.
    grammars: list[GrammarMatcher] | None = None
    cache_salt: str | None = None  # from a prompt dict's "cache_salt"
    lora: ResolvedLoRA = BASE  # its LoRA adapter, loaded (docs/lora.md); BASE: none


class InputProcessor:
    """Turns a prompt and its parameters into a ``PreparedRequest`` (or raises)."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        max_model_len: int,
        default_params: SamplingParams | None = None,
        eos_token_ids: Iterable[int] = (),
        max_logprobs: int = 20,
        kv_pool: tuple[int, int] | None = None,
        max_prefill_tokens: int | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        # What a call without SamplingParams runs with (the model's generation_config).
        self.default_params = default_params if default_params is not None else SamplingParams()
        self.eos_token_ids = list(eos_token_ids)
        self.max_logprobs = max_logprobs  # -1: no bound
        self.kv_pool = kv_pool  # (blocks, tokens per block) of the smallest core's pool
        # One step's token budget when chunked prefill is off (a prompt is computed in
        # one step then); None when prompts may be computed in chunks.
        self.max_prefill_tokens = max_prefill_tokens
        self._grammars: GrammarCompiler | None = None

    @property
    def grammars(self) -> GrammarCompiler:
        """The grammar compiler and cache of structured outputs (built on first use)."""
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
        return self._grammars

    def bad_words_token_ids(self, bad_words: Sequence[str]) -> list[list[int]]:
        """vLLM's tokenization of ``bad_words``: each word as written (leading space
        stripped) and, where it tokenizes to as many tokens with a different first token,
        also with a leading space (the form a word takes inside a sentence)."""
        out: list[list[int]] = []
        for word in bad_words:
            for prefix in ("", " "):
                ids = list(self.tokenizer.encode(prefix + word.lstrip(), add_special_tokens=False))
                if not ids:
                    continue
                if prefix and out and (ids[0] == out[-1][0] or len(ids) != len(out[-1])):
                    continue
                out.append(ids)
        return out

    def prepare(
        self,
        prompt: str | Sequence[int] | dict[str, Any],
        sampling_params: SamplingParams | None,
        request_id: str | None,
        priority: int,
    ) -> PreparedRequest:
        """Validate one request (raises; leaves no state)."""
        if request_id is not None and not isinstance(request_id, str):
            raise TypeError(
                f"request_id must be a string, got {type(request_id).__name__} {request_id!r}."
            )
        if sampling_params is None:
            sampling_params = self.default_params  # frozen: safe to share
        elif not isinstance(sampling_params, SamplingParams):
            raise TypeError(
                f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}."
            )
        else:
            # The engine keeps its own validated copy: whatever the caller does to the
            # object (or a list or dict inside it) later never reaches the request.
            sampling_params = sampling_params.clone()
        if not is_int(priority):
            raise TypeError(f"priority must be an int, got {priority!r}.")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(sampling_params, name)
            if k is not None and k > self.vocab_size:
                raise ValueError(
                    f"{name}={k} asks for more log-probabilities than the model's "
                    f"vocabulary of {self.vocab_size} tokens."
                )
            if k is not None and self.max_logprobs != -1:
                wanted = self.vocab_size if k == -1 else k
                if wanted > self.max_logprobs:
                    raise ValueError(
                        f"{name}={k} asks for {wanted} log-probabilities, more than the "
                        f"engine's max_logprobs={self.max_logprobs} (raise it with "
                        f"Engine(max_logprobs=...); -1 lifts the bound)."
                    )
        if sampling_params.allowed_token_ids:
            outside = sorted(t for t in sampling_params.allowed_token_ids if t >= self.vocab_size)
            if outside:
                raise ValueError(
                    f"allowed_token_ids names token ids outside the model's vocabulary "
                    f"(0..{self.vocab_size - 1}): {outside[:5]}."
                )
        if sampling_params.bad_words:
            sampling_params = sampling_params.replace(
                bad_words_token_ids=self.bad_words_token_ids(sampling_params.bad_words)
            )
        if sampling_params.logit_bias:
            outside = sorted(t for t in sampling_params.logit_bias if t >= self.vocab_size)
            if outside:
                raise ValueError(
                    f"logit_bias names token ids outside the model's vocabulary "
                    f"(0..{self.vocab_size - 1}): {outside[:5]}."
                )
        prompt, cache_salt = _unwrap_prompt_dict(prompt)
        text: str | None
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("The prompt is empty; give at least one character or token.")
            check_encodable("The prompt", prompt)
            text = prompt
            ids = list(self.tokenizer.encode(prompt))
            if not ids:
                raise ValueError(f"The prompt {prompt!r} encodes to no tokens.")
        elif isinstance(prompt, Sequence) and not isinstance(prompt, (bytes, bytearray)):
            text = None
            ids = list(prompt)
            if not ids:
                raise ValueError("The prompt is empty; give at least one character or token.")
            for t in ids:
                if not is_int(t):
                    raise TypeError(f"Prompt token ids must be ints, got {t!r}.")
                if not 0 <= t < self.vocab_size:
                    raise ValueError(
                        f"Prompt token id {t} is outside the model's vocabulary "
                        f"(0..{self.vocab_size - 1})."
                    )
        else:
            raise TypeError(
                f"prompt must be a str or a list of token ids, got {type(prompt).__name__}."
            )
        k = sampling_params.truncate_prompt_tokens
        if k is not None:  # keep the last k prompt tokens (-1: the last max_model_len)
            ids = ids[-(self.max_model_len if k == -1 else k) :]
        self._check_prompt_fits(len(ids))
        prep = PreparedRequest(
            request_id, text, ids, sampling_params, priority, cache_salt=cache_salt
        )
        spec = sampling_params.structured_outputs
        if spec is not None:
            prep.grammars = [self.grammars.matcher(spec) for _ in range(sampling_params.n)]
        return prep

    def _check_prompt_fits(self, n: int) -> None:
        """Refuse a prompt of ``n`` tokens that no core could ever schedule."""
        if n > self.max_model_len:
            raise ValueError(
                f"The prompt has {n} tokens, more than max_model_len={self.max_model_len}."
            )
        if self.kv_pool is not None:
            blocks, size = self.kv_pool
            if n > blocks * size:
                raise ValueError(
                    f"The prompt has {n} tokens, more than the KV cache holds ({blocks} "
                    f"block{'s' if blocks != 1 else ''} of {size} tokens = {blocks * size} "
                    "tokens); a larger num_kv_blocks or kv_cache_memory_gb makes room."
                )
        if self.max_prefill_tokens is not None and n > self.max_prefill_tokens:
            raise ValueError(
                f"The prompt has {n} tokens, more than max_num_batched_tokens="
                f"{self.max_prefill_tokens} (one step's budget, which holds a whole prompt "
                "when chunked prefill is off); enable_chunked_prefill=True computes it in "
                "chunks."
            )


def _unwrap_prompt_dict(prompt: object) -> tuple[Any, str | None]:
    """vLLM's prompt dicts: ``{"prompt": text}`` or ``{"prompt_token_ids": ids}``, each
    with an optional ``"cache_salt"``; returns the prompt and the salt."""
    if not isinstance(prompt, dict):
        return prompt, None
    salt = prompt.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise TypeError(f"cache_salt must be a non-empty string, got {salt!r}.")
    keys = set(prompt) - {"cache_salt"}
    if keys == {"prompt"}:
        if not isinstance(prompt["prompt"], str):
            raise TypeError(f"prompt['prompt'] must be a str, got {prompt['prompt']!r}.")
        return prompt["prompt"], salt
    if keys == {"prompt_token_ids"}:
        ids = prompt["prompt_token_ids"]
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
            raise TypeError("prompt['prompt_token_ids'] must be a list of ints.")
        return list(ids), salt
    raise ValueError(
        "A prompt dict must have one key 'prompt' (text) or 'prompt_token_ids' (and "
        f"optionally 'cache_salt'); got {sorted(map(str, prompt))}."
    )
