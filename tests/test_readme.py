"""The README's commands are the project's promises; CI must run exactly the test command."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _bash_blocks(text: str) -> list[str]:
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", text, flags=re.S)]


def test_readme_starts_with_demo_and_test_commands() -> None:
    blocks = _bash_blocks((ROOT / "README.md").read_text())
    assert len(blocks) >= 2
    assert blocks[0].endswith("nbengine demo")
    assert "pytest" in blocks[1]
    for block in blocks[:2]:
        assert "torch==2.13.0" in block  # the CPU wheel; unpinned torch pulls CUDA


def test_ci_runs_exactly_the_readme_test_command() -> None:
    test_command = _bash_blocks((ROOT / "README.md").read_text())[1]
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_command in ci_lines


def test_readme_opens_the_tutorials_with_one_command() -> None:
    blocks = _bash_blocks((ROOT / "README.md").read_text())
    tutorials = [b for b in blocks if "nbengine tutorials" in b]
    assert len(tutorials) == 1
    command = tutorials[0]
    assert "torch==2.13.0" in command and '".[notebook]"' in command
    assert "nbengine install-kernel" in command  # the kernel the notebooks name
    assert command.endswith("nbengine tutorials")


def test_ci_requires_every_required_test() -> None:
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert "export NBENGINE_REQUIRE_ALL=1" in ci_lines


def test_docs_index_counts_the_readme_commands() -> None:
    words = {"one": 1, "two": 2, "three": 3, "four": 4, "five": 5}
    index = " ".join((ROOT / "docs" / "index.md").read_text().split())
    m = re.search(r"\[README\]\(\.\./README\.md\) has (?:the )?(\w+) commands", index)
    assert m is not None, "docs/index.md no longer says how many commands the README has"
    assert words[m.group(1)] == len(_bash_blocks((ROOT / "README.md").read_text()))


def test_the_readme_first_cell_shows_the_readme_greedy_sample() -> None:
    # A reader runs the first notebook cell next to the README's sample text: the cell must
    # produce that text (greedy), not a sample at the default temperature.
    readme = (ROOT / "README.md").read_text()
    cell = re.findall(r"```python\n(.*?)```", readme, flags=re.S)[0]
    sample = " ".join(re.findall(r"```text\n(.*?)```", readme, flags=re.S)[0].split())
    ns: dict[str, object] = {}
    exec(cell, ns)  # the README's own code, as a reader runs it (without the display)
    engine, handle = ns["engine"], ns["h"]
    try:
        final = handle.result(timeout=120)  # type: ignore[attr-defined]
    finally:
        engine.shutdown()  # type: ignore[attr-defined]
    text = " ".join(("The for statement" + final.outputs[0].text).split())
    assert text.startswith(sample), (text, sample)
