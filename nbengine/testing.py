"""Tiny random models for tests: ``make_tiny_model(path, arch)``.

Writes a complete Hugging Face-format directory (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json, generation_config.json) that both nbengine and
``transformers`` load. The tokenizer is a real byte-level BPE trained with the
``tokenizers`` library on a few KB of built-in English text (cached per process).
No network access and no ``transformers`` import.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gpt2")

# The shape the engine-level test suites share: small enough that a step takes about a
# millisecond, with grouped-query attention (4 query heads over 2 KV heads).
TINY_LLAMA: dict[str, int] = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)

_CORPUS = """\
Once upon a time, in a small village at the edge of a great forest, there lived a girl
named Lily. Every morning she walked to the river to fetch water, and every evening she
sat by the fire and listened to her grandmother tell stories about the old days. The
stories were about brave knights, clever foxes, and a dragon who slept under the hill.
One day Lily found a small blue stone in the river. It was warm, and it glowed softly when
she held it in her hand. She ran home to show it to her grandmother. "This is a wishing
stone," said the old woman. "But be careful what you wish for, because every wish has a
price." Lily thought for a long time. She did not want gold or a castle. She wanted her
friends to be happy and the village to be safe from the winter storms.
The engine reads a prompt, splits it into tokens, and computes the next token again and
again until it reaches the end. A model is a function from numbers to numbers; the
tokenizer turns text into numbers and back into text. The quick brown fox jumps over the
lazy dog. Pack my box with five dozen liquor jugs. How vexingly quick daft zebras jump!
In the morning the sun rose over the hills, and the birds began to sing. The children
went to school, the farmers went to the fields, and the baker opened his shop. People
said hello to each other in the street, and the day was bright and warm. In the
afternoon it started to rain, so everyone went inside and drank hot tea with honey.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 100 1000 2024 3.14 42.
Questions and answers: What is your name? My name is Tom. Where do you live? I live in
the city near the sea. What do you like to do? I like to read books, play games, write
code, and walk in the park with my dog. Python is a programming language; it has lists,
dicts, functions and classes. def main(): print("hello world") return 0
The cat sat on the mat. The dog ran in the garden. A bird flew over the house and the
little mouse hid under the table. They were all friends, and they lived happily ever after.
"""

# Special tokens per tokenizer family, in id order right after the byte alphabet.
_SPECIALS: dict[str, list[str]] = {
    "llama": ["<unk>", "<s>", "</s>"],
    "qwen": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    "gpt2": ["<|endoftext|>"],
}
_FAMILY = {"llama": "llama", "mistral": "llama", "qwen2": "qwen", "qwen3": "qwen", "gpt2": "gpt2"}
_TOKENIZER_VOCAB = 400

_cache_lock = threading.Lock()
_tokenizer_cache: dict[str, str] = {}  # family -> tokenizer.json text


def _train_tokenizer(family: str) -> str:
    """Train (or reuse) the byte-level BPE for ``family``; returns tokenizer.json text."""
    with _cache_lock:
        cached = _tokenizer_cache.get(family)
        if cached is not None:
            return cached
        specials = _SPECIALS[family]
        tok = HFTokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=_TOKENIZER_VOCAB,
            special_tokens=specials,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer=trainer)
        if family == "llama":
            bos = tok.token_to_id("<s>")
            tok.post_processor = processors.TemplateProcessing(
                single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
            )
        else:
            tok.post_processor = processors.ByteLevel(trim_offsets=False)
        text = tok.to_str()
        _tokenizer_cache[family] = text
        return text


def _base_config(arch: str, vocab: int, ids: dict[str, int | None]) -> dict[str, Any]:
    if arch == "gpt2":
        return {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "vocab_size": vocab,
            "n_embd": 64,
            "n_layer": 2,
            "n_head": 4,
            "n_inner": None,
            "n_positions": 256,
            "n_ctx": 256,
            "activation_function": "gelu_new",
            "layer_norm_epsilon": 1e-5,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|endoftext|>"],
            "tie_word_embeddings": True,
            "torch_dtype": "float32",
        }
    arch_names = {
        "llama": "LlamaForCausalLM",
        "mistral": "MistralForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
    }
    cfg: dict[str, Any] = {
        "architectures": [arch_names[arch]],
        "model_type": arch,
        "vocab_size": vocab,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_act": "silu",
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "attention_dropout": 0.0,
        "torch_dtype": "float32",
    }
    if _FAMILY[arch] == "llama":
        cfg["bos_token_id"] = ids["<s>"]
        cfg["eos_token_id"] = ids["</s>"]
    else:
        cfg["bos_token_id"] = ids["<|endoftext|>"]
        cfg["eos_token_id"] = ids["<|endoftext|>"]
    if arch == "llama":
        cfg["attention_bias"] = False
        cfg["mlp_bias"] = False
    if arch == "mistral":
        cfg["sliding_window"] = None
    if arch in ("qwen2", "qwen3"):
        cfg["use_sliding_window"] = False
        cfg["sliding_window"] = None
        cfg["max_window_layers"] = cfg["num_hidden_layers"]
    if arch == "qwen3":
        cfg["head_dim"] = 16
        cfg["attention_bias"] = False
    return cfg


# A weight still to be drawn: its shape, and the call that draws it. The calls run in
# the order the weights are listed, so the random stream (and the weights) are the same
# whether the file is written at once or streamed tensor by tensor.
_Lazy = tuple[tuple[int, ...], Callable[[], torch.Tensor]]


def _decoder_weights(cfg: dict[str, Any], gen: torch.Generator, std: float) -> dict[str, _Lazy]:
    h = cfg["hidden_size"]
    n_heads = cfg["num_attention_heads"]
    n_kv = cfg.get("num_key_value_heads") or n_heads
    hd = cfg.get("head_dim") or h // n_heads
    inter = cfg["intermediate_size"]
    vocab = cfg["vocab_size"]
    arch = cfg["model_type"]
    qkv_bias = arch == "qwen2" or bool(cfg.get("attention_bias"))
    o_bias = bool(cfg.get("attention_bias")) and arch != "qwen2"
    mlp_bias = bool(cfg.get("mlp_bias"))
    # With tied embeddings a large embedding makes greedy decoding repeat the input token.
    embed_std = 1.0
    if cfg.get("tie_word_embeddings"):
        embed_std, std = std, std * 2.0

    def rnd(*shape: int, s: float = std) -> _Lazy:
        return shape, lambda: torch.randn(*shape, generator=gen) * s

    def norm(n: int) -> _Lazy:
        return (n,), lambda: 1.0 + torch.randn(n, generator=gen) * 0.1

    w: dict[str, _Lazy] = {"model.embed_tokens.weight": rnd(vocab, h, s=embed_std)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(h)
        w[p + "post_attention_layernorm.weight"] = norm(h)
        w[p + "self_attn.q_proj.weight"] = rnd(n_heads * hd, h)
        w[p + "self_attn.k_proj.weight"] = rnd(n_kv * hd, h)
        w[p + "self_attn.v_proj.weight"] = rnd(n_kv * hd, h)
        w[p + "self_attn.o_proj.weight"] = rnd(h, n_heads * hd)
        if qkv_bias:
            w[p + "self_attn.q_proj.bias"] = rnd(n_heads * hd)
            w[p + "self_attn.k_proj.bias"] = rnd(n_kv * hd)
            w[p + "self_attn.v_proj.bias"] = rnd(n_kv * hd)
        if o_bias:
            w[p + "self_attn.o_proj.bias"] = rnd(h)
        if arch == "qwen3":
            w[p + "self_attn.q_norm.weight"] = norm(hd)
            w[p + "self_attn.k_norm.weight"] = norm(hd)
        w[p + "mlp.gate_proj.weight"] = rnd(inter, h)
        w[p + "mlp.up_proj.weight"] = rnd(inter, h)
        w[p + "mlp.down_proj.weight"] = rnd(h, inter)
        if mlp_bias:
            w[p + "mlp.gate_proj.bias"] = rnd(inter)
            w[p + "mlp.up_proj.bias"] = rnd(inter)
            w[p + "mlp.down_proj.bias"] = rnd(h)
    w["model.norm.weight"] = norm(h)
    if not cfg.get("tie_word_embeddings"):
        w["lm_head.weight"] = rnd(vocab, h)
    return w


def _gpt2_weights(cfg: dict[str, Any], gen: torch.Generator, std: float) -> dict[str, _Lazy]:
    h = cfg["n_embd"]
    inner = cfg.get("n_inner") or 4 * h
    vocab = cfg["vocab_size"]

    def rnd(*shape: int, s: float = std, plus: float = 0.0) -> _Lazy:
        return shape, lambda: plus + torch.randn(*shape, generator=gen) * s

    w: dict[str, _Lazy] = {
        "transformer.wte.weight": rnd(vocab, h, s=0.1),
        "transformer.wpe.weight": rnd(cfg["n_positions"], h, s=0.1),
    }
    for i in range(cfg["n_layer"]):
        p = f"transformer.h.{i}."
        for ln in ("ln_1", "ln_2"):
            w[p + ln + ".weight"] = rnd(h, s=0.1, plus=1.0)
            w[p + ln + ".bias"] = rnd(h, s=0.1)
        # GPT-2 Conv1D weights are stored [in, out].
        w[p + "attn.c_attn.weight"] = rnd(h, 3 * h)
        w[p + "attn.c_attn.bias"] = rnd(3 * h)
        w[p + "attn.c_proj.weight"] = rnd(h, h)
        w[p + "attn.c_proj.bias"] = rnd(h)
        w[p + "mlp.c_fc.weight"] = rnd(h, inner)
        w[p + "mlp.c_fc.bias"] = rnd(inner)
        w[p + "mlp.c_proj.weight"] = rnd(inner, h)
        w[p + "mlp.c_proj.bias"] = rnd(h)
    w["transformer.ln_f.weight"] = rnd(h, s=0.1, plus=1.0)
    w["transformer.ln_f.bias"] = rnd(h, s=0.1)
    if not cfg.get("tie_word_embeddings", True):
        w["lm_head.weight"] = rnd(vocab, h)
    return w


_ST_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


def _stream_safetensors(target: Path, weights: dict[str, _Lazy], dtype: torch.dtype) -> None:
    """Write ``weights`` as a safetensors file in ``dtype``, drawing one tensor at a time
    (the header first: every shape is known before any tensor is drawn). Written to a
    temporary name and renamed, so a file at ``target`` is always complete."""
    code = _ST_DTYPES[str(dtype).removeprefix("torch.")]
    size = torch.empty((), dtype=dtype).element_size()
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    at = 0
    for name, (shape, _) in weights.items():
        n = math.prod(shape) * size
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [at, at + n]}
        at += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format pads the header to 8 bytes
    tmp = target.with_name(target.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for _, make in weights.values():
            t = make().to(dtype).contiguous()
            f.write(t.view(torch.uint8).numpy().data)
            del t
    tmp.replace(target)


def make_tiny_model(path: str | Path, arch: str = "llama", seed: int = 0, **config: Any) -> Path:
    """Write a random-initialised tiny model of ``arch`` into ``path`` and return it.

    ``arch`` is one of ``"llama", "mistral", "qwen2", "qwen3", "gpt2"``. Keyword
    arguments override config.json fields (``hidden_size``, ``num_hidden_layers``,
    ``num_key_value_heads``, ``tie_word_embeddings``, ``rope_scaling``, ``vocab_size``...;
    GPT-2 uses its own names: ``n_embd``, ``n_layer``, ``n_head``, ``n_positions``).
    ``weight_std`` (not a config field) sets the std of the random projections;
    ``weights_dtype`` (not a config field: "float32", "bfloat16" or "float16") writes the
    weights in that dtype tensor by tensor (one tensor in memory at a time: the bench's
    models in real shapes, bench/workloads.py) and sets ``torch_dtype``; without it they
    are float32, written at once;
    ``chat_template`` (not a config field) is written into tokenizer_config.json
    (``QWEN_CHAT_TEMPLATE`` suits the qwen archs, whose tokenizers have ``<|im_start|>``
    and ``<|im_end|>``).
    The same ``(arch, seed, config)`` always writes the same weights.
    """
    if arch not in ARCHS:
        raise ValueError(f"Unknown arch {arch!r}; choose one of {ARCHS}.")
    std = float(config.pop("weight_std", 0.08))
    weights_dtype: str | None = config.pop("weights_dtype", None)
    if weights_dtype is not None and weights_dtype not in _ST_DTYPES:
        raise ValueError(
            f"weights_dtype must be one of {tuple(_ST_DTYPES)}, got {weights_dtype!r}."
        )
    chat_template: str | None = config.pop("chat_template", None)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    family = _FAMILY[arch]
    tok_json = _train_tokenizer(family)
    backend = HFTokenizer.from_str(tok_json)
    n_tok = backend.get_vocab_size(with_added_tokens=True)
    ids = {s: backend.token_to_id(s) for s in _SPECIALS[family]}

    cfg = _base_config(arch, n_tok, ids)
    cfg.update(config)
    if cfg.get("vocab_size", n_tok) < n_tok:
        raise ValueError(f"vocab_size must be at least the tokenizer's {n_tok} tokens.")
    if arch in ("qwen2", "qwen3") and "num_hidden_layers" in config:
        cfg["max_window_layers"] = cfg["num_hidden_layers"]
    if arch == "gpt2":
        cfg["n_ctx"] = cfg["n_positions"]

    gen = torch.Generator().manual_seed(seed)
    if arch == "gpt2":
        # Tied embeddings: the residual must move away from the input token's embedding,
        # or every greedy step repeats the last token; larger projections see to that.
        weights = _gpt2_weights(cfg, gen, std * 2.5)
    else:
        weights = _decoder_weights(cfg, gen, std)
    if weights_dtype is None:
        save_file(
            {k: make().contiguous() for k, (_, make) in weights.items()},
            str(path / "model.safetensors"),
            metadata={"format": "pt"},
        )
    else:
        cfg["torch_dtype"] = weights_dtype
        _stream_safetensors(path / "model.safetensors", weights, getattr(torch, weights_dtype))
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    (path / "tokenizer.json").write_text(tok_json)

    tok_cfg: dict[str, Any]
    gen_cfg: dict[str, Any]
    if family == "llama":
        tok_cfg = {
            "bos_token": "<s>",
            "eos_token": "</s>",
            "unk_token": "<unk>",
            "add_bos_token": True,
            "add_eos_token": False,
        }
        gen_cfg = {"bos_token_id": ids["<s>"], "eos_token_id": ids["</s>"]}
    elif family == "qwen":
        tok_cfg = {"bos_token": None, "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}
        gen_cfg = {
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": [ids["<|endoftext|>"], ids["<|im_end|>"]],
        }
    else:
        tok_cfg = {
            "bos_token": "<|endoftext|>",
            "eos_token": "<|endoftext|>",
            "unk_token": "<|endoftext|>",
        }
        gen_cfg = {"bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|endoftext|>"]}
    tok_cfg.update(
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": 1 << 30,
            "clean_up_tokenization_spaces": False,
        }
    )
    if chat_template is not None:
        tok_cfg["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    (path / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2))
    return path


# The ChatML chat template of Qwen2.5's instruct models (without its tool-calling
# branches), for tiny qwen models that chat: make_tiny_model(..., chat_template=...).
QWEN_CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) "
    "or (message.role == 'assistant') %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)


def _git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def make_hub_cache(
    cache_dir: str | Path, repo_id: str, model_dir: str | Path, revision: str = "main"
) -> Path:
    """Place the files of ``model_dir`` in a Hugging Face Hub cache as Hub model ``repo_id``.

    Lays the files out as ``huggingface_hub`` does when it downloads a snapshot, so that
    ``HF_HUB_CACHE=cache_dir`` (or ``HF_HOME=<dir>`` with ``cache_dir = <dir>/hub``) makes
    ``nb.Engine(repo_id)`` find them with no network::

        models--{org}--{name}/
          blobs/<etag>                      file contents: the sha256 for LFS files
                                            (*.safetensors), the git blob sha1 otherwise
          snapshots/<commit>/<file>         -> ../../blobs/<etag> (relative symlinks)
          refs/<revision>                   the commit hash, no newline

    The commit hash is derived from the files (the same files give the same commit).
    Returns the snapshot directory.
    """
    cache_dir, model_dir = Path(cache_dir), Path(model_dir)
    storage = cache_dir / ("models--" + repo_id.replace("/", "--"))
    files = sorted(p for p in model_dir.iterdir() if p.is_file())
    etags: dict[str, str] = {}
    for f in files:
        data = f.read_bytes()
        lfs = f.suffix == ".safetensors"
        etags[f.name] = hashlib.sha256(data).hexdigest() if lfs else _git_blob_sha1(data)
    commit = hashlib.sha1(
        "".join(f"{name}:{etag}\n" for name, etag in etags.items()).encode()
    ).hexdigest()
    snapshot = storage / "snapshots" / commit
    (storage / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for f in files:
        blob = storage / "blobs" / etags[f.name]
        if not blob.exists():
            blob.write_bytes(f.read_bytes())
        link = snapshot / f.name
        if not link.exists():
            os.symlink(os.path.join("..", "..", "blobs", etags[f.name]), link)
    (storage / "refs").mkdir(exist_ok=True)
    (storage / "refs" / revision).write_text(commit)
    return snapshot
