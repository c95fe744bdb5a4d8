"""Memory planning: the estimate before loading equals what is allocated, a model that
cannot fit fails before its weights are read, with the numbers, and
``kv_cache_memory_gb=None`` sizes the KV cache from free memory."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

import nbengine as nb
from nbengine.config import CacheConfig, EngineConfig, ModelConfig
from nbengine.model import load_model
from nbengine.model.loader import _weight_files
from nbengine.model.memory_plan import (
    InsufficientMemoryError,
    MemoryPlan,
    available_memory,
    format_bytes,
    plan_memory,
)
from nbengine.testing import TINY_LLAMA, make_tiny_model

KW = dict(max_num_seqs=4, block_size=16)


def _param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize(
    "arch,dtype,extra",
    [
        ("llama", "float32", {}),
        ("llama", "float32", {"tie_word_embeddings": True}),
        ("qwen3", "bfloat16", {}),
        ("gpt2", "float32", {}),
    ],
)
def test_weight_estimate_equals_the_loaded_parameters(
    tmp_path: Path, arch: str, dtype: str, extra: dict[str, object]
) -> None:
    path = make_tiny_model(tmp_path / arch, arch, **extra)
    plans: list[MemoryPlan] = []
    config = EngineConfig.from_kwargs(path, dtype=dtype, **KW)
    loaded = load_model(
        ModelConfig(model=path, dtype=dtype),
        before_weights=lambda *a: plans.append(plan_memory(config, *a)),
    )
    assert plans[0].weights_bytes == _param_bytes(loaded.model)


def test_engine_allocates_the_planned_kv_cache_and_shows_the_plan(tmp_path: Path) -> None:
    path = make_tiny_model(tmp_path / "m", "llama", **TINY_LLAMA)
    with nb.Engine(str(path), kv_cache_memory_gb=None, **KW) as engine:
        runner = engine._core.runner
        plan = runner.memory_plan
        allocated = sum(
            k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in runner.kv_caches
        )
        assert plan.kv_cache_bytes == allocated
        # Free memory is plentiful here, so the pool is what 4 full-length sequences use.
        assert plan.num_kv_blocks == 4 * (256 // 16) == runner.num_kv_blocks
        text = repr(engine)
    assert f"weights {format_bytes(plan.weights_bytes)} (float32)" in text
    assert f"KV cache {format_bytes(allocated)} ({plan.kv_tokens} tokens)" in text
    assert " free)" in text


def test_kv_cache_memory_gb_none_takes_what_is_free(tmp_path: Path) -> None:
    path = make_tiny_model(tmp_path / "m", "llama", **TINY_LLAMA)
    files = _weight_files(path)
    cfg = json.loads((path / "config.json").read_text())

    def plan(available: int, **kw: object) -> MemoryPlan:
        config = EngineConfig.from_kwargs(path, **{**KW, "kv_cache_memory_gb": None, **kw})
        return plan_memory(config, files, cfg, "LlamaForCausalLM", torch.float32, 256, available)

    big = plan(1 << 40)
    fixed = big.weights_bytes + big.buffers_bytes  # weights + RoPE tables
    assert big.buffers_bytes == 2 * 256 * 4 * 4  # cos and sin: 256 positions x 4 x float32
    per_block = big.kv_block_bytes  # 2 (K, V) * 2 layers * 16 tokens * 2 heads * 8 dims * 4 B
    assert per_block == 2 * 2 * 16 * 2 * 8 * 4
    assert big.num_kv_blocks == 4 * 16  # capped at what 4 sequences of 256 tokens can use
    # 40 blocks' worth free after the weights and the 10% headroom -> 40 blocks.
    avail = int((fixed + 40 * per_block + per_block // 2) / 0.9) + 1
    assert plan(avail).num_kv_blocks == 40
    with pytest.raises(InsufficientMemoryError, match="one 256-token sequence"):
        plan(int((fixed + 10 * per_block) / 0.9))  # 10 blocks < 16 per sequence
    # An explicit size is honoured, and checked: here it cannot fit.
    assert plan(1 << 40, kv_cache_memory_gb=1.0).num_kv_blocks == 64
    with pytest.raises(InsufficientMemoryError, match="does not fit in free memory"):
        plan(fixed + 10 * per_block, num_kv_blocks=11)


def test_a_context_too_long_for_free_memory_fails_with_numbers(tmp_path: Path) -> None:
    # 2**36 positions: one full-length sequence needs 2**36 tokens * 256 B = 16 TiB of KV
    # (K and V * 2 layers * 2 KV heads * 8 dims * 4 bytes = 256 B per token), more than
    # any machine this runs on.
    path = make_tiny_model(
        tmp_path / "long", "llama", **{**TINY_LLAMA, "max_position_embeddings": 1 << 36}
    )
    with pytest.raises(InsufficientMemoryError) as info:
        nb.Engine(str(path), kv_cache_memory_gb=None, **KW)
    msg = str(info.value)
    assert "68719476736-token sequence" in msg and "16.0 TiB" in msg and "256 B per token" in msg
    assert "RoPE tables take 2.0 TiB" in msg  # cos + sin: 2**36 positions x 4 x 4 B each
    assert "max_model_len" in msg
    # An explicit pool that large is refused as well, with both parts of the sum.
    with pytest.raises(InsufficientMemoryError, match=r"KV cache 3\.7 TiB \(1000000000 blocks"):
        nb.Engine(str(path), num_kv_blocks=10**9, **KW)


def test_weights_too_big_fail_before_they_are_read(tmp_path: Path) -> None:
    path = make_tiny_model(tmp_path / "huge", "llama", **TINY_LLAMA)
    # A header that declares a 1 TiB embedding, in a sparse file of that size (no disk is
    # used): reading it would take 1 TiB of memory, so the error below proves nothing was
    # read. (The header is checked against the file's size: model/weights.py.)
    header = {
        "model.embed_tokens.weight": {
            "dtype": "F32",
            "shape": [1 << 22, 1 << 16],
            "data_offsets": [0, 1 << 40],
        }
    }
    raw = json.dumps(header).encode()
    with open(path / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + (1 << 40))
    with pytest.raises(InsufficientMemoryError, match=r"weights 1\.0 TiB \(float32\)") as info:
        nb.Engine(str(path), **KW)
    assert 'dtype="bfloat16"' in str(info.value)


def test_config_accepts_none_and_the_machine_reports_free_memory() -> None:
    assert CacheConfig(kv_cache_memory_gb=None).kv_cache_memory_gb is None
    with pytest.raises(ValueError, match="positive"):
        CacheConfig(kv_cache_memory_gb=0)
    free = available_memory()
    assert free is None or free > 0


def test_the_onednn_twin_is_counted_and_dropped_when_memory_is_short(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On AMX CPUs bfloat16 linears keep a oneDNN copy (ops/linear.py): the plan counts it,
    shows it, and does without it when it would take over a quarter of free memory."""
    import nbengine.model.memory_plan as memory_plan

    monkeypatch.setattr(memory_plan, "onednn_twin_supported", lambda dtype: True)
    path = make_tiny_model(tmp_path / "m", "llama", **TINY_LLAMA)
    files = _weight_files(path)
    cfg = json.loads((path / "config.json").read_text())
    config = EngineConfig.from_kwargs(path, num_kv_blocks=16, **KW)

    def plan(available: int, quantization: str | None = None) -> MemoryPlan:
        config.model.quantization = quantization
        return plan_memory(config, files, cfg, "LlamaForCausalLM", torch.bfloat16, 256, available)

    roomy = plan(1 << 40)
    # TINY_LLAMA: 2 layers of q, k, v, o (32 x 32, 16 x 32 twice, 32 x 32) and gate, up,
    # down (64 x 32 each), plus lm_head (vocab x 32), in bfloat16.
    per_layer = 32 * 32 * 2 + 16 * 32 * 2 + 3 * 64 * 32
    assert roomy.onednn_twin_bytes == 2 * (2 * per_layer + cfg["vocab_size"] * 32)
    assert roomy.total_bytes == (
        roomy.weights_bytes + roomy.onednn_twin_bytes + roomy.buffers_bytes + roomy.kv_cache_bytes
    )
    assert "oneDNN copy of the linears" in roomy.summary()
    # Enough for weights, tables and KV cache, but the twin would take over a quarter.
    short = plan(int(3.9 * roomy.onednn_twin_bytes))
    assert short.total_bytes < short.available_bytes  # type: ignore[operator]
    assert short.onednn_twin_bytes == 0 and "oneDNN" not in short.summary()
    assert plan(1 << 40, quantization="int8").onednn_twin_bytes == 0  # quantized: no twin
