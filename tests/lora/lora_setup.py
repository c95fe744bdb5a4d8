"""Tiny base models and PEFT adapters for the LoRA tests, with transformers + PEFT as the
oracle (greedy, float32)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from nbengine.testing import make_tiny_model

transformers = __import__("transformers")
peft = __import__("peft")

TARGETS = {
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "qwen2": ["q_proj", "v_proj", "down_proj"],
    "gpt2": ["c_attn", "c_proj", "c_fc"],
    "gemma2": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],  # stored fused
}
PROMPTS = ["the quick brown fox", "hello world, this is", "one two three four five six"]
N_NEW = 8


def hf_base(path: Path) -> Any:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # as ignore_eos=True
    return model


def make_adapter(
    base_path: Path, out: Path, arch: str, seed: int, r: int = 4, **lora: Any
) -> tuple[Path, Any]:
    """A PEFT LoRA on the base at ``base_path`` with random non-zero lora_B, saved to
    ``out``; returns the directory and the PEFT model (the oracle)."""
    torch.manual_seed(seed)
    cfg = peft.LoraConfig(
        r=r,
        lora_alpha=lora.pop("lora_alpha", 2 * r),
        target_modules=lora.pop("target_modules", TARGETS[arch]),
        init_lora_weights=False,  # random B: the delta matters
        **lora,
    )
    model = peft.get_peft_model(hf_base(base_path), cfg)
    with torch.no_grad():  # big enough to change greedy tokens of a random model
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.5)
    model.eval()
    model.save_pretrained(out)
    return out, model


def hf_greedy(model: Any, ids: list[int], n_new: int = N_NEW) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=n_new, do_sample=False, pad_token_id=0
        )
    return out[0, len(ids) :].tolist()


def tiny(path: Path, arch: str) -> Path:
    """A tiny random base: nbengine.testing's archs, or one written by transformers
    itself (tests/model/hf_tiny.py) for Gemma 2 and Phi-3."""
    if arch in ("gemma2", "phi3"):
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "model"))
        from hf_tiny import make_hf_model

        return make_hf_model(path, arch)
    return make_tiny_model(path, arch)
