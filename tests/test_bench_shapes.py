"""``nbengine bench --shape NAME``: random weights in a real model's dimensions, written
once as bfloat16 to the cache, and the load figures every engine reports (no big model
here: a tiny shape stands in for the real ones in the smoke run)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from nbengine.bench import BenchConfig
from nbengine.bench.workloads import SHAPES, bench_model_dir
from nbengine.cli import main
from nbengine.model.weights import read_safetensors_header

# The parameter counts the model cards give (tied embeddings counted once).
PUBLISHED = {
    "smollm2-135m": 134.5e6,
    "llama-3.2-1b": 1.236e9,
    "qwen2.5-1.5b": 1.54e9,
    "llama-3.2-3b": 3.21e9,
}

TINY = (
    "llama",
    dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        tie_word_embeddings=True,
        max_position_embeddings=512,
    ),
)


def _parameters(arch: str, c: dict[str, object]) -> float:
    h, inter, n = int(c["hidden_size"]), int(c["intermediate_size"]), int(c["num_hidden_layers"])  # type: ignore[call-overload]
    heads, kv = int(c["num_attention_heads"]), int(c["num_key_value_heads"])  # type: ignore[call-overload]
    hd = int(c.get("head_dim") or h // heads)  # type: ignore[call-overload]
    vocab = int(c["vocab_size"])  # type: ignore[call-overload]
    attn = h * heads * hd * 2 + h * kv * hd * 2
    bias = (heads + 2 * kv) * hd if arch == "qwen2" else 0
    per_layer = attn + bias + 3 * h * inter + 2 * h
    head = 0 if c["tie_word_embeddings"] else vocab * h
    return vocab * h + n * per_layer + h + head


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_shapes_have_the_real_models_parameters(name: str) -> None:
    arch, cfg = SHAPES[name]
    assert math.isclose(_parameters(arch, cfg), PUBLISHED[name], rel_tol=0.01)


def test_unknown_shape_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="shape must be one of"):
        BenchConfig(shape="llama-9b")
    with pytest.raises(SystemExit):
        main(["bench", "--shape", "llama-9b"])
    assert "invalid choice" in capsys.readouterr().err


def _tiny_bench(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workload: str) -> Any:
    """The JSON report of a quick nbengine-only bench of ``workload`` on the TINY shape."""
    monkeypatch.setitem(SHAPES, "tiny-test", TINY)
    monkeypatch.setenv("NBENGINE_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "report.json"
    argv = ["bench", "--shape", "tiny-test", "--engines", "nbengine", "--workloads", workload]
    assert main([*argv, "--quick", "--no-abort", "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_bench_shape_smoke_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    report = _tiny_bench(tmp_path, monkeypatch, "W2")
    path = Path(report["config"]["model_dir"])
    assert report["config"]["shape"] == "tiny-test"
    assert path == bench_model_dir(tmp_path / "cache" / "bench", "tiny-test")
    assert report["config"]["model"]["hidden_size"] == 64
    # bfloat16 weights, written once: the file is reused as it is.
    header = read_safetensors_header(path / "model.safetensors")
    assert {e.dtype for e in header.values()} == {"BF16"}
    assert json.loads((path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    bench_model_dir(tmp_path / "cache" / "bench", "tiny-test")
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime
    # The engine's load: start -> ready -> first token, and its memory against the plan.
    load = report["load"]["nbengine"]
    assert 0 < load["start_to_ready_s"] <= load["start_to_first_token_s"]
    assert load["rss_ready_bytes"] > 0 and load["peak_rss_load_bytes"] >= load["rss_ready_bytes"]
    assert load["weights_bytes"] > 0 and load["resident_over_planned"] > 0
    table = capsys.readouterr().out
    assert "start->ready s" in table and "peak/RSS" in table


def test_p1024_is_one_1024_token_prompt_with_one_output_token() -> None:
    from nbengine.bench.workloads import make_workloads

    wl = make_workloads(("P1024",), vocab=1000)["P1024"]
    assert len(wl.prompts) == 1 and len(wl.prompts[0]) == 1024
    assert wl.output_lens == [1]
    assert all(3 <= t < 1000 for t in wl.prompts[0])
    # Only on request: the default workloads stay W1, W2, W3.
    assert BenchConfig().workloads == ("W1", "W2", "W3")


def test_bench_p1024_reports_ttft(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    report = _tiny_bench(tmp_path, monkeypatch, "P1024")
    run = report["results"]["P1024"]["nbengine"]
    assert "error" not in run and run["ttft_p50_ms"] > 0
