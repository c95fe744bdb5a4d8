"""A skipped required test is loud: its own summary section, and a failure under
NBENGINE_REQUIRE_ALL=1 (tests/support/required_tests.py), checked by running pytest on a
small suite with that plugin."""

from __future__ import annotations

from pathlib import Path

import pytest

TESTS = Path(__file__).parent  # holds the ``support`` package the plugin lives in

SUITE = """
import pytest

@pytest.mark.browser
def test_needs_a_browser():
    pytest.skip("/usr/bin/chromium is missing")

@pytest.mark.required
@pytest.mark.skipif(True, reason="native kernels: no avx512_bf16")
def test_needs_avx512():
    pass

@pytest.mark.required
@pytest.mark.cpu_feature("no AMX tiles on this CPU")
@pytest.mark.skipif(True, reason="no AMX tiles on this CPU")
def test_needs_amx():
    pass

@pytest.mark.required
@pytest.mark.cpu_feature("no AMX tiles on this CPU")
def test_needs_amx_and_the_kernels():
    pytest.skip("native kernels: no C compiler")

def test_optional():
    pytest.skip("not required")

def test_runs():
    pass
"""


@pytest.fixture
def suite(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    pytester.makeconftest('pytest_plugins = ["support.required_tests"]\n')
    pytester.makepyfile(test_suite=SUITE)
    monkeypatch.setenv("PYTHONPATH", str(TESTS))  # the pytest subprocess imports support
    return pytester


def test_skips_are_listed_in_their_own_section(
    suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("NBENGINE_REQUIRE_ALL", raising=False)
    result = suite.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, skipped=5)
    out = result.stdout.str()
    assert "3 REQUIRED TESTS SKIPPED" in out
    result.stdout.fnmatch_lines(
        [
            "*SKIPPED (required) test_suite.py::test_needs_a_browser: /usr/bin/chromium is missing",
            "*SKIPPED (required) test_suite.py::test_needs_avx512: native kernels: no avx512_bf16",
            # Marked for a CPU feature, but skipped for another reason: still required.
            "*SKIPPED (required) test_suite.py::test_needs_amx_and_the_kernels: native kernels: "
            "no C compiler",
        ]
    )
    listed = out.split("REQUIRED TESTS SKIPPED")[1]
    # A CPU feature CI may lack (AMX tiles) is an ordinary skip, like a test not required.
    assert "test_optional" not in listed and "test_needs_amx:" not in listed
    assert result.ret == 0


def test_require_all_turns_them_into_failures(
    suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NBENGINE_REQUIRE_ALL", "1")
    result = suite.runpytest_subprocess("-p", "no:cacheprovider")
    # A skip at setup (a skipif mark) fails as an error, one in the test body as a failure;
    # the skip for a missing CPU feature stays a skip.
    result.assert_outcomes(passed=1, skipped=2, failed=2, errors=1)
    result.stdout.fnmatch_lines(["*required test skipped (NBENGINE_REQUIRE_ALL=1*"])
    assert result.ret == 1
