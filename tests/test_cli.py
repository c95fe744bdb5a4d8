"""The ``nbengine`` command as a person meets it: bad values give one line and status 2,
help texts describe every option, ``tutorials`` copies the notebooks without touching
the tracked ones."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from nbengine.bench import format_report

ROOT = Path(__file__).resolve().parent.parent


def nbengine(
    *args: str, timeout: float = 300, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "nbengine", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
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


# --- what a newcomer meets in the first hour (issue 31, items 15, 16, 18) ----------------


def nbengine_without(module: str, *args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """``nbengine ARGS`` in a process where ``module`` cannot be imported (as if the extra
    that brings it were not installed)."""
    code = (
        f"import sys; sys.modules[{module!r}] = None\n"
        "from nbengine.cli import main\n"
        f"sys.exit(main({list(args)!r}))\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,  # a hang-guard: the check comes before any model is loaded
        cwd=cwd,
    )


@pytest.mark.parametrize(
    "module, args, extra",
    [
        ("starlette", ["serve", "/nope"], "serve"),
        ("uvicorn", ["serve", "--port", "0"], "serve"),
        ("transformers", ["bench", "--model", "/nope"], "bench"),
        ("ctranslate2", ["bench", "--engines", "nbengine,ct2", "--model", "/nope"], "bench"),
    ],
    ids=["serve-starlette", "serve-uvicorn", "bench-transformers", "bench-ct2"],
)
def test_a_missing_extra_is_one_line_naming_it_before_any_work(
    module: str, args: list[str], extra: str
) -> None:
    r = nbengine_without(module, *args)
    assert r.returncode == 2, r
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr  # no traceback
    assert lines[0].startswith("nbengine: error: "), lines
    assert module in lines[0] and f'pip install "nbengine[{extra}]"' in lines[0], lines
    # Checked first: the model argument (/nope) was never looked at, nothing was loaded.
    assert "/nope" not in lines[0] and r.stdout == "", r


def test_tutorials_without_jupyterlab_names_the_extra_before_copying(tmp_path: Path) -> None:
    target = tmp_path / "tut"
    r = nbengine_without("jupyterlab", "tutorials", "--dir", str(target))
    assert r.returncode == 2, r
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and 'pip install "nbengine[notebook]"' in lines[0], r.stderr
    assert not target.exists()  # nothing done first
    # --no-lab only copies, which needs no JupyterLab.
    assert (
        nbengine_without("jupyterlab", "tutorials", "--dir", str(target), "--no-lab").returncode
        == 0
    )


@pytest.mark.slow  # fresh Python processes
def test_generate_and_demo_take_a_hub_id_as_serve_does(tiny_model: Path, tmp_path: Path) -> None:
    from nbengine.testing import make_hub_cache

    make_hub_cache(tmp_path / "hub", "tiny-org/tiny-llama", tiny_model)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_HUB_CACHE=str(tmp_path / "hub"), HF_HUB_OFFLINE="1")
    prompt = ["generate", "Once upon a time", "--max-tokens", "8"]
    by_id = nbengine(*prompt, "--model", "tiny-org/tiny-llama", env=env)
    assert by_id.returncode == 0, by_id.stderr
    by_dir = nbengine(*prompt, "--model", str(tiny_model), env=env)
    assert by_dir.returncode == 0, by_dir.stderr
    assert by_id.stdout == by_dir.stdout and len(by_id.stdout) > len("Once upon a time\n")
    demo = nbengine("demo", "--model", "tiny-org/tiny-llama", "--max-tokens", "4", env=env)
    assert demo.returncode == 0, demo.stderr
    # A Hub id that is not in the cache: one line naming it, status 2.
    missing = nbengine(*prompt, "--model", "tiny-org/not-cached", env=env)
    assert missing.returncode == 2, missing
    lines = missing.stderr.strip().splitlines()
    assert len(lines) == 1 and "tiny-org/not-cached" in lines[0], missing.stderr


COMMANDS = ("demo", "generate", "bench", "serve", "tutorials", "install-kernel")


def test_help_lists_each_command_once() -> None:
    top = nbengine("--help").stdout
    for command in COMMANDS:
        # A command's own line (its help wraps onto lines indented further).
        listed = [line for line in top.splitlines() if re.match(rf" {{1,4}}{command}\b", line)]
        assert len(listed) == 1, top


def _track(text: str) -> object:
    from nbengine.demo import _Track

    return _Track("lists", "A list is", 0.0, status="RUNNING", text=text, num_tokens=40)


# Words that a cut anywhere but at a space would leave partial.
LONG_TEXT = " " + " ".join(f"word{i:02d}x" for i in range(60)) + "\n"


def test_demo_status_lines_cut_at_word_boundaries() -> None:
    from nbengine.demo import _status_lines

    words = LONG_TEXT.split()
    for width in (60, 73, 100):
        (line,) = _status_lines([_track(LONG_TEXT)], width=width)  # type: ignore[list-item]
        assert len(line) <= width
        shown = line.split()[4:]  # after: id, status, count, "tok"
        shown = [w for w in shown if w not in ("...", "…")]
        assert shown and shown == words[-len(shown) :], line  # whole words, the text's end


def test_demo_summary_cuts_at_word_boundaries() -> None:
    from nbengine.demo import _summary_line

    words = ("A list is" + LONG_TEXT).split()
    line = _summary_line(_track(LONG_TEXT))  # type: ignore[arg-type]
    text = line.split()[5:]  # after: id, finish, tokens, TTFT, tok/s
    shown = [w for w in text if w not in ("...", "…")]
    assert shown and shown == words[: len(shown)], line  # whole words, the text's start
