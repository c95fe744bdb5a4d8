"""A pytest plugin: tests that must not be skipped quietly.

Some tests skip where the machine lacks what they need: the browser tests without
``/usr/bin/chromium``, the native-kernel tests on a CPU without AVX-512 BF16. A quiet
``s`` in the progress line hides that a promise was not checked, so a test marked
``@pytest.mark.required`` (or ``browser``, which implies it) that skips is

- listed in its own, red section of the terminal summary, with the reason; and
- a failure instead when the environment variable ``NBENGINE_REQUIRE_ALL`` is ``1``
  (``.ci/run`` sets it: on CI every required test must run).

A test marked ``@pytest.mark.cpu_feature(reason)`` needs a CPU feature that CI's machine
may lack (AMX tiles; tests/support/cpu_features.py): its skip with exactly that reason is
an ordinary skip, even in a required suite.

tests/conftest.py loads it; tests/test_required_skips.py runs pytest on a small suite
with it.
"""

from __future__ import annotations

import os

import pytest

REQUIRE_ALL_ENV = "NBENGINE_REQUIRE_ALL"
REQUIRED_MARKERS = ("required", "browser")

_skipped_key = pytest.StashKey[list[tuple[str, str]]]()


def _is_required(item: pytest.Item) -> bool:
    return any(item.get_closest_marker(m) is not None for m in REQUIRED_MARKERS)


def _skipped_for_a_cpu_feature(item: pytest.Item, reason: str) -> bool:
    return any(reason == m.args[0] for m in item.iter_markers("cpu_feature") if m.args)


def _require_all() -> bool:
    return os.environ.get(REQUIRE_ALL_ENV, "") == "1"


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # (path, line, "Skipped: why")
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "required: must run on CI; a skip is listed in the summary "
        "(tests/support/required_tests.py)",
    )
    config.addinivalue_line("markers", "browser: drives JupyterLab in headless Chromium")
    config.addinivalue_line(
        "markers",
        "cpu_feature(reason): needs a CPU feature CI may lack; a skip for that reason is "
        "ordinary (tests/support/cpu_features.py)",
    )
    config.stash[_skipped_key] = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    """Record (or, under NBENGINE_REQUIRE_ALL=1, fail) the skip of a required test."""
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if not report.skipped or not _is_required(item) or hasattr(report, "wasxfail"):
        return
    reason = _skip_reason(report)
    if _skipped_for_a_cpu_feature(item, reason):
        return
    if _require_all():
        report.outcome = "failed"
        report.longrepr = (
            f"required test skipped ({REQUIRE_ALL_ENV}=1 makes this a failure): {reason}"
        )
    else:
        item.config.stash[_skipped_key].append((item.nodeid, reason))


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, exitstatus: int, config: pytest.Config
) -> None:
    """A red section naming every required test that was skipped, and why."""
    skipped = config.stash.get(_skipped_key, [])
    if not skipped:
        return
    tr = terminalreporter
    tr.write_sep(
        "!", f"{len(skipped)} REQUIRED TESTS SKIPPED: not checked here", red=True, bold=True
    )
    for nodeid, reason in skipped:
        tr.write_line(f"SKIPPED (required) {nodeid}: {reason}", red=True)
    tr.write_line(
        f"These run on CI, where {REQUIRE_ALL_ENV}=1 turns a skip into a failure "
        "(docs/testing.md).",
        yellow=True,
    )
