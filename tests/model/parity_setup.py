"""One tiny checkpoint loaded twice: by nbengine's ModelRunner and by transformers.

The parity suites (test_parity.py, test_parity_archs.py) compare the two in float32.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

from nbengine.config import EngineConfig
from nbengine.model.runner import ModelRunner


class ParitySetup:
    """The runner, the transformers model and the tokenized prompts for one checkpoint.

    ``hf_attn``: transformers' attention implementation (None: its default).
    ``stop_at_eos=False`` keeps transformers generating past EOS, as the runner's
    ``Driver(stop_at_eos=False)`` does.
    """

    def __init__(
        self,
        path: Path,
        texts: list[str],
        n_new: int,
        *,
        hf_attn: str | None = None,
        stop_at_eos: bool = True,
        **runner: Any,
    ) -> None:
        self.runner = ModelRunner(
            EngineConfig.from_kwargs(
                path, dtype="float32", block_size=4, num_kv_blocks=96, max_num_seqs=8, **runner
            )
        )
        hf_kw: dict[str, Any] = {"attn_implementation": hf_attn} if hf_attn else {}
        self.hf = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, **hf_kw
        ).eval()
        if not stop_at_eos:
            self.hf.generation_config.eos_token_id = None
        self.prompts = [self.runner.tokenizer.encode(t) for t in texts]
        self.n_new = n_new
        self._ref: dict[int, list[int]] = {}

    def hf_greedy(self, i: int) -> list[int]:
        """transformers' greedy continuation of prompt ``i`` (``n_new`` tokens, cached)."""
        if i not in self._ref:
            p = self.prompts[i]
            with torch.no_grad():
                out = self.hf.generate(
                    torch.tensor([p]), max_new_tokens=self.n_new, do_sample=False, pad_token_id=0
                )
            self._ref[i] = out[0, len(p) :].tolist()
        return self._ref[i]

    def hf_logprobs(self, ids: list[int]) -> torch.Tensor:
        """transformers' log-probabilities at every position of ``ids``."""
        with torch.no_grad():
            return self.hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)
