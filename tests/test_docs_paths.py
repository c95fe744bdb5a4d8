"""Every project path the README and docs/ cite exists, and so does every name cited as
``path::name``: a reader who follows one finds it (files move; their citations must move
with them)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# A path in the checkout: it starts at a top-level folder, not inside another path
# (``~/.cache/nbengine/native/`` is a cache, not the package), and may name a definition
# in it (``tests/reliability/conftest.py::core_snapshot``) or be a glob
# (``docs/bench-runs/2026-12-01-amd-*.json``: at least one file must match), with
# alternatives in braces (``...-W2-{bf16,int8}.json``: each must exist).
_PATH = re.compile(
    r"(?<![\w./~$-])((?:tests|nbengine|scripts|notebooks|docs)/(?:[\w./*-]|\{[\w.,-]+\})*"
    r"[\w/*}])(?:::(\w+))?"
)
_BRACES = re.compile(r"\{([\w.,-]+)\}")
# A relative Markdown link: [text](target) or [text](target#anchor).
_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _citations() -> list[tuple[str, str, str | None]]:
    found = []
    for doc in DOCS:
        for m in _PATH.finditer(doc.read_text(encoding="utf-8")):
            for path in _expand(m.group(1)):
                found.append((doc.relative_to(ROOT).as_posix(), path, m.group(2)))
    return found


def _expand(path: str) -> list[str]:
    """``a-{x,y}.json`` -> ``a-x.json``, ``a-y.json`` (the first braces, then the rest)."""
    m = _BRACES.search(path)
    if m is None:
        return [path]
    head, tail = path[: m.start()], path[m.end() :]
    return [p for alt in m.group(1).split(",") for p in _expand(head + alt + tail)]


def _defines(path: Path, name: str) -> bool:
    text = path.read_text(encoding="utf-8")
    return (
        re.search(rf"^\s*(?:async\s+def|def|class)\s+{name}\b|^{name}\s*[:=]", text, re.M)
        is not None
    )


def test_docs_cite_some_paths() -> None:
    # The pattern finds the citations at all (a broken pattern would pass every check).
    cited = {path for _, path, _ in _citations()}
    assert "tests/support/engine_state.py" in cited or "tests/reliability/" in cited
    assert len(cited) > 20


@pytest.mark.parametrize("doc", [d.relative_to(ROOT).as_posix() for d in DOCS])
def test_every_cited_path_exists(doc: str) -> None:
    stale = []
    for where, path, name in _citations():
        if where != doc:
            continue
        target = ROOT / path
        if "*" in path:
            if not any(ROOT.glob(path)):
                stale.append(f"{path} (matches no file)")
        elif not target.exists():
            stale.append(path)
        elif name is not None and (not target.is_file() or not _defines(target, name)):
            stale.append(f"{path}::{name} (no such definition there)")
    assert not stale, f"{doc} cites paths that do not exist: {stale}"


@pytest.mark.parametrize("doc", [d.relative_to(ROOT).as_posix() for d in DOCS])
def test_every_relative_link_resolves(doc: str) -> None:
    path = ROOT / doc
    broken = [
        target
        for target in _LINK.findall(path.read_text(encoding="utf-8"))
        if not re.match(r"[a-z]+:", target) and not (path.parent / target).exists()
    ]
    assert not broken, f"{doc} links to files that do not exist: {broken}"
