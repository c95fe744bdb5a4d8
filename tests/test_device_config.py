"""``device`` and ``gpu_memory_utilization``: validation at ``Engine()``, dtype "auto" on a
CUDA device, and the KV cache sized from a GPU's memory (planned here with given
numbers: the machine running the tests needs no GPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import nbengine as nb
from nbengine.config import CacheConfig, EngineConfig, ModelConfig, resolve_device
from nbengine.model.loader import _weight_files, auto_dtype
from nbengine.model.memory_plan import InsufficientMemoryError, activation_bytes, plan_memory
from nbengine.testing import TINY_LLAMA, make_tiny_model

from support.threads import engine_threads

ROOT = Path(__file__).resolve().parents[1]
GIB = 1 << 30


def test_device_auto_and_cpu_resolve_to_a_torch_device_string() -> None:
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert ModelConfig(device="auto").device == expected
    assert ModelConfig().device == expected  # "auto" is the default
    assert ModelConfig(device="CPU").device == "cpu"
    assert ModelConfig(device=torch.device("cpu")).device == "cpu"  # type: ignore[arg-type]
    torch.device(ModelConfig(device="cpu").device)  # usable as-is


@pytest.mark.parametrize("bad", ["mps", "cuda:x", "gpu", "", "cuda:-1"])
def test_unknown_devices_are_value_errors_naming_device(bad: str) -> None:
    with pytest.raises(ValueError, match="device"):
        ModelConfig(device=bad)


@pytest.mark.parametrize("bad", [0, None, 1.5, ["cpu"]])
def test_non_string_devices_are_type_errors_naming_device(bad: object) -> None:
    with pytest.raises(TypeError, match="device"):
        ModelConfig(device=bad)  # type: ignore[arg-type]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
def test_cuda_without_a_gpu_fails_at_engine_with_no_threads_left(tiny_model: Path) -> None:
    before = set(engine_threads())
    for device in ("cuda", "cuda:0", "cuda:1"):
        with pytest.raises(ValueError, match=r"device='cuda.*torch\.cuda\.is_available\(\)"):
            nb.Engine(str(tiny_model), device=device)
    assert set(engine_threads()) == before


def test_cuda_index_beyond_the_gpus_is_a_value_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda:1") == "cuda:1"
    assert resolve_device("auto") == "cuda"
    with pytest.raises(ValueError, match=r"device='cuda:2': torch sees 2 CUDA GPU"):
        resolve_device("cuda:2")


@pytest.mark.parametrize("bad", [0, 0.0, -0.1, 1.01, 2])
def test_gpu_memory_utilization_is_a_fraction(bad: float) -> None:
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        CacheConfig(gpu_memory_utilization=bad)


@pytest.mark.parametrize("bad", ["0.5", True, None])
def test_gpu_memory_utilization_must_be_a_number(bad: object) -> None:
    with pytest.raises(TypeError, match="gpu_memory_utilization"):
        CacheConfig(gpu_memory_utilization=bad)  # type: ignore[arg-type]


def test_engine_kwargs_reach_the_config() -> None:
    cfg = EngineConfig.from_kwargs(None, device="cpu", gpu_memory_utilization=0.5)
    assert cfg.model.device == "cpu" and cfg.cache.gpu_memory_utilization == 0.5
    assert CacheConfig().gpu_memory_utilization == 0.9  # vLLM's default


def test_quantization_is_cpu_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="quantization='int8' runs on the CPU only"):
        ModelConfig(device="cuda", quantization="int8")


def test_auto_dtype_on_cuda_is_the_checkpoints_half_precision(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert auto_dtype({"torch_dtype": "bfloat16"}, "cuda") == "bfloat16"
    assert auto_dtype({"torch_dtype": "float16"}, "cuda:0") == "float16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert auto_dtype({"torch_dtype": "float32"}, "cuda") == "bfloat16"
    assert auto_dtype({}, "cuda") == "bfloat16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert auto_dtype({"torch_dtype": "float32"}, "cuda") == "float16"
    # The CPU keeps its rule: float16 is never chosen there.
    assert auto_dtype({"torch_dtype": "float16"}, "cpu") in ("bfloat16", "float32")


def _gpu_plan(path: Path, free: int, total: int, **kw: object):  # type: ignore[no-untyped-def]
    files = _weight_files(path)
    cfg = json.loads((path / "config.json").read_text())
    config = EngineConfig.from_kwargs(path, device="cpu", max_num_seqs=4, block_size=16, **kw)
    config.model.device = "cuda:0"  # planned as on a GPU, with the numbers given
    plan = plan_memory(
        config, files, cfg, "LlamaForCausalLM", torch.bfloat16, 256, device_memory=(free, total)
    )
    return plan, config, cfg


def test_gpu_kv_cache_takes_what_the_utilization_leaves(tmp_path: Path) -> None:
    path = make_tiny_model(tmp_path / "m", "llama", **TINY_LLAMA)
    plan, config, cfg = _gpu_plan(path, 8 * GIB, 8 * GIB, gpu_memory_utilization=0.5)
    act = activation_bytes(config, cfg, torch.bfloat16)
    assert plan.available_bytes == 4 * GIB and plan.device == "cuda:0"
    useful = 4 * 16  # 4 sequences of 256 tokens
    assert plan.num_kv_blocks == useful  # a tiny model: capped by what can be used
    # A budget just short of the weights, tables and activations plus 20 blocks.
    per_block = plan.kv_block_bytes
    fixed = plan.weights_bytes + plan.buffers_bytes + act
    total = int((fixed + 20 * per_block) / 0.5) + 2
    small, _, _ = _gpu_plan(path, total, total, gpu_memory_utilization=0.5)
    assert small.num_kv_blocks == 20
    assert "allowed on cuda:0" in small.summary()
    with pytest.raises(InsufficientMemoryError, match="one 256-token sequence"):
        _gpu_plan(path, total // 2, total // 2, gpu_memory_utilization=0.5)
    # num_kv_blocks fixes the pool; kv_cache_memory_gb is the CPU's knob.
    fixed_plan, _, _ = _gpu_plan(path, 8 * GIB, 8 * GIB, num_kv_blocks=7, kv_cache_memory_gb=1.0)
    assert fixed_plan.num_kv_blocks == 7


def test_gpu_utilization_beyond_free_memory_fails_naming_it(tmp_path: Path) -> None:
    path = make_tiny_model(tmp_path / "m", "llama", **TINY_LLAMA)
    with pytest.raises(InsufficientMemoryError, match=r"gpu_memory_utilization=0\.9 asks for"):
        _gpu_plan(path, 4 * GIB, 8 * GIB)  # another process holds half the GPU
    plan, _, _ = _gpu_plan(path, 4 * GIB, 8 * GIB, gpu_memory_utilization=0.45)
    assert plan.num_kv_blocks > 0


def test_gpu_check_runs_small_on_the_cpu() -> None:
    # scripts/gpu_check.py cannot rot: its quick mode runs every part on this machine.
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--device", "cpu", "--quick"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, "one JSON summary"
    summary = json.loads(lines[0])
    assert summary["ok"] and summary["device"] == "cpu"
    assert set(summary["parity"]) == {"llama", "mistral", "qwen2", "qwen3", "gpt2"}
    assert summary["race"] == {"ok": True, "rounds": 3, "failures": []}
    tp = summary["throughput"]
    assert tp["nbengine"]["output_tokens"] == tp["expected_output_tokens"]
    assert tp["hf_cb"]["output_tokens"] > 0
