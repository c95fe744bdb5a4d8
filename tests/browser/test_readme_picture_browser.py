"""The README's picture: the shipped default model's handle widget in a real JupyterLab.

Two cells a newcomer would type (the README's snippet, greedy): the engine with no
arguments, then a request and its handle. The widget must show the README's sample text,
the status it ended with, its token count and its Cancel button. The whole page goes to
artifacts/screenshots/readme/readme-page.png and the two cells alone to
artifacts/screenshots/readme/readme-picture.png, the image README.md shows as
docs/images/handle-default-model.png (copied by hand when the widget changes; docs/testing.md).

The picture is of a finished request (its Cancel button reads "Done"): the default model
makes these 31 tokens in well under a second (a few of the widget's 10 Hz refreshes at
most, nbengine/dashboard/updater.py), and nbengine has no public control that pauses a
request, so a RUNNING frame of it would be a race or need a trick the picture's code does
not show.
Cancel on a live request is tested (and pictured) in test_widgets_browser.py.

Needs /usr/bin/chromium (harness.py, ``require_browser``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from harness import REPO, notebook_in_lab

pytestmark = [pytest.mark.browser, pytest.mark.timeout(300)]

PROMPT = "The for statement"
CELLS = [
    "import nbengine as nb\n\nengine = nb.Engine()  # the shipped default model",
    f'h = engine.generate("{PROMPT}", nb.SamplingParams(temperature=0, max_tokens=64))\nh',
    "engine.shutdown()",
]


def _words(text: str) -> str:
    return " ".join(text.split())


def _readme_sample() -> str:
    """The greedy continuation the README prints under its snippet (its first text block)."""
    readme = (REPO / "README.md").read_text()
    return _words(re.findall(r"```text\n(.*?)```", readme, flags=re.S)[0])


def test_readme_picture(tmp_path: Path) -> None:
    with notebook_in_lab(tmp_path, "readme.ipynb", CELLS, screenshots="readme") as p:
        p.run_cell(0)
        p.wait_cell_done(0, timeout_s=120)
        p.run_cell(1)
        p.wait_cell_done(1, timeout_s=60)
        # The request ended on the model's end-of-text token, well inside max_tokens.
        p.wait_cell_text(1, ".nbengine-badge", "t.includes('FINISHED_STOPPED')", timeout_s=60)
        # The text reaches the page through its own channel (stream_text.py), so it may
        # trail the badge by a refresh: wait until the README's sample is all there (a
        # text that never completes fails here, with what was shown).
        from playwright.sync_api import TimeoutError as PlaywrightTimeout  # there: required

        sample = _readme_sample()
        assert sample.startswith(PROMPT), sample
        expected = _words(sample[len(PROMPT) :])
        try:
            text = p.wait_cell_text(
                1,
                ".nbengine-text",
                f"t.split(/\\s+/).join(' ').trim().startsWith({json.dumps(expected)})",
                timeout_s=30,
            )
        except PlaywrightTimeout as exc:
            shown = p.cell_text(1, ".nbengine-text")
            raise AssertionError(f"the widget shows {shown!r}, not the README's sample") from exc
        # What the picture shows is readable: the README's own sample text, no U+FFFD.
        assert "\ufffd" not in text, text
        assert _words(PROMPT + text).startswith(sample), (text, sample)
        tokens = int(p.cell_text(1, ".nbengine-tokens"))
        assert 0 < tokens < 64, tokens
        # The Cancel button is shown, disabled and reading "Done" once the request ended.
        # Its disabled state and its label are two updates of the widget's state, which
        # the page may apply a refresh apart: wait for the label (the later one).
        p.wait_cell_text(1, ".nbengine-cancel", "t.trim() === 'Done'", timeout_s=30)
        assert p.cell(1).locator(".nbengine-cancel").first.is_visible()
        assert p.is_disabled(1, ".nbengine-cancel")
        assert "Error" not in p.cell_text(1, ".jp-OutputArea"), p.cell_text(1, ".jp-OutputArea")

        p.screenshot("readme-page")
        picture = p.screenshot_cells(0, 1, "readme-picture")
        assert picture.stat().st_size > 0
        p.run_cell(2)
        p.wait_cell_done(2, timeout_s=60)
