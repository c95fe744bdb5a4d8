"""The ``nbengine`` command as a person meets it: bad values give one line and status 2,
help texts describe every option, ``tutorials`` copies the notebooks without touching
the tracked ones."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from nbengine.bench import format_report

ROOT = Path(__file__).resolve().parent.parent


def nbengine(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "nbengine", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


@pytest.mark.parametrize(
    "args, says",
    [
        (["generate", "Hi", "--max-tokens", "0"], "--max-tokens: must be at least 1, got 0"),
        (["generate", "Hi", "--temperature", "-1"], "--temperature: must be 0 or more"),
        (["generate", "Hi", "--model", "/nope"], "--model /nope: no such directory"),
        (["generate", "Hi", "--model", "nbengine"], "not a model directory"),
        (["generate", ""], "The prompt is empty"),
        (["generate", "word " * 2000], "more than max_model_len"),
        (["demo", "--model", "/nope"], "--model /nope: no such directory"),
    ],
    ids=[
        "max-tokens-0",
        "temperature-negative",
        "missing-model",
        "not-a-model",
        "empty-prompt",
        "long-prompt",
        "demo-missing-model",
    ],
)
def test_a_bad_value_is_one_line_and_status_2(args: list[str], says: str) -> None:
    r = nbengine(*args)
    assert r.returncode == 2, r
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr  # no traceback, no usage block
    assert lines[0].startswith("nbengine") and "error:" in lines[0] and says in lines[0], lines
    assert "Traceback" not in r.stdout + r.stderr
    assert r.stdout == "" or r.stdout.endswith("\n")  # never a dangling half line


def test_debug_shows_the_traceback() -> None:
    r = nbengine("generate", "", "--debug")
    assert r.returncode == 2
    assert "Traceback (most recent call last)" in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("nbengine: error: The prompt is empty")


def test_help_texts() -> None:
    top = nbengine("--help").stdout
    assert "``" not in top  # no reStructuredText markup
    for command in ("demo", "generate", "bench", "tutorials", "install-kernel"):
        assert command in top
    gen = nbengine("generate", "--help").stdout
    assert "the text to continue" in gen
    assert "(default: 64)" in gen and "(default: 0.0)" in gen
    assert "(default: None)" not in gen


def test_tutorials_copies_once_and_keeps_edits(tmp_path: Path) -> None:
    target = tmp_path / "tut"
    r = nbengine("tutorials", "--dir", str(target), "--no-lab")
    assert r.returncode == 0, r.stderr
    shipped = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))
    assert sorted(p.name for p in target.glob("*.ipynb")) == shipped
    assert "jupyter" in r.stdout and "lab" in r.stdout
    first = target / shipped[0]
    first.write_text("{}")  # the reader's own work
    r = nbengine("tutorials", "--dir", str(target), "--no-lab")
    assert r.returncode == 0 and first.read_text() == "{}"
    assert "kept" in r.stdout


def test_bench_report_formats_figures_for_people() -> None:
    report = {
        "machine": {
            "cpu_count": 2,
            "cpu_flags": ["avx2"],
            "torch": "2.13",
            "torch_threads": 2,
            "transformers": "5",
            "load_average_start": (1.2345678901234, 0.5, 0.25),
            "load_average_end": (3.98765432109876, 1.0, 0.5),
            "bandwidth_gb_s": 30.0,
            "matmul_gflop_s": 400.0,
            "matmul_gflop_s_float32": 200.0,
        },
        "config": {"model_dir": "m", "dtype": "bfloat16", "scale": 0.1, "repeats": 1},
        "results": {
            "W2": {
                "nbengine": {
                    "output_tok_s": 90.0,
                    "total_tok_s": 100.0,
                    "ttft_p50_ms": 40.0,
                    "ttft_p99_ms": 50.0,
                    "itl_p50_ms": 10.0,
                    "itl_p99_ms": 12.0,
                    "decode_fraction_of_bound": 1.45,
                }
            }
        },
        "bounds": {"W2": {"output_tok_s": 120.0, "decode_step_ms": 8.0}},
        "targets": {},
        "elapsed_s": 12.0,
    }
    text = format_report(report)
    assert "1.23, 0.50, 0.25" in text and "3.99, 1.00, 0.50" in text
    assert "1.2345678901234" not in text
    assert "145%!" in text and "faster than the bound" in text


def test_demo_cancels_mid_stream_and_reuses_the_id() -> None:
    # The README's first command, as a person reads it: the cancelled request ends by the
    # abort, partway through, and its id streams a new request right after.
    done = nbengine("demo")
    assert done.returncode == 0, done.stderr
    lines = {line.split()[0]: line.split() for line in done.stdout.splitlines() if line.strip()}
    assert lines["imports"][1] == "abort", done.stdout  # the finish column
    assert 0 < int(lines["imports"][2]) < 8 * 48, done.stdout  # cut short
    assert lines["imports#2"][1] in ("stop", "length"), done.stdout
    assert "Cancelled 'imports' after" in done.stdout, done.stdout
