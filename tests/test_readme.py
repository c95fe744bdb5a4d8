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
