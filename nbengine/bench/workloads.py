"""The bench's model and workloads: what every engine is given, identical from run to run.

- ``bench_model_dir``: random weights in SmolLM2-135M's shape (Llama), or in another
  real model's (``SHAPES``: ``nbengine bench --shape NAME``), bfloat16 safetensors
  written once to the cache directory and reused by every engine and every run.
- ``make_workloads``: seeded token-id workloads (scale shrinks counts and lengths; all
  greedy with ``ignore_eos``, so every engine produces exactly the requested tokens):

  - W1: 64 requests, prompt lengths uniform in 16..256, output lengths uniform in 16..128;
  - W2: one request decoding 256 tokens (a 32-token prompt);
  - W3: 64 requests sharing a 192-token prefix (+ 16 own tokens), 32 output tokens each;
  - W4: one request whose output repeats much of its prompt, the workload of n-gram
    speculative decoding (docs/speculative-decoding.md). A random 16-token cue; the
    passage is the model's own greedy continuation of the cue (96 tokens, made once by
    the engine under test without speculation, before timing: ``engine_continuation``);
    the prompt is cue + passage + cue again (a user pasting a passage the model would
    write and asking for it again), 128 output tokens. Built from the model because a
    model copies only text it would write itself: random-weight models do not copy
    random token ids, so a random-id passage gave drafts nothing to accept.
  - P1024 (on request only, ``--workloads P1024``): one 1024-token prompt, one output
    token: time to first token of a long prompt (prefill).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "ALL_WORKLOADS",
    "DEFAULT_SHAPE",
    "KNOWN_WORKLOADS",
    "SHAPES",
    "SMOLLM2_135M",
    "Workload",
    "Continuation",
    "bench_lora_adapters",
    "bench_model_dir",
    "engine_continuation",
    "make_workloads",
    "scaled",
]

ALL_WORKLOADS = ("W1", "W2", "W3", "W4")  # the bench's workloads (W1-W3 by default)
KNOWN_WORKLOADS = (*ALL_WORKLOADS, "P1024")  # what --workloads accepts

# SmolLM2-135M's shape (Llama architecture), random weights.
SMOLLM2_135M: dict[str, Any] = {
    "hidden_size": 576,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "intermediate_size": 1536,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
    "max_position_embeddings": 2048,
    "rope_theta": 100000.0,
    "rms_norm_eps": 1e-5,
}

# Llama 3.2's RoPE scaling (its config.json's rope_scaling).
_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _llama32(hidden: int, layers: int, heads: int, head_dim: int) -> dict[str, Any]:
    """A Llama 3.2 config.json: the sizes vary, the rest is the family's."""
    return {
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": 8,
        "head_dim": head_dim,
        "intermediate_size": 8192,
        "vocab_size": 128256,
        "tie_word_embeddings": True,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": _LLAMA3_ROPE,
        "rms_norm_eps": 1e-5,
    }


# Name -> (make_tiny_model arch, config.json fields): the dimensions of each real model
# (from its config.json on the Hub), with random weights. The tokenizer is the tiny
# test one; ids past it are placeholders (the workloads are token ids).
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "smollm2-135m": ("llama", SMOLLM2_135M),
    "llama-3.2-1b": ("llama", _llama32(hidden=2048, layers=16, heads=32, head_dim=64)),
    "qwen2.5-1.5b": (
        "qwen2",
        {
            "hidden_size": 1536,
            "num_hidden_layers": 28,
            "num_attention_heads": 12,
            "num_key_value_heads": 2,
            "intermediate_size": 8960,
            "vocab_size": 151936,
            "tie_word_embeddings": True,
            "max_position_embeddings": 32768,
            "rope_theta": 1000000.0,
            "rms_norm_eps": 1e-6,
        },
    ),
    "llama-3.2-3b": ("llama", _llama32(hidden=3072, layers=28, heads=24, head_dim=128)),
}
DEFAULT_SHAPE = "smollm2-135m"


@dataclass(slots=True)
class Workload:
    """Prompts (token ids) and the number of output tokens each must produce."""

    name: str
    prompts: list[list[int]]
    output_lens: list[int]
    shared_prefix: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt tokens over all requests."""
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        """Output tokens over all requests."""
        return sum(self.output_lens)


def bench_model_dir(
    cache_dir: str | Path | None = None, shape: str = DEFAULT_SHAPE, **config: Any
) -> Path:
    """A random-initialised model in ``shape``'s dimensions (``SHAPES``; ``config``
    overrides fields), bfloat16 safetensors written once into the cache and reused."""
    from nbengine.testing import make_tiny_model

    if shape not in SHAPES:
        raise ValueError(f"shape must be one of {tuple(SHAPES)}, got {shape!r}.")
    arch, fields = SHAPES[shape]
    cfg = {**fields, **config}
    ident = {**cfg, "arch": arch, "weights_dtype": "bfloat16"}
    key = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:12]
    root = (
        Path(cache_dir)
        if cache_dir is not None
        else Path(os.environ.get("NBENGINE_CACHE", Path.home() / ".cache" / "nbengine")) / "bench"
    )
    path = root / f"{shape}-random-{key}"
    if not (path / ".complete").is_file():
        make_tiny_model(path, arch=arch, seed=0, weight_std=0.02, weights_dtype="bfloat16", **cfg)
        (path / ".complete").write_text("ok\n")
    return path


def scaled(n: int, scale: float, lo: int) -> int:
    """``n * scale`` rounded, at least ``lo``."""
    return max(lo, round(n * scale))


Continuation = Callable[[list[int], int], list[int]]
"""``(prompt_ids, n) -> the model's n greedy output ids`` (W4's passage)."""


def _fingerprint(model_dir: Path) -> dict[str, Any]:
    """What identifies a model directory's weights: its path, config and files' sizes/mtimes."""
    files = sorted(p for p in model_dir.iterdir() if p.is_file() and not p.name.startswith("."))
    return {
        "dir": str(model_dir.resolve()),
        "config": (model_dir / "config.json").read_text(encoding="utf-8"),
        "files": [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files],
    }


def engine_continuation(
    model_dir: str | Path,
    dtype: str = "bfloat16",
    engine_kwargs: dict[str, Any] | None = None,
    cache_dir: str | Path | None = None,
) -> Continuation:
    """A ``Continuation`` run by ``nb.Engine`` on ``model_dir`` (greedy, ``ignore_eos``,
    no speculation), cached as JSON per (model, dtype, engine arguments, prompt, n) under
    ``cache_dir`` (default: the bench cache's ``w4/``), so each model's passage is made once."""
    path = Path(model_dir)
    ekw = {k: v for k, v in (engine_kwargs or {}).items() if k != "speculative_config"}
    root = (
        Path(cache_dir)
        if cache_dir is not None
        else Path(os.environ.get("NBENGINE_CACHE", Path.home() / ".cache" / "nbengine")) / "w4"
    )

    def run(prompt: list[int], n: int) -> list[int]:
        ident: dict[str, Any] = {"model": _fingerprint(path), "dtype": dtype, "engine": ekw}
        ident.update(prompt=prompt, n=n)
        key = hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode())
        file = root / f"{key.hexdigest()[:16]}.json"
        if file.is_file():
            return [int(t) for t in json.loads(file.read_text())]
        ids = _greedy(path, dtype, ekw, prompt, n)
        root.mkdir(parents=True, exist_ok=True)
        tmp = file.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(ids))
        tmp.replace(file)  # atomic: a concurrent reader sees all of it or none
        return ids

    return run


def _greedy(
    model_dir: Path, dtype: str, engine_kwargs: dict[str, Any], prompt: list[int], n: int
) -> list[int]:
    """``n`` greedy tokens after ``prompt`` from a fresh engine on ``model_dir``."""
    import nbengine as nb

    kw = {"max_model_len": max(64, len(prompt) + n), **engine_kwargs, "dtype": dtype}
    engine = nb.Engine(str(model_dir), **kw)
    try:
        sp = nb.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        return list(engine.generate(prompt, sp).result().outputs[0].token_ids)
    finally:
        engine.shutdown()


def make_workloads(
    names: Sequence[str],
    vocab: int,
    scale: float = 1.0,
    seed: int = 0,
    continuation: Continuation | None = None,
) -> dict[str, Workload]:
    """Deterministic workloads: the same ``(names, vocab, scale, seed)`` give the same token
    ids (W4: and the same model; it needs ``continuation``, the model's greedy output)."""
    if "W4" in names and continuation is None:
        raise ValueError(
            "make_workloads: W4 needs continuation= (the model's greedy output, e.g. "
            "engine_continuation(model_dir)): its passage is text the model writes."
        )
    out: dict[str, Workload] = {}
    hi_id = vocab - 1
    for name in names:
        rng = random.Random(f"{seed}-{name}")

        def ids(n: int, rng: random.Random = rng) -> list[int]:
            return [rng.randint(3, hi_id) for _ in range(n)]

        if name == "W1":
            n = scaled(64, scale, 2)
            p_lo, p_hi = scaled(16, scale, 2), scaled(256, scale, 4)
            o_lo, o_hi = scaled(16, scale, 2), scaled(128, scale, 4)
            prompts = [ids(rng.randint(p_lo, p_hi)) for _ in range(n)]
            outs = [rng.randint(o_lo, o_hi) for _ in range(n)]
            out[name] = Workload(name, prompts, outs)
        elif name == "W2":
            out[name] = Workload(name, [ids(scaled(32, scale, 4))], [scaled(256, scale, 8)])
        elif name == "W3":
            n = scaled(64, scale, 2)
            prefix = ids(scaled(192, scale, 32))
            prompts = [prefix + ids(16) for _ in range(n)]
            out[name] = Workload(name, prompts, [scaled(32, scale, 4)] * n, len(prefix))
        elif name == "W4":
            assert continuation is not None  # checked above
            cue = ids(scaled(16, scale, 4))
            passage = continuation(cue, scaled(96, scale, 16))
            out[name] = Workload(name, [cue + passage + cue], [scaled(128, scale, 8)])
        elif name == "P1024":
            out[name] = Workload(name, [ids(scaled(1024, scale, 16))], [1])
        else:
            raise ValueError(f"Unknown workload {name!r}; choose from {KNOWN_WORKLOADS}.")
    return out


def bench_lora_adapters(model_dir: str | Path, n: int, rank: int) -> list[Path]:
    """``n`` random PEFT LoRA adapters of ``rank`` on every q/k/v/o/gate/up/down projection
    of the Llama-shaped model at ``model_dir``, cached beside it (docs/lora.md)."""
    import torch
    from safetensors.torch import save_file

    model_dir = Path(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    hidden, inter = int(cfg["hidden_size"]), int(cfg["intermediate_size"])
    heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    kv = int(cfg.get("num_key_value_heads") or heads) * head_dim
    shapes = {  # module -> (in, out)
        "self_attn.q_proj": (hidden, heads * head_dim),
        "self_attn.k_proj": (hidden, kv),
        "self_attn.v_proj": (hidden, kv),
        "self_attn.o_proj": (heads * head_dim, hidden),
        "mlp.gate_proj": (hidden, inter),
        "mlp.up_proj": (hidden, inter),
        "mlp.down_proj": (inter, hidden),
    }
    out: list[Path] = []
    for i in range(n):
        path = model_dir.parent / f"{model_dir.name}-lora-r{rank}-{i}"
        out.append(path)
        if (path / ".complete").is_file():
            continue
        path.mkdir(parents=True, exist_ok=True)
        gen = torch.Generator().manual_seed(1000 + i)
        tensors: dict[str, torch.Tensor] = {}
        for layer in range(int(cfg["num_hidden_layers"])):
            for module, (d_in, d_out) in shapes.items():
                key = f"base_model.model.model.layers.{layer}.{module}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, d_in, generator=gen) * 0.02
                tensors[f"{key}.lora_B.weight"] = torch.randn(d_out, rank, generator=gen) * 0.02
        save_file(tensors, str(path / "adapter_model.safetensors"))
        config = {
            "peft_type": "LORA",
            "r": rank,
            "lora_alpha": 2 * rank,
            "target_modules": sorted({m.split(".")[1] for m in shapes}),
            "bias": "none",
        }
        (path / "adapter_config.json").write_text(json.dumps(config), encoding="utf-8")
        (path / ".complete").write_text("ok\n")
    return out
