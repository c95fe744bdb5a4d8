"""Smoke test of ``nbengine bench``: every figure is reported; no timing targets."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from nbengine.bench import TARGETS, BenchConfig, format_report, make_workloads, run_bench
from nbengine.bench.machine import last_level_cache_mib
from nbengine.bench.report import median_run, spread_warnings
from nbengine.cli import main
from nbengine.ops.openmp import PASSIVE_SPINCOUNT
from nbengine.testing import make_tiny_model

from support.bench import empty_report

# Every measurement starts a fresh process (torch, transformers, the model): about two
# minutes on an idle two-core machine, ten under a load of 8; no timing is asserted.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

ENGINES = ("nbengine", "hf_static", "hf_cb")
RUN_FIELDS = (
    "wall_s",
    "output_tok_s",
    "total_tok_s",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "itl_p50_ms",
    "itl_p99_ms",
    "fraction_of_bound",
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(
        tmp_path_factory.mktemp("bench") / "m", max_position_embeddings=512, vocab_size=512
    )


@pytest.fixture(scope="module")
def report(model_dir: Path) -> dict:
    # A step budget under W3's whole prefill at this scale (6 prompts of 48 tokens): with
    # the default 512, all six are scheduled in one step when the core thread wakes after
    # they have all arrived, none finds the shared prefix computed yet, and the hit rate
    # is 0 (a race that one CI run of 2026-12-06 lost). At 64 tokens a step the later
    # requests are scheduled after the first one's prefix blocks were computed.
    return run_bench(
        BenchConfig(model_dir=model_dir, scale=0.1, engine_kwargs={"max_num_batched_tokens": 64})
    )


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


def test_every_run_has_a_fresh_process_with_the_same_settings(report: dict) -> None:
    runs = [r for per in report["results"].values() for r in per.values()]
    pids = [r["pid"] for r in runs] + [report["abort"]["pid"]]
    assert len(set(pids)) == len(pids) and os.getpid() not in pids
    proc = report["machine"]["engine_process"]
    # Each engine's processes ran under its own wait policy (ENGINE_WAIT_POLICY): these
    # three PASSIVE, with a short spin before sleeping.
    assert report["config"]["omp_wait_policies"] == dict.fromkeys(ENGINES, "PASSIVE")
    passive = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": PASSIVE_SPINCOUNT}
    assert report["machine"]["engine_wait_policy"] == {e: [passive] for e in ENGINES}
    assert proc["torch_threads"] == report["config"]["threads"]
    assert not any("different settings" in w for w in report["warnings"])
    for r in runs:
        assert r["output_tok_s_min"] <= r["output_tok_s"] <= r["output_tok_s_max"]
        assert r["spread"] >= 0 and r["repeats"] == 1
        # Each worker read the machine's speed around its run (docs/benchmarks.md).
        for when in ("probe_before", "probe_after"):
            assert r[when]["matmul_gflop_s"] > 0 and r[when]["bandwidth_gb_s"] > 0


def test_spread_of_repeats_and_its_warning() -> None:
    steady = median_run([{"output_tok_s": x} for x in (100.0, 104.0, 98.0)])
    shaky = median_run([{"output_tok_s": x} for x in (100.0, 120.0, 90.0)])
    assert steady["output_tok_s"] == 100.0 and steady["output_tok_s_all"] == [100.0, 104.0, 98.0]
    assert (steady["output_tok_s_min"], steady["output_tok_s_max"]) == (98.0, 104.0)
    assert math.isclose(steady["spread"], 0.06) and math.isclose(shaky["spread"], 0.3)
    warnings = spread_warnings({"W1": {"a": steady, "b": shaky}}, 0.10)
    assert len(warnings) == 1 and warnings[0].startswith("W1 b: repeats disagree by 30%")
    # With the workers' machine probes, the warning says whether the machine moved too.
    probed = median_run(
        [
            {
                "output_tok_s": x,
                "probe_before": {"matmul_gflop_s": m, "bandwidth_gb_s": 20.0},
                "probe_after": {"matmul_gflop_s": m, "bandwidth_gb_s": 20.0},
            }
            for x, m in ((100.0, 800.0), (120.0, 1000.0), (90.0, 600.0))
        ]
    )
    assert math.isclose(probed["probe_matmul_spread"], 0.5)
    assert probed["probe_bandwidth_spread"] == 0.0
    (note,) = spread_warnings({"W1": {"c": probed}}, 0.10)
    assert "probe moved by 50% in matmul and 0% in bandwidth" in note
    text = format_report({**empty_report(repeats=3), "warnings": warnings})
    assert "WARNINGS:" in text and "W1 b: repeats disagree" in text


def test_prefix_cache_figures(report: dict) -> None:
    on = report["results"]["W3"]["nbengine"]
    off = report["results"]["W3"]["nbengine_no_prefix_cache"]
    assert 0 < on["prefix_cache_hit_rate"] <= 1
    assert off["prefix_cache_hit_rate"] == 0
    assert _positive(on["ttft_p50_ms"]) and _positive(off["ttft_p50_ms"])


def test_machine_abort_and_targets(report: dict) -> None:
    m = report["machine"]
    assert _positive(m["bandwidth_gb_s"]) and _positive(m["matmul_gflop_s"])
    # The read reading beside the copy's (docs/benchmarks.md, "The bound"), before and
    # after the runs, the better one kept, and in the report's machine line.
    reads = (m["read_bandwidth_gb_s_start"], m["read_bandwidth_gb_s_end"])
    assert all(_positive(r) for r in reads) and m["read_bandwidth_gb_s"] == max(reads)
    assert f"(read) {m['read_bandwidth_gb_s']:.1f} GB/s" in format_report(report)
    assert m["load_average_start"] is not None
    assert m["last_level_cache_mib"] == last_level_cache_mib()
    a = report["abort"]
    assert a["num_aborts"] >= 1 and _positive(a["p50_ms"]) and a["p99_ms"] >= a["p50_ms"]
    # Every target of what ran: the LoRA one only with `--lora N` (not run here).
    lora = "W1 wall time over LoRA adapters / base (at most)"
    assert set(report["targets"]) == set(TARGETS) - {lora}
    for t in report["targets"].values():
        assert _positive(t["value"]) and t["pass"] in (True, False)
    json.dumps(report)  # JSON-able as is
    text = format_report(report)
    for needle in ("W1", "W2", "W3", "hf_cb", "abort()", "GB/s", "targets:"):
        assert needle in text


def test_last_level_cache_is_the_largest_data_cache(tmp_path: Path) -> None:
    for index, (level, kind, size) in enumerate(
        [
            ("1", "Data", "48K"),
            ("1", "Instruction", "64K"),
            ("2", "Unified", "2048K"),
            ("3", "Unified", "491520K"),
        ]
    ):
        d = tmp_path / f"index{index}"
        d.mkdir()
        (d / "level").write_text(level + "\n")
        (d / "type").write_text(kind + "\n")
        (d / "size").write_text(size + "\n")
    assert last_level_cache_mib(str(tmp_path)) == 480
    (tmp_path / "index3" / "type").write_text("Instruction\n")  # only data caches count
    assert last_level_cache_mib(str(tmp_path)) == 2
    assert last_level_cache_mib(str(tmp_path / "missing")) is None


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


def test_cli_writes_json(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "r.json"
    rc = main(
        [
            "bench",
            "--model",
            str(model_dir),
            "--quick",
            "--workloads",
            "W2",
            "--engines",
            "nbengine",
            "--no-abort",
            "--json",
            str(out),
            "--chart",
            str(tmp_path / "chart.html"),
        ]
    )
    assert rc == 0
    data = json.loads(out.read_text())
    assert _positive(data["results"]["W2"]["nbengine"]["output_tok_s"])
    assert "W2" in capsys.readouterr().out
    html = (tmp_path / "chart.html").read_text()
    assert "plotly" in html.lower() and "W2: output tokens" in html


def test_run_peers_measures_each_precision_and_shows_the_chart(model_dir: Path) -> None:
    from nbengine.bench import run_peers

    lines: list[str] = []
    run = run_peers(
        precisions=(None, "int8"),
        engines=("nbengine",),
        model_dir=model_dir,
        scale=0.1,
        repeats=1,
        log=lines.append,
    )
    assert [r["config"]["quantization"] for r in run.reports] == [None, "int8"]
    bars = [t for t in run.figure().data if t.type == "bar"]
    assert [t.name for t in bars] == ["nbengine"] and list(bars[0].x) == ["bfloat16", "int8"]
    assert all(_positive(y) for y in bars[0].y)
    bundle = run._repr_mimebundle_()
    chart = bundle["application/vnd.plotly.v1+json"]  # what a notebook displays
    assert [t["name"] for t in chart["data"] if t["type"] == "bar"] == ["nbengine"]
    assert "W2" in bundle["text/plain"] and any("out tok/s" in line for line in lines)


def test_bad_arguments_raise(model_dir: Path) -> None:
    from nbengine.bench import run_peers

    with pytest.raises(ValueError, match="int3"):  # before any precision runs
        run_peers(precisions=(None, "int3"), model_dir=model_dir, log=None)
    with pytest.raises(ValueError, match="W9"):
        run_bench(model_dir=model_dir, workloads=("W9",))
    with pytest.raises(ValueError, match="vllm"):
        BenchConfig(model_dir=model_dir, engines=("vllm",))
