"""The architecture's layering, checked on the source (docs/architecture.md).

The core side (``nbengine/core``) and the backends (``nbengine/distributed``) never import
the frontend: the backend contract, ``CoreClient``, lives in ``nbengine/core/client.py``.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "nbengine"


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_core_and_backends_do_not_import_the_frontend() -> None:
    offenders = {
        str(path.relative_to(PACKAGE)): sorted(m for m in _imports(path)
                                               if m.startswith("nbengine.frontend"))
        for sub in ("core", "distributed")
        for path in (PACKAGE / sub).rglob("*.py")
    }
    assert {k: v for k, v in offenders.items() if v} == {}
