"""bfloat16 weights packed for the native kernels, kept in the load cache
(model/packed_cache.py, model/load_cache.py; docs/load-cache.md)."""

from __future__ import annotations

import json
import logging
import os
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import nbengine as nb
from nbengine.model.load_cache import wait_for_stores
from nbengine.ops import native
from nbengine.testing import make_tiny_model

pytestmark = pytest.mark.skipif(
    native.unavailable_reason() is not None, reason="needs the native bfloat16 kernels"
)

KW = dict(num_kv_blocks=64, block_size=16, seed=0, dtype="bfloat16")
PROMPTS = [[1 + (7 * i + 3 * j) % 200 for j in range(5 + i)] for i in range(6)]
# Prompts of 12 tokens and more reach the AMX tiles (or oneDNN twins) where the CPU has them.
PROMPTS.append([3 + (5 * j) % 190 for j in range(40)])
GREEDY = nb.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SHAPE = dict(
    hidden_size=64,
    intermediate_size=96,
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
    return make_tiny_model(tmp_path_factory.mktemp("packed") / "llama", arch="llama", **SHAPE)


@pytest.fixture
def cache_log(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    with caplog.at_level(logging.INFO, logger="nbengine.model.load_cache"):
        yield caplog


def _greedy(path: Path, **kw: object) -> list[list[int]]:
    with nb.LLM(str(path), **KW, **kw) as llm:  # type: ignore[arg-type]
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert wait_for_stores(60)  # an entry it stores is written in the background
    return [list(o.outputs[0].token_ids) for o in outs]


def _uncached(path: Path, monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    with monkeypatch.context() as m:
        m.setenv("NBENGINE_LOAD_CACHE", "0")
        return _greedy(path)


def _entries(root: Path) -> list[Path]:
    return sorted(root.glob("*.safetensors")) if root.is_dir() else []


def _hits(log: pytest.LogCaptureFixture) -> int:
    return sum("from the load cache" in r.getMessage() for r in log.records)


@pytest.mark.parametrize("linear", ["auto", "twin"])  # twin: a oneDNN twin where AMX has one
def test_a_hit_gives_the_outputs_of_a_miss_and_of_no_cache(
    model_dir: Path,
    cache_dir: Path,
    cache_log: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    linear: str,
) -> None:
    monkeypatch.setenv("NBENGINE_LINEAR", linear)
    plain = _uncached(model_dir, monkeypatch)
    assert not cache_dir.exists()
    miss = _greedy(model_dir)
    assert _hits(cache_log) == 0 and len(_entries(cache_dir)) == 1
    hit = _greedy(model_dir)
    assert _hits(cache_log) == 1
    assert hit == miss == plain
    assert len(_entries(cache_dir)) == 1


def test_a_changed_checkpoint_or_other_options_are_misses(
    tmp_path: Path,
    cache_dir: Path,
    cache_log: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path = make_tiny_model(tmp_path / "m", arch="llama", seed=0, **SHAPE)
    before = _greedy(path)
    (old,) = _entries(cache_dir)
    # int8 of the same checkpoint: its own entry, the packed one not read for it.
    _greedy(path, quantization="int8")
    assert _hits(cache_log) == 0 and len(_entries(cache_dir)) == 2
    # The same shapes and file size, other weights: only the file's identity tells.
    make_tiny_model(path, arch="llama", seed=1, **SHAPE)
    after = _greedy(path)
    assert _hits(cache_log) == 0
    assert after == _uncached(path, monkeypatch) and after != before
    assert old not in _entries(cache_dir)  # the stale packed entry is gone
    assert _greedy(path) == after and _hits(cache_log) == 1


def _damage_shapes(entry: Path) -> None:
    """Rewrite ``entry``'s header so that its first tensor has another shape (same
    bytes): a well-formed file that does not fit the model."""
    raw = entry.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    name = next(n for n in header if n.endswith(".packed"))
    header[name]["shape"] = [1, header[name]["shape"][0]]
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (length - len(text))
    assert len(text) == length
    entry.write_bytes(raw[:8] + text + raw[8 + length :])


@pytest.mark.parametrize("damage", ["truncated", "other shapes", "garbage"])
def test_a_damaged_entry_is_a_miss_and_is_deleted(
    model_dir: Path, cache_dir: Path, cache_log: pytest.LogCaptureFixture, damage: str
) -> None:
    want = _greedy(model_dir)
    (entry,) = _entries(cache_dir)
    if damage == "truncated":
        entry.write_bytes(entry.read_bytes()[:-100])
    elif damage == "other shapes":
        _damage_shapes(entry)
    else:
        entry.write_bytes(os.urandom(entry.stat().st_size))
    cache_log.clear()
    with nb.LLM(str(model_dir), **KW) as llm:  # type: ignore[arg-type]
        # The damaged entry was deleted before this load stored a new one.
        assert any("unusable" in r.getMessage() for r in cache_log.records)
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert wait_for_stores(60)
    assert [list(o.outputs[0].token_ids) for o in outs] == want
    assert _hits(cache_log) == 0
    assert _greedy(model_dir) == want and _hits(cache_log) == 1  # stored again, read


def test_cache_off_writes_no_packed_entry(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NBENGINE_LOAD_CACHE", "0")
    monkeypatch.setenv("NBENGINE_CACHE", str(tmp_path / "cache"))
    _greedy(model_dir)
    assert not (tmp_path / "cache").exists()


_RUN = """
import nbengine as nb
with nb.LLM({path!r}, num_kv_blocks=64, block_size=16, seed=0, dtype="bfloat16") as llm:
    sp = nb.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    print(list(llm.generate([{prompt!r}], sp, use_tqdm=False)[0].outputs[0].token_ids))
"""


def test_two_loads_at_once_both_succeed(
    model_dir: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    code = _RUN.format(path=str(model_dir), prompt=PROMPTS[-1])
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        for _ in range(2)
    ]
    outs = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err.decode()
        outs.append(out.decode().strip().splitlines()[-1])
    (entry,) = _entries(cache_dir)  # one entry, whole: no temporary left beside it
    assert sorted(p.name for p in cache_dir.iterdir()) == sorted([entry.name, f"{entry.stem}.json"])
    want = str(_uncached(model_dir, monkeypatch)[-1])
    assert outs == [want, want]
    assert str(_greedy(model_dir)[-1]) == want
