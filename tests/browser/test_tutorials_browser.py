"""Every chart of every tutorial draws its data in a real JupyterLab.

Each tutorial with charts is opened as shipped (its saved outputs included), run with
Run > Run All Cells in headless Chromium (its CPU throttled 6x, a slow browser), and
every plotly chart on the page must then show a title and draw every one of its
traces: a line or markers for a scatter trace, at least one bar for a bar trace
(counted in the chart's SVG). A chart that exists but
is blank (empty axes, no title, no traces) fails. Screenshots of each chart go to
artifacts/screenshots/tutorials/.

Which tutorials have charts is read from their sources (``CHART_CALLS``), and
``test_tutorials_with_charts_are_known`` keeps ``EXPECTED_CHARTS`` honest.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import (
    REPO,
    LabServer,
    NotebookPage,
    fresh_screenshots,
    lab_and_browser,
    open_notebook,
    require_browser,
)
from harness import SCREENSHOTS as SCREENSHOT_ROOT

NOTEBOOKS = REPO / "notebooks"
SCREENSHOTS = SCREENSHOT_ROOT / "tutorials"

# Chromium runs the page this many times slower than the CPU allows (the slow browser
# of a loaded machine, where plotly's FigureWidget drew the dashboard blank: 8x
# reproduced it; nbengine/dashboard/figure.py). NBENGINE_BROWSER_THROTTLE overrides.
CPU_THROTTLE = float(os.environ.get("NBENGINE_BROWSER_THROTTLE", "6"))

# Calls in a tutorial's code that show a chart.
CHART_CALLS = ("dashboard(", "plot_timeline(", "FigureWidget", "plotly", ".plot(")
# Charts each tutorial shows once run (the dashboard's figure, the timeline, ...).
EXPECTED_CHARTS: dict[str, int] = {
    "03-dashboard-and-metrics.ipynb": 2,
}

# Per chart on the page: its title texts and, per trace, whether it draws anything.
_CHARTS_JS = """() => {
    const panel = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden)');
    return Array.from(panel.querySelectorAll('.js-plotly-plot')).map((plot) => {
        const rect = plot.getBoundingClientRect();
        const titles = Array.from(plot.querySelectorAll('.gtitle, .annotation-text'))
            .map((t) => t.textContent.trim()).filter((t) => t);
        const traces = [];
        for (const t of plot.querySelectorAll('.scatterlayer .trace')) {
            // Drawn: a line with at least two points (a move, then a segment: "M x,y
            // L x,y", or H/V steps for line_shape="hv"), or at least one marker.
            const line = Array.from(t.querySelectorAll('path.js-line'))
                .some((p) => /^M[^M]*[LHV]/.test(p.getAttribute('d') || ''));
            const markers = Array.from(t.querySelectorAll('.points path'))
                .filter((p) => (p.getAttribute('d') || '').length > 3).length;
            const drawn = line || markers > 0;
            traces.push({kind: 'scatter', drawn});
        }
        for (const t of plot.querySelectorAll('.barlayer .trace')) {
            const bars = Array.from(t.querySelectorAll('.point path'))
                .filter((p) => (p.getAttribute('d') || '').length > 3).length;
            traces.push({kind: 'bar', drawn: bars > 0, bars});
        }
        return {titles, traces, width: rect.width, height: rect.height};
    });
}"""


def _code(path: Path) -> str:
    nb = json.loads(path.read_text(encoding="utf-8"))
    return "\n".join(
        "".join(c["source"]) if isinstance(c["source"], list) else c["source"]
        for c in nb["cells"]
        if c["cell_type"] == "code"
    )


def _with_charts() -> list[str]:
    return sorted(
        p.name for p in NOTEBOOKS.glob("*.ipynb") if any(call in _code(p) for call in CHART_CALLS)
    )


def test_tutorials_with_charts_are_known() -> None:
    """A tutorial that gains (or loses) a chart must be listed here, so the browser test
    below runs it."""
    assert _with_charts() == sorted(EXPECTED_CHARTS)


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LabServer, Any]]:
    require_browser()
    base = tmp_path_factory.mktemp("tutorials")
    root = base / "root"
    root.mkdir()
    for name in EXPECTED_CHARTS:  # the files as shipped, saved outputs included
        shutil.copyfile(NOTEBOOKS / name, root / name)
    fresh_screenshots("tutorials")
    with lab_and_browser(root, base / "jupyter") as (server, browser):
        yield server, browser


def _run_all(p: NotebookPage, timeout_s: float) -> None:
    """Run > Run All Cells, then wait until every code cell has run in this kernel.

    The shipped notebooks already show execution counts ([n]), so "every prompt reads
    [n]" alone proves nothing: a MutationObserver first records that the last code
    cell was queued or running ([*]), and only then do the counts count.
    """
    p.page.evaluate(
        """() => {
            const cells = document.querySelectorAll(
                '.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook .jp-CodeCell');
            const prompt = cells[cells.length - 1].querySelector('.jp-InputPrompt');
            window.__nbLastQueued = false;
            new MutationObserver(() => {
                if (prompt.textContent.includes('[*]')) window.__nbLastQueued = true;
            }).observe(prompt, {childList: true, subtree: true, characterData: true});
        }"""
    )
    p.page.get_by_role("menuitem", name="Run", exact=True).click()
    p.page.get_by_role("menuitem", name="Run All Cells", exact=True).click()
    p.page.wait_for_function(
        """() => {
            if (!window.__nbLastQueued) return false;
            const cells = document.querySelectorAll(
                '.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook .jp-CodeCell');
            return Array.from(cells).every((c) => {
                const p = c.querySelector('.jp-InputPrompt');
                return p && /\\[\\d+\\]/.test(p.textContent);
            });
        }""",
        timeout=timeout_s * 1000,
    )


@pytest.mark.browser
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", sorted(EXPECTED_CHARTS))
def test_every_chart_draws_its_data(lab: tuple[LabServer, Any], name: str) -> None:
    server, browser = lab
    stem = Path(name).stem
    with open_notebook(
        server,
        browser,
        name,
        SCREENSHOTS,
        failure=f"{stem}-failure",
        ready_timeout_s=240,
        cpu_throttle=CPU_THROTTLE,
    ) as p:
        page = p.page
        _run_all(p, timeout_s=480)
        # No cell failed or wrote to stderr (the shipped outputs have neither).
        errors = p.panel.locator(
            ".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']"
        )
        assert errors.count() == 0, errors.first.inner_text()
        expected = EXPECTED_CHARTS[name]
        # Every chart drawn: the live charts refresh about twice a second until the
        # engine's shutdown shows its final state, so poll the condition.
        try:
            page.wait_for_function(
                f"""() => {{
                    const charts = ({_CHARTS_JS})();
                    return charts.length >= {expected} && charts.every((c) =>
                        c.titles.length > 0 && c.traces.length > 0 &&
                        c.traces.every((t) => t.drawn));
                }}""",
                timeout=60_000,
            )
        except Exception:
            pass
        charts = page.evaluate(_CHARTS_JS)
        for k in range(len(charts)):
            plot = p.panel.locator(".js-plotly-plot").nth(k)
            plot.scroll_into_view_if_needed()
            plot.screenshot(path=str(SCREENSHOTS / f"{stem}-chart-{k}.png"))
        assert len(charts) == expected, charts
        for chart in charts:
            assert chart["titles"], f"a chart has no title: {charts}"
            assert chart["traces"] and all(t["drawn"] for t in chart["traces"]), (
                f"a chart does not draw its data: {charts}"
            )
