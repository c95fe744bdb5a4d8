"""Loading from the mapped checkpoint, the load cache of quantized models, and the load's
progress bar (model/loader.py, model/load_cache.py, model/progress.py;
docs/quantization.md; docs/load-cache.md)."""

from __future__ import annotations

import fcntl
import logging
import os
import pty
import struct
import subprocess
import sys
import termios
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import nbengine as nb
from nbengine.config import ModelConfig
from nbengine.model.load_cache import wait_for_stores
from nbengine.model.loader import build_model, load_model, read_hf_config
from nbengine.ops.quant import quantize_linears
from nbengine.ops.rotary import RotaryEmbedding
from nbengine.testing import make_tiny_model

# Steps of at most 8 prompt tokens beside the 6 decode rows: fewer than 16 rows, so every
# quantized product takes the row kernels, whose values do not depend on the batch. With
# larger steps, how LLM.generate's requests fall into steps (timing) would choose between
# the row kernels and the AMX tiles, whose int4 products differ (docs/quantization.md),
# and two runs could differ for reasons other than the cache.
KW = dict(num_kv_blocks=64, block_size=16, seed=0, max_num_batched_tokens=8, max_num_seqs=6)
PROMPTS = [[1 + (7 * i + 3 * j) % 200 for j in range(5 + i)] for i in range(6)]
GREEDY = nb.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SHAPE = dict(
    hidden_size=64,
    intermediate_size=96,  # down_proj's 96 inputs: not a multiple of int4's group
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "load-cache"
    monkeypatch.setenv("NBENGINE_LOAD_CACHE", str(root))
    return root


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("load") / "llama", arch="llama", **SHAPE)


def _old_load(path: Path, dtype: torch.dtype, quantization: str | None) -> torch.nn.Module:
    """The load as it was: every tensor read whole into a float32-built model cast to
    ``dtype``, then every linear layer quantized from the loaded weights."""
    cfg = read_hf_config(path)
    model = build_model(cfg, "LlamaForCausalLM", 256, path)
    model.tie_weights()
    model.to(dtype)
    tensors = load_file(str(path / "model.safetensors"))
    params = dict(model.named_parameters())
    with torch.no_grad():
        for ours, sources in model.hf_weight_map().items():
            for src in sources:
                params[ours].data[src.offset : src.offset + src.rows].copy_(tensors[src.name])
    if quantization is not None:
        quantize_linears(model, quantization)
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.reset_tables()
    return model.eval()


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer (quantized weights and scales included), by name."""
    out = {n: t.detach() for n, t in model.named_parameters()}
    out.update({n: t for n, t in model.named_buffers() if t is not None})
    return out


@pytest.mark.parametrize(
    "dtype,quantization",
    [
        ("float32", None),
        ("bfloat16", None),
        ("bfloat16", "int8"),
        ("bfloat16", "int4"),
        ("float32", "int4-g32"),
    ],
)
def test_mapped_load_equals_the_old_load(
    model_dir: Path, cache_dir: Path, dtype: str, quantization: str | None
) -> None:
    new = load_model(ModelConfig(model=model_dir, dtype=dtype, quantization=quantization)).model
    old = _old_load(model_dir, getattr(torch, dtype), quantization)
    a, b = _state(new), _state(old)
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert torch.equal(a[name], b[name]), name


def _greedy(path: Path, **kw: object) -> list[list[int]]:
    with nb.LLM(str(path), **KW, **kw) as llm:  # type: ignore[arg-type]
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert wait_for_stores(60)  # an entry it stores is written in the background
    return [list(o.outputs[0].token_ids) for o in outs]


def _entries(root: Path) -> list[Path]:
    return sorted(root.glob("*.safetensors")) if root.is_dir() else []


@pytest.fixture
def cache_log(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    with caplog.at_level(logging.INFO, logger="nbengine.model.load_cache"):
        yield caplog


def _hits(log: pytest.LogCaptureFixture) -> int:
    return sum("from the load cache" in r.getMessage() for r in log.records)


def _vm_flags(path: Path) -> list[str]:
    """The VmFlags of this process's mappings of ``path`` (/proc/self/smaps)."""
    flags, inside = [], False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and ":" not in head[0]:  # a mapping's first line
                inside = head[-1] == str(path)
            elif inside and head[0] == "VmFlags:":
                flags.append(" ".join(head[1:]))
    return flags


@pytest.mark.skipif(
    not Path("/sys/kernel/mm/transparent_hugepage").is_dir(), reason="no transparent huge pages"
)
def test_a_hit_maps_its_entry_with_huge_pages_advised(model_dir: Path, cache_dir: Path) -> None:
    # The entry's pages are asked for in 2 MiB folios before the first step touches them
    # (load_cache._advise_huge_pages): smaps shows it as the mapping's "hg" flag.
    config = ModelConfig(model=model_dir, dtype="bfloat16", quantization="int4")
    load_model(config)  # a miss: quantized, then stored
    assert wait_for_stores(60)
    (entry,) = _entries(cache_dir)
    model = load_model(config).model  # a hit: the entry mapped
    flags = _vm_flags(entry.resolve())
    assert flags and all("hg" in f.split() for f in flags), flags
    del model


@pytest.mark.parametrize("dtype,mode", [("bfloat16", "int4"), ("float32", "int8")])
def test_second_quantized_load_reads_the_cache_with_the_same_outputs(
    model_dir: Path, cache_dir: Path, cache_log: pytest.LogCaptureFixture, dtype: str, mode: str
) -> None:
    first = _greedy(model_dir, dtype=dtype, quantization=mode)
    assert _hits(cache_log) == 0 and len(_entries(cache_dir)) == 1  # a miss, then stored
    second = _greedy(model_dir, dtype=dtype, quantization=mode)
    assert _hits(cache_log) == 1
    assert second == first
    assert len(_entries(cache_dir)) == 1


def test_other_options_are_other_entries(
    model_dir: Path, cache_dir: Path, cache_log: pytest.LogCaptureFixture
) -> None:
    int8 = _greedy(model_dir, dtype="bfloat16", quantization="int8")
    int4 = _greedy(model_dir, dtype="bfloat16", quantization="int4")
    g32 = _greedy(model_dir, dtype="float32", quantization="int4-g32")
    assert _hits(cache_log) == 0  # each a miss: neither reads another's entry
    assert len(_entries(cache_dir)) == 3
    assert _greedy(model_dir, dtype="bfloat16", quantization="int4") == int4
    assert _greedy(model_dir, dtype="bfloat16", quantization="int8") == int8
    assert _greedy(model_dir, dtype="float32", quantization="int4-g32") == g32
    assert _hits(cache_log) == 3


def test_a_changed_checkpoint_invalidates_its_entry(
    tmp_path: Path, cache_dir: Path, cache_log: pytest.LogCaptureFixture
) -> None:
    path = make_tiny_model(tmp_path / "m", arch="llama", seed=0, **SHAPE)
    before = _greedy(path, dtype="bfloat16", quantization="int4")
    old_entries = _entries(cache_dir)
    # The same shapes and file size, other weights: only the file's identity tells.
    make_tiny_model(path, arch="llama", seed=1, **SHAPE)
    after = _greedy(path, dtype="bfloat16", quantization="int4")
    assert _hits(cache_log) == 0  # the old entry was not read for the new weights
    os.environ["NBENGINE_LOAD_CACHE"] = "0"  # (the fixture restores it)
    assert after == _greedy(path, dtype="bfloat16", quantization="int4")
    assert after != before
    # The stale entry is gone; one entry, of the new weights, remains.
    entries = _entries(cache_dir)
    assert len(entries) == 1 and entries != old_entries


def test_a_damaged_entry_is_a_miss(
    model_dir: Path, cache_dir: Path, cache_log: pytest.LogCaptureFixture
) -> None:
    want = _greedy(model_dir, dtype="bfloat16", quantization="int8")
    (entry,) = _entries(cache_dir)
    entry.write_bytes(entry.read_bytes()[:100])  # truncated
    assert _greedy(model_dir, dtype="bfloat16", quantization="int8") == want
    assert any("unusable" in r.getMessage() for r in cache_log.records)
    assert _hits(cache_log) == 0
    assert _greedy(model_dir, dtype="bfloat16", quantization="int8") == want  # re-stored
    assert _hits(cache_log) == 1


def test_cache_off_writes_nothing(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NBENGINE_LOAD_CACHE", "0")
    monkeypatch.setenv("NBENGINE_CACHE", str(tmp_path / "cache"))
    _greedy(model_dir, dtype="bfloat16", quantization="int4")
    assert not (tmp_path / "cache").exists()


_LOAD = "import nbengine as nb; nb.Engine({path!r}, num_kv_blocks=16).shutdown()"


def _load_stderr(path: Path, tty: bool, **env: str) -> str:
    """stderr of a fresh process that loads ``path``, on a terminal or a pipe."""
    environ = {**os.environ, **env, "PYTHONPATH": os.pathsep.join(sys.path)}
    code = _LOAD.format(path=str(path))
    if not tty:
        done = subprocess.run(
            [sys.executable, "-c", code], env=environ, capture_output=True, timeout=300
        )
        assert done.returncode == 0, done.stderr.decode()
        return done.stderr.decode()
    leader, follower = pty.openpty()
    # A terminal 80 columns wide (a fresh pty has 0, where tqdm draws nothing).
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    with subprocess.Popen(
        [sys.executable, "-c", code], env=environ, stderr=follower, stdout=subprocess.DEVNULL
    ) as proc:
        os.close(follower)
        chunks = []
        while True:
            try:
                data = os.read(leader, 4096)
            except OSError:  # the child closed its end
                break
            if not data:
                break
            chunks.append(data)
        assert proc.wait(timeout=300) == 0
    os.close(leader)
    return b"".join(chunks).decode(errors="replace")


def test_progress_bar_only_where_someone_watches(model_dir: Path) -> None:
    assert "Loading weights" in _load_stderr(model_dir, tty=True, NBENGINE_PROGRESS="1")
    assert "Loading weights" not in _load_stderr(model_dir, tty=False, NBENGINE_PROGRESS="1")
    # A small checkpoint loads too fast for a bar to help: none unless asked for.
    assert "Loading weights" not in _load_stderr(model_dir, tty=True)
    assert "Loading weights" not in _load_stderr(model_dir, tty=True, NBENGINE_PROGRESS="0")
