"""Smoke test of ``nbengine bench``: every figure is reported; no timing targets."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from nbengine.bench import BenchConfig, TARGETS, format_report, make_workloads, run_bench
from nbengine.cli import main
from nbengine.testing import make_tiny_model

ENGINES = ("nbengine", "hf_static", "hf_cb")
RUN_FIELDS = ("wall_s", "output_tok_s", "total_tok_s", "ttft_p50_ms", "ttft_p99_ms",
              "itl_p50_ms", "itl_p99_ms", "fraction_of_bound")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("bench") / "m", max_position_embeddings=512,
                           vocab_size=512)


@pytest.fixture(scope="module")
def report(model_dir: Path) -> dict:
    return run_bench(BenchConfig(model_dir=model_dir, scale=0.1))


def _positive(x: object) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_every_engine_reports_every_figure(report: dict) -> None:
    assert report["engine_errors"] == {}
    for w in ("W1", "W2", "W3"):
        for e in ENGINES:
            r = report["results"][w][e]
            assert "error" not in r, r
            for f in RUN_FIELDS:
                assert _positive(r[f]), (w, e, f, r[f])
            assert r["output_tokens"] == report["config"]["workload_sizes"][w]["output_tokens"]
        assert _positive(report["bounds"][w]["seconds"])
        assert _positive(report["bounds"][w]["output_tok_s"])
    assert _positive(report["results"]["W2"]["nbengine"]["decode_fraction_of_bound"])
    assert _positive(report["bounds"]["W2"]["decode_step_ms"])


def test_prefix_cache_figures(report: dict) -> None:
    on = report["results"]["W3"]["nbengine"]
    off = report["results"]["W3"]["nbengine_no_prefix_cache"]
    assert 0 < on["prefix_cache_hit_rate"] <= 1
    assert off["prefix_cache_hit_rate"] == 0
    assert _positive(on["ttft_p50_ms"]) and _positive(off["ttft_p50_ms"])


def test_machine_abort_and_targets(report: dict) -> None:
    m = report["machine"]
    assert _positive(m["bandwidth_gb_s"]) and _positive(m["matmul_gflop_s"])
    assert m["load_average_start"] is not None
    a = report["abort"]
    assert a["num_aborts"] >= 1 and _positive(a["p50_ms"]) and a["p99_ms"] >= a["p50_ms"]
    assert set(report["targets"]) == set(TARGETS)
    for t in report["targets"].values():
        assert _positive(t["value"]) and t["pass"] in (True, False)
    json.dumps(report)  # JSON-able as is
    text = format_report(report)
    for needle in ("W1", "W2", "W3", "hf_cb", "abort()", "GB/s", "targets:"):
        assert needle in text


def test_workloads_are_deterministic() -> None:
    a = make_workloads(("W1", "W2", "W3"), vocab=1000, scale=0.5, seed=3)
    b = make_workloads(("W1", "W2", "W3"), vocab=1000, scale=0.5, seed=3)
    c = make_workloads(("W1",), vocab=1000, scale=0.5, seed=4)
    assert all(a[w].prompts == b[w].prompts and a[w].output_lens == b[w].output_lens for w in a)
    assert a["W1"].prompts != c["W1"].prompts
    full = make_workloads(("W1", "W3"), vocab=49152)
    assert len(full["W1"].prompts) == 64
    assert all(16 <= len(p) <= 256 for p in full["W1"].prompts)
    assert all(16 <= n <= 128 for n in full["W1"].output_lens)
    w3 = full["W3"].prompts
    assert len(w3) == 64 and all(p[:192] == w3[0][:192] for p in w3)


def test_cli_writes_json(model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
                         ) -> None:
    out = tmp_path / "r.json"
    rc = main(["bench", "--model", str(model_dir), "--quick", "--workloads", "W2",
               "--engines", "nbengine", "--no-abort", "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert _positive(data["results"]["W2"]["nbengine"]["output_tok_s"])
    assert "W2" in capsys.readouterr().out


def test_bad_arguments_raise(model_dir: Path) -> None:
    with pytest.raises(ValueError, match="W9"):
        run_bench(model_dir=model_dir, workloads=("W9",))
    with pytest.raises(ValueError, match="vllm"):
        BenchConfig(model_dir=model_dir, engines=("vllm",))
