"""The widgets in a real JupyterLab, driven in headless Chromium as a person would.

Stages (one notebook, one kernel, a screenshot of each under artifacts/screenshots/):
1. a displayed handle's text keeps growing after its cell has returned; its text box
   follows the newest text, keeps the reader's place once they scroll up, and follows
   again when they scroll back to the bottom;
2. clicking its Cancel button ends it: the badge reads FINISHED_ABORTED;
3. a next cell reusing that request id runs to completion;
4. the dashboard lists several requests with their statuses; "Cancel all" ends them;
5. clicking Cancel while an ``async for`` cell runs aborts that request and the cell ends;
6. ``engine.plot_timeline()`` renders a chart.

Needs /usr/bin/chromium (never downloads a browser): without it the test skips, and
tests/conftest.py lists the skip in the summary (a failure under NBENGINE_REQUIRE_ALL=1;
harness.py, ``require_browser``).
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from harness import REPO, NotebookPage, notebook_in_lab, tiny_long_context_model

pytestmark = [pytest.mark.browser, pytest.mark.timeout(300)]

DEFAULT_MODEL = REPO / "nbengine" / "default_model" / "config.json"
MIN_CONTEXT = 4096  # positions a model needs for this test's long requests

# Every request the test cancels asks for far more tokens than it can make in the
# time the test takes, so only a Cancel can end it.
LONG = "nb.SamplingParams(max_tokens=LONG_TOKENS, ignore_eos=True)"


def _engine_args(tmp: Path) -> str:
    """Python source of nb.Engine's arguments in the kernel: the shipped default model
    when there is one with room for long requests, else a tiny random model in ``tmp``.

    Every cancelled request must still be running when the test clicks, seconds after it
    started, so the model needs a long context (the first default model has 256 positions:
    a request ends within a few seconds).
    """
    if DEFAULT_MODEL.exists():
        config = json.loads(DEFAULT_MODEL.read_text())
        if int(config.get("max_position_embeddings", 0)) >= MIN_CONTEXT:
            return "max_num_seqs=8"
    path = tiny_long_context_model(tmp / "tiny", "llama")
    return (
        f"{str(path)!r}, num_kv_blocks=4096, block_size=16, max_num_seqs=8, "
        "max_num_batched_tokens=256"
    )


def _cells(engine_args: str) -> list[str]:
    setup = "\n".join(
        [
            "import nbengine as nb",
            f"engine = nb.Engine({engine_args})",
            "LONG_TOKENS = engine.max_model_len - 64",
            "print('engine ready')",
        ]
    )
    return [
        setup,
        # 1: start, display, return at once
        f'h = engine.generate("Once upon a time", {LONG}, request_id="story")\nh',
        # 2: reuse the id once the first incarnation was cancelled
        'h2 = engine.generate("Once upon a time", nb.SamplingParams(max_tokens=24, '
        'ignore_eos=True), request_id="story")\n'
        "r = h2.result()\n"
        'print("reuse:", r.outputs[0].finish_reason, len(r.outputs[0].token_ids), '
        "h2.status.name)\n"
        "h2",
        # 3: several requests and the dashboard
        f'jobs = [engine.generate("The cat sat", {LONG}, request_id=f"job-{{i}}") '
        "for i in range(3)]\n"
        "engine.dashboard()",
        # 4: an async cell that only a Cancel click can end
        f'ha = engine.generate("Once upon a time", {LONG}, request_id="async-1")\n'
        "display(ha)\n"
        "n = 0\n"
        "async for out in ha:\n"
        "    n += 1\n"
        'print("async done:", ha.status.name, out.outputs[0].finish_reason)',
        # 5: the static timeline
        'fig = engine.plot_timeline()\nprint("timeline traces:", [t.name for t in fig.data])\nfig',
        # 6: the end
        'engine.shutdown()\nprint("engine stopped")',
    ]


def test_widgets_in_jupyterlab(tmp_path: Path) -> None:
    cells = _cells(_engine_args(tmp_path))
    with notebook_in_lab(tmp_path, "widgets.ipynb", cells) as nb_page:
        _run_stages(nb_page)


# The scrolling box of a handle's text, in cell ``i``: its geometry and text length.
_BOX_JS = """(i) => {
    const cells = document.querySelectorAll(
        '.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook .jp-Cell');
    const box = cells[i] && cells[i].querySelector('.nbengine-text .nbengine-text-pre');
    if (!box) return null;
    return {top: box.scrollTop, height: box.scrollHeight, view: box.clientHeight,
            chars: box.textContent.length,
            // the last character's line is in view
            atBottom: box.scrollHeight - box.scrollTop - box.clientHeight <= 8};
}"""


def _box(p: NotebookPage, i: int) -> dict[str, Any]:
    box = p.page.evaluate(_BOX_JS, i)
    assert box is not None, f"no text box in cell {i}"
    return dict(box)


def _wait_box(p: NotebookPage, i: int, predicate_js: str, timeout_s: float = 60.0) -> None:
    """Wait until ``predicate_js`` (over ``b``, the box's state) holds."""
    p.page.wait_for_function(
        f"(i) => {{ const b = ({_BOX_JS})(i); return !!b && !!({predicate_js}); }}",
        arg=i,
        timeout=timeout_s * 1000,
    )


def _check_text_box_follows_the_tail(p: NotebookPage, i: int) -> None:
    """The streaming text box shows the newest text until the reader scrolls up; then it
    keeps the reader's place; scrolling back to the bottom follows the tail again."""
    box = p.cell(i).locator(".nbengine-text .nbengine-text-pre").first
    # Long enough to scroll: the newest line is in view, at the bottom of the box.
    _wait_box(p, i, "b.height > b.view + 200", timeout_s=120)
    start = _box(p, i)["chars"]
    _wait_box(p, i, f"b.chars > {start + 100}")
    b = _box(p, i)
    assert b["top"] > 0 and b["atBottom"], b
    p.screenshot("01a-handle-follows-the-tail")

    # The reader scrolls up (a mouse wheel over the box): the text keeps growing below,
    # and the box stays where the reader put it.
    box.hover()
    p.page.mouse.wheel(0, -100_000)
    _wait_box(p, i, "b.top === 0")
    grown_from = _box(p, i)["chars"]
    _wait_box(p, i, f"b.chars > {grown_from + 100}")
    b = _box(p, i)
    assert b["top"] == 0 and not b["atBottom"], b
    p.screenshot("01b-handle-scrolled-up")

    # Back at the bottom: following resumes with the next update.
    box.hover()
    p.page.mouse.wheel(0, 1_000_000)
    _wait_box(p, i, "b.atBottom")
    grown_from = _box(p, i)["chars"]
    _wait_box(p, i, f"b.chars > {grown_from + 100}")
    b = _box(p, i)
    assert b["atBottom"] and b["top"] > 0, b


def _run_stages(p: NotebookPage) -> None:
    t0 = time.monotonic()

    def mark(what: str) -> None:  # progress on stderr: shown by `pytest -s` and on failure
        print(f"[browser test] {time.monotonic() - t0:6.1f} s  {what}", file=sys.stderr)

    # 0: the engine starts in the kernel.
    p.run_cell(0)
    p.wait_cell_done(0, timeout_s=120)
    assert "engine ready" in p.cell_text(0, ".jp-OutputArea")

    # 1: the displayed handle streams after its cell has returned.
    p.run_cell(1)
    p.wait_cell_done(1)
    p.wait_cell_text(1, ".nbengine-badge", "t.includes('RUNNING')")
    first = len(p.wait_cell_text(1, ".nbengine-text", "t.length > 0"))
    p.wait_cell_text(1, ".nbengine-text", f"t.length > {first + 50}", timeout_s=60)
    tokens = int(p.cell_text(1, ".nbengine-tokens"))
    p.wait_cell_text(1, ".nbengine-tokens", f"parseInt(t) > {tokens}")
    assert "[*]" not in p.prompt(1)  # the cell had returned all along
    mark("01-handle-streaming")
    p.screenshot("01-handle-streaming")
    _check_text_box_follows_the_tail(p, 1)
    mark("01b-handle-scrolled-up")

    # 2: Cancel ends it; the badge says so.
    p.watch(1, ".nbengine-badge", "story")
    p.click(1, ".nbengine-cancel")
    p.wait_cell_text(1, ".nbengine-badge", "t.includes('FINISHED_ABORTED')", timeout_s=60)
    # The person saw RELEASING (the abort is decided), then the confirmed FINISHED_ABORTED.
    assert p.watched("story")[-2:] == ["RELEASING", "FINISHED_ABORTED"], p.watched("story")
    assert p.is_disabled(1, ".nbengine-cancel")
    final_len = len(p.cell_text(1, ".nbengine-text"))
    mark("02-handle-cancelled")
    p.screenshot("02-handle-cancelled")

    # 3: the id is free again; the new request completes in full.
    p.run_cell(2)
    p.wait_cell_done(2, timeout_s=60)
    out = p.cell_text(2, ".jp-OutputArea")
    assert "reuse: length 24 FINISHED_LENGTH_CAPPED" in out, out
    p.wait_cell_text(2, ".nbengine-badge", "t.includes('FINISHED_LENGTH_CAPPED')")
    # The cancelled widget stays as it ended (no stale output reached it).
    assert len(p.cell_text(1, ".nbengine-text")) == final_len
    mark("03-id-reused")
    p.screenshot("03-id-reused")

    # 4: the dashboard lists the jobs with their statuses; Cancel all ends them.
    p.run_cell(3)
    p.wait_cell_done(3)
    mark("dashboard cell done")
    p.wait_cell_text(3, ".nbengine-table", "t.includes('job-')", timeout_s=60)
    mark("dashboard table shown")
    for i in range(3):
        p.wait_cell_text(
            3,
            ".nbengine-table",
            f"/job-{i}\\s*(RUNNING|WAITING)/.test(t)",
            timeout_s=60,
        )
    p.wait_cell_text(3, ".nbengine-kv", "t.includes('blocks')")
    table = p.cell_text(3, ".nbengine-table")
    assert re.search(r"story\s*FINISHED_ABORTED", table), table
    mark("04-dashboard-running")
    p.screenshot("04-dashboard-running")
    p.click(3, ".nbengine-cancel-all")
    mark("clicked cancel all")
    for i in range(3):
        p.wait_cell_text(
            3, ".nbengine-table", f"/job-{i}\\s*FINISHED_ABORTED/.test(t)", timeout_s=60
        )
    mark("05-dashboard-cancel-all")
    p.screenshot("05-dashboard-cancel-all")

    # 5: Cancel during an `async for` cell: the click arrives while the cell runs.
    p.run_cell(4)
    p.wait_cell_running(4)
    p.wait_cell_text(4, ".nbengine-badge", "t.includes('RUNNING')", timeout_s=60)
    grown = len(p.wait_cell_text(4, ".nbengine-text", "t.length > 20"))
    assert "[*]" in p.prompt(4)
    mark("06-async-cell-running")
    p.screenshot("06-async-cell-running")
    p.watch(4, ".nbengine-badge", "async")
    p.click(4, ".nbengine-cancel")
    p.wait_cell_done(4, timeout_s=60)
    out = p.cell_text(4, ".jp-OutputArea")
    assert "async done: FINISHED_ABORTED abort" in out, out
    p.wait_cell_text(4, ".nbengine-badge", "t.includes('FINISHED_ABORTED')")
    assert p.watched("async")[-2:] == ["RELEASING", "FINISHED_ABORTED"], p.watched("async")
    assert len(p.cell_text(4, ".nbengine-text")) >= grown
    mark("07-async-cell-cancelled")
    p.screenshot("07-async-cell-cancelled")

    # 6: the timeline renders.
    p.run_cell(5)
    p.wait_cell_done(5)
    out = p.cell_text(5, ".jp-OutputArea")
    assert "FINISHED_ABORTED" in out and "RUNNING" in out, out
    p.wait_cell_text(5, ".js-plotly-plot", "true", timeout_s=60)
    mark("08-timeline")
    p.screenshot("08-timeline")

    p.run_cell(6)
    p.wait_cell_done(6, timeout_s=60)
    assert "engine stopped" in p.cell_text(6, ".jp-OutputArea")
