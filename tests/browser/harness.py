"""Drive a real JupyterLab in headless Chromium, as a person would.

``jupyter_lab(root)`` starts ``python -m jupyter lab`` on 127.0.0.1 with a random free
port, a random token and isolated config/data/runtime folders; ``NotebookPage`` wraps a
Playwright page with the few gestures the browser tests need (run a cell, wait for its
output, click a widget, take a screenshot). Every wait polls a condition with a generous
timeout; nothing asserts on a fixed sleep.

The setup every browser test shares: ``require_browser()`` (skip without Chromium or
Playwright), ``fresh_screenshots(sub)`` (artifacts/screenshots/<sub>/, emptied),
``lab_and_browser(root, base)`` (the server and a launched Chromium),
``open_notebook(...)`` (a page on one notebook, ready to run, with a screenshot and the
server's log on failure), ``notebook_in_lab(...)`` (all of it for one new notebook) and
``tiny_long_context_model(...)`` (a model whose requests outlast the test's clicks).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
SCREENSHOTS = REPO / "artifacts" / "screenshots"
VIEWPORT = {"width": 1400, "height": 1000}
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
# Generous: the test machine is small and shared.
SERVER_START_TIMEOUT_S = 90.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_notebook(path: Path, cells: list[str], kernel: str = "python3") -> None:
    """Write a notebook of code cells (no outputs) for the given kernel name."""
    nb: dict[str, Any] = {
        "cells": [
            {
                "cell_type": "code",
                "execution_count": None,
                "id": f"cell-{i}",
                "metadata": {},
                "outputs": [],
                "source": src,
            }
            for i, src in enumerate(cells)
        ],
        "metadata": {
            "kernelspec": {"display_name": "Python 3", "language": "python", "name": kernel},
            "language_info": {"name": "python"},
        },
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    path.write_text(json.dumps(nb, indent=1))


@dataclass(slots=True)
class LabServer:
    url: str
    token: str
    root: Path
    process: subprocess.Popen[bytes]
    log_path: Path

    def notebook_url(self, name: str) -> str:
        return f"{self.url}/lab/tree/{name}?reset&token={self.token}"

    def api(self, path: str) -> Any:
        """GET ``/api/<path>`` from the server (JSON)."""
        with urllib.request.urlopen(f"{self.url}/api/{path}?token={self.token}", timeout=10) as r:
            return json.loads(r.read())

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""


def _isolated_env(base: Path) -> dict[str, str]:
    env = dict(os.environ)
    for var, sub in (
        ("JUPYTER_CONFIG_DIR", "config"),
        ("JUPYTER_DATA_DIR", "data"),
        ("JUPYTER_RUNTIME_DIR", "runtime"),
        ("IPYTHONDIR", "ipython"),
    ):
        d = base / sub
        d.mkdir(parents=True, exist_ok=True)
        env[var] = str(d)
    env["JUPYTERLAB_SETTINGS_DIR"] = str(base / "config" / "lab" / "user-settings")
    env["JUPYTERLAB_WORKSPACES_DIR"] = str(base / "config" / "lab" / "workspaces")
    env["JUPYTER_PLATFORM_DIRS"] = "1"
    env.pop("JPY_PARENT_PID", None)
    # No news or update toasts over the page (they covered the dashboard in screenshots):
    # the announcements plugin is disabled outright, and its settings say "never" too.
    labconfig = base / "config" / "labconfig"
    labconfig.mkdir(parents=True, exist_ok=True)
    (labconfig / "page_config.json").write_text(
        json.dumps({"disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True}})
    )
    settings = base / "config" / "lab" / "user-settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True, exist_ok=True)
    (settings / "notification.jupyterlab-settings").write_text(
        json.dumps({"fetchNews": "false", "checkForUpdates": False})
    )
    # Render every cell (no windowing): outputs of cells out of view stay in the DOM.
    nb_settings = base / "config" / "lab" / "user-settings" / "@jupyterlab" / "notebook-extension"
    nb_settings.mkdir(parents=True, exist_ok=True)
    (nb_settings / "tracker.jupyterlab-settings").write_text(json.dumps({"windowingMode": "none"}))
    return env


@contextlib.contextmanager
def jupyter_lab(root: Path, base: Path) -> Iterator[LabServer]:
    """Run JupyterLab serving ``root``; isolated folders live under ``base``."""
    port = free_port()
    token = secrets.token_hex(16)
    env = _isolated_env(base)
    log_path = base / "jupyter.log"
    log = open(log_path, "wb")
    cmd = [
        sys.executable,
        "-m",
        "jupyter",
        "lab",
        "--allow-root",
        "--no-browser",
        "--ip=127.0.0.1",
        f"--port={port}",
        "--port-retries=0",
        f"--IdentityProvider.token={token}",
        f"--ServerApp.root_dir={root}",
        "--LabApp.news_url=",
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
    ]
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=root)
    server = LabServer(f"http://127.0.0.1:{port}", token, root, proc, log_path)
    try:
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"jupyter lab exited early:\n{server.log_tail()}")
            try:
                with urllib.request.urlopen(
                    f"{server.url}/api/status?token={token}", timeout=2
                ) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"jupyter lab did not start:\n{server.log_tail()}")
            time.sleep(0.25)
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        log.close()


class NotebookPage:
    """One open notebook in JupyterLab; cells are addressed by index."""

    def __init__(self, page: Any, screenshot_dir: Path) -> None:
        self.page = page
        self.screenshot_dir = screenshot_dir
        self.panel = page.locator(".jp-NotebookPanel:visible")

    def cell(self, i: int) -> Any:
        return self.panel.locator(".jp-Notebook .jp-Cell").nth(i)

    def output(self, i: int) -> Any:
        return self.cell(i).locator(".jp-OutputArea-output")

    def wait_ready(self, server: LabServer, timeout_s: float = 90.0) -> None:
        """Wait until the notebook is shown and a connected kernel is idle.

        The page's execution indicator reads "idle" before the kernel connects, so the
        kernel's state is also read from the server's REST API.
        """
        deadline = time.monotonic() + timeout_s
        self.panel.locator(".jp-Notebook .jp-Cell").first.wait_for(timeout=timeout_s * 1000)
        while True:
            try:
                kernels = server.api("kernels")
            except OSError:  # includes HTTPError: the server may 500 while a kernel starts
                kernels = []
            if any(
                k.get("connections", 0) >= 1 and k.get("execution_state") == "idle" for k in kernels
            ):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"no idle connected kernel: {kernels}")
            time.sleep(0.25)
        self.page.wait_for_function(
            """() => {
                const el = document.querySelector(
                    '.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook-ExecutionIndicator');
                return el && el.getAttribute('data-status') === 'idle';
            }""",
            timeout=max(1.0, deadline - time.monotonic()) * 1000,
        )

    def run_cell(self, i: int, attempts: int = 5) -> None:
        """Focus cell ``i``'s editor and press Shift+Enter (does not wait for the result).

        JupyterLab re-renders cells (windowed notebooks), so a located element can detach
        between two gestures: each attempt re-locates the editor.
        """
        last: Exception | None = None
        for _ in range(attempts):
            try:
                editor = self.cell(i).locator(".jp-InputArea-editor .cm-content")
                editor.scroll_into_view_if_needed(timeout=10_000)
                editor.click(timeout=10_000)
                # The editor must hold focus (a widget click may have taken it).
                self.page.wait_for_function(
                    """(i) => {
                        const cells = document.querySelectorAll(
                            '.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook .jp-Cell');
                        const c = cells[i];
                        return !!c && c.querySelector('.jp-InputArea-editor')
                            .contains(document.activeElement);
                    }""",
                    arg=i,
                    timeout=10_000,
                )
            except Exception as e:
                last = e
                continue
            self.page.keyboard.press("Shift+Enter")
            try:
                # Started ([*]) or already done ([n]); a keypress can be lost while
                # JupyterLab is still settling, then the prompt stays "[ ]".
                self.page.wait_for_function(
                    """(i) => {
                        const cells = document.querySelectorAll(
                            '.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook .jp-Cell');
                        const p = cells[i] && cells[i].querySelector('.jp-InputPrompt');
                        return !!p && /\\[(\\*|\\d+)\\]/.test(p.textContent);
                    }""",
                    arg=i,
                    timeout=15_000,
                )
            except Exception as e:
                last = e
                continue
            return
        raise RuntimeError(f"could not run cell {i}") from last

    def prompt(self, i: int) -> str:
        return self.cell(i).locator(".jp-InputPrompt").first.inner_text().strip()

    def _wait_prompt(self, i: int, regex: str, timeout_s: float) -> None:
        self.page.wait_for_function(
            """([i, re]) => {
                const cells = document.querySelectorAll(
                    '.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook .jp-Cell');
                const p = cells[i] && cells[i].querySelector('.jp-InputPrompt');
                return !!p && new RegExp(re).test(p.textContent);
            }""",
            arg=[i, regex],
            timeout=timeout_s * 1000,
        )

    def wait_cell_done(self, i: int, timeout_s: float = 60.0) -> None:
        """Wait until cell ``i`` has an execution count (``[n]:``), i.e. it finished."""
        self._wait_prompt(i, r"\[\d+\]", timeout_s)

    def wait_cell_running(self, i: int, timeout_s: float = 30.0) -> None:
        self._wait_prompt(i, r"\[\*\]", timeout_s)

    def wait_text(self, locator: Any, predicate_js: str, timeout_s: float = 60.0) -> str:
        """Wait until ``predicate_js`` (a JS expression over ``t``, the element's text) holds."""
        locator.first.wait_for(timeout=timeout_s * 1000)
        handle = locator.first.element_handle()
        self.page.wait_for_function(
            f"(el) => {{ const t = el.textContent; return {predicate_js}; }}",
            arg=handle,
            timeout=timeout_s * 1000,
        )
        return str(locator.first.text_content())

    _CELL_JS = """
        const cells = document.querySelectorAll(
            '.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook .jp-Cell');
        const cell = cells[i];
        const el = cell ? cell.querySelector(sel) : null;
    """

    def cell_text(self, i: int, selector: str) -> str:
        """The text of the first element matching ``selector`` inside cell ``i`` ('' if none)."""
        return str(
            self.page.evaluate(
                f"([i, sel]) => {{ {self._CELL_JS} return el ? el.textContent : ''; }}",
                [i, selector],
            )
        )

    def wait_cell_text(
        self, i: int, selector: str, predicate_js: str, timeout_s: float = 30.0
    ) -> str:
        """Wait until an element of cell ``i`` exists and ``predicate_js`` holds for its text
        ``t``; return that text. Re-queried on every poll (widgets re-render)."""
        self.page.wait_for_function(
            f"([i, sel]) => {{ {self._CELL_JS} if (!el) return false; "
            f"const t = el.textContent; return !!({predicate_js}); }}",
            arg=[i, selector],
            timeout=timeout_s * 1000,
        )
        return self.cell_text(i, selector)

    def click(self, i: int, selector: str, timeout_s: float = 30.0) -> None:
        """Click (a real mouse click) the first element matching ``selector`` in cell ``i``."""
        target = self.cell(i).locator(selector).first
        target.scroll_into_view_if_needed(timeout=timeout_s * 1000)
        target.click(timeout=timeout_s * 1000)

    def watch(self, i: int, selector: str, name: str) -> None:
        """Record every text shown in an element of cell ``i`` from now on, even the
        short-lived ones (a MutationObserver keeps each added node's text)."""
        ok = self.page.evaluate(
            f"""([i, sel, name]) => {{ {self._CELL_JS}
                if (!el) return false;
                window.__nbWatch = window.__nbWatch || {{}};
                const seen = window.__nbWatch[name] = [el.textContent];
                new MutationObserver((records) => {{
                    for (const r of records) {{
                        for (const n of r.addedNodes) seen.push(n.textContent);
                    }}
                    seen.push(el.textContent);
                }}).observe(el, {{childList: true, subtree: true, characterData: true}});
                return true;
            }}""",
            [i, selector, name],
        )
        if not ok:
            raise AssertionError(f"nothing matches {selector!r} in cell {i}")

    def watched(self, name: str) -> list[str]:
        """The texts recorded by ``watch(..., name)``, in order, repeats collapsed."""
        texts = self.page.evaluate("(name) => (window.__nbWatch || {})[name] || []", name)
        out: list[str] = []
        for t in texts:
            t = str(t).strip()
            if t and (not out or out[-1] != t):
                out.append(t)
        return out

    def is_disabled(self, i: int, selector: str) -> bool:
        return bool(
            self.page.evaluate(
                f"([i, sel]) => {{ {self._CELL_JS} return !!el && el.disabled; }}",
                [i, selector],
            )
        )

    def toasts(self) -> list[str]:
        """The texts of the notification toasts on screen (news, updates, errors)."""
        return [str(t) for t in self.page.locator(".Toastify__toast").all_inner_texts()]

    def screenshot(self, name: str) -> Path:
        """Save a screenshot of the page; no toast may cover what it shows."""
        assert not self.toasts(), f"a notification covers the page: {self.toasts()}"
        self.screenshot_dir.mkdir(parents=True, exist_ok=True)
        path = self.screenshot_dir / f"{name}.png"
        self.page.screenshot(path=str(path), full_page=False)
        return path

    def screenshot_cells(self, first: int, last: int, name: str, margin: int = 4) -> Path:
        """Save a screenshot of cells ``first`` to ``last`` (inputs and outputs) alone:
        the page clipped to their bounding box, ``margin`` pixels around it except below
        (where the next cell's selection border would show)."""
        assert not self.toasts(), f"a notification covers the page: {self.toasts()}"
        boxes = []
        for i in range(first, last + 1):
            self.cell(i).scroll_into_view_if_needed()
            box = self.cell(i).bounding_box()
            assert box is not None, f"cell {i} is not shown"
            boxes.append(box)
        x0 = min(b["x"] for b in boxes) - margin
        y0 = min(b["y"] for b in boxes) - margin
        x1 = max(b["x"] + b["width"] for b in boxes) + margin
        y1 = max(b["y"] + b["height"] for b in boxes)
        self.screenshot_dir.mkdir(parents=True, exist_ok=True)
        path = self.screenshot_dir / f"{name}.png"
        clip = {"x": max(0.0, x0), "y": max(0.0, y0), "width": x1 - x0, "height": y1 - y0}
        self.page.screenshot(path=str(path), clip=clip)
        return path


@contextlib.contextmanager
def evidence_on_failure(page: NotebookPage, server: LabServer, name: str) -> Iterator[None]:
    """On any failure inside the block: save screenshot ``name`` and print the server log.

    The screenshot is best effort (the page may be gone); the original error propagates.
    """
    try:
        yield
    except BaseException:
        try:
            page.screenshot(name)
        except Exception:
            pass
        print(server.log_tail(), file=sys.stderr)
        raise


def require_browser() -> Any:
    """Playwright's sync API; skips the test without /usr/bin/chromium (never downloads a
    browser) or without playwright.

    The browser tests are required (marked ``browser``): tests/conftest.py lists such a
    skip in the summary, and turns it into a failure under NBENGINE_REQUIRE_ALL=1 (CI).
    """
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is missing (apt-get install chromium)")
    return pytest.importorskip("playwright.sync_api")


def fresh_screenshots(sub: str = "") -> Path:
    """``artifacts/screenshots/<sub>/``, created, without the previous run's PNGs (those of
    its subfolders, other tests' screenshots, are kept)."""
    folder = SCREENSHOTS / sub if sub else SCREENSHOTS
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*.png"):
        old.unlink()
    return folder


@contextlib.contextmanager
def lab_and_browser(root: Path, base: Path) -> Iterator[tuple[LabServer, Any]]:
    """JupyterLab serving ``root`` (``jupyter_lab``) and a headless Chromium, both stopped
    on exit."""
    sync_api = require_browser()
    with jupyter_lab(root, base) as server, sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS
        )
        try:
            yield server, browser
        finally:
            browser.close()


@contextlib.contextmanager
def open_notebook(
    server: LabServer,
    browser: Any,
    name: str,
    screenshots: Path,
    *,
    failure: str = "failure",
    ready_timeout_s: float = 90.0,
    cpu_throttle: float = 1.0,
) -> Iterator[NotebookPage]:
    """A new page on notebook ``name``, its kernel connected and idle; closed on exit.

    A failure inside the block (or while opening) saves screenshot ``failure`` and prints
    the server's log (``evidence_on_failure``). ``cpu_throttle`` > 1 slows the page's CPU
    that many times (a slow browser on a loaded machine).
    """
    page = browser.new_page(viewport=VIEWPORT)
    try:
        if cpu_throttle > 1:
            page.context.new_cdp_session(page).send(
                "Emulation.setCPUThrottlingRate", {"rate": cpu_throttle}
            )
        notebook = NotebookPage(page, screenshots)
        with evidence_on_failure(notebook, server, failure):
            page.goto(server.notebook_url(name))
            notebook.wait_ready(server, timeout_s=ready_timeout_s)
            yield notebook
    finally:
        page.close()


@contextlib.contextmanager
def notebook_in_lab(
    tmp_path: Path, name: str, cells: list[str], screenshots: str = ""
) -> Iterator[NotebookPage]:
    """A new notebook ``name`` of ``cells``, open in JupyterLab in Chromium and ready to
    run (``lab_and_browser`` and ``open_notebook``), its screenshots going to a fresh
    ``artifacts/screenshots/<screenshots>/``; the server's folders under ``tmp_path``.
    Skips the test where there is no browser (``require_browser``)."""
    require_browser()
    root = tmp_path / "root"
    root.mkdir()
    write_notebook(root / name, cells)
    folder = fresh_screenshots(screenshots)
    with lab_and_browser(root, tmp_path / "jupyter") as (server, browser):
        with open_notebook(server, browser, name, folder) as page:
            yield page


def tiny_long_context_model(path: Path, arch: str, **config: Any) -> Path:
    """A tiny random model of ``arch`` with 16384 positions: a request for most of them
    is still running when the test clicks, seconds after it started."""
    from nbengine.testing import make_tiny_model

    return make_tiny_model(
        path,
        arch,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16384,
        **config,
    )
