"""The architecture's layering, checked on the source (docs/architecture.md, "Layers").

nbengine's packages import each other without cycles, lazy imports counted. The core
side (``nbengine/core``) and the backends (``nbengine/distributed``) never import the
frontend: the backend contract, ``CoreClient``, lives in ``nbengine/core/client.py``.
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
        str(path.relative_to(PACKAGE)): sorted(
            m for m in _imports(path) if m.startswith("nbengine.frontend")
        )
        for sub in ("core", "distributed")
        for path in (PACKAGE / sub).rglob("*.py")
    }
    assert {k: v for k, v in offenders.items() if v} == {}


# --------------------------------------------------------------------------- seams
# The UI, LLM, the CLI, the bench and the backends reach the frontend only through its
# public names (docs/architecture.md, "Seams"): the observer protocol, the public abort
# calls, RequestHandle's API. The frontend never imports the UI or the backends at module
# level (they are optional, loaded on first use).

# Modules that must not touch any private attribute of another object at all.
_STRICT = ("dashboard", "distributed", "bench", "llm.py", "cli.py", "demo.py")
# The frontend modules whose classes' private names nothing outside the frontend may use.
_OWNERS = {
    "frontend/engine.py": "Engine",
    "frontend/handles.py": "RequestHandle",
    "frontend/loop_bridge.py": "LoopBridge",
    "frontend/registry.py": "RequestRegistry",
}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _class_private_names(path: Path, cls_name: str) -> set[str]:
    """Private names a class defines: methods, class attributes, ``self._x`` it assigns."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: set[str] = set()
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls_name):
        for node in ast.walk(cls):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id == "self"
            ):
                names.add(node.attr)
    return {n for n in names if _is_private(n)}


def _private_accesses(path: Path) -> list[tuple[int, str, str]]:
    """``(line, attribute, source)`` of every ``x._name`` (and ``getattr(x, "_name")``)
    where ``x`` is not ``self``/``cls``/``super()`` and not rooted at an imported module."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    modules: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            modules.update(a.asname or a.name for a in node.names)

    def exempt(value: ast.expr) -> bool:
        if isinstance(value, ast.Name):
            return value.id in ("self", "cls")
        if isinstance(value, ast.Call):
            return isinstance(value.func, ast.Name) and value.func.id == "super"
        root = value
        while isinstance(root, ast.Attribute):
            root = root.value
        return isinstance(root, ast.Name) and root.id in modules  # e.g. torch.ops.x._y

    found: list[tuple[int, str, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            if not exempt(node.value) and not (
                isinstance(node.value, ast.Name) and node.value.id in modules
            ):
                found.append((node.lineno, node.attr, ast.unparse(node)))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _is_private(node.args[1].value)
            and not exempt(node.args[0])
        ):
            found.append((node.lineno, node.args[1].value, ast.unparse(node)))
    return found


def seam_violations(package: Path) -> list[str]:
    """Every breach of the seams in ``package`` (a checkout's ``nbengine`` directory)."""
    owned: set[str] = set()
    for rel, cls_name in _OWNERS.items():
        owned |= _class_private_names(package / rel, cls_name)
    out: list[str] = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package)
        if rel.parts[0] == "frontend":
            continue
        strict = rel.parts[0] in _STRICT
        for line, attr, src in _private_accesses(path):
            if strict or attr in owned:
                out.append(f"{rel}:{line}: {src}")
    for path in sorted((package / "frontend").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in tree.body:  # module level only (not `if TYPE_CHECKING:`, not functions)
            mods: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module:
                mods = [node.module]
            elif isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            for mod in mods:
                if mod.startswith(("nbengine.dashboard", "nbengine.distributed")):
                    out.append(f"{path.relative_to(package)}:{node.lineno}: import {mod}")
    return out


def test_ui_and_entry_points_use_only_public_frontend_names() -> None:
    assert seam_violations(PACKAGE) == []


def test_the_seam_check_sees_private_access_and_module_level_imports(tmp_path: Path) -> None:
    """The check is not vacuous: a copy with the old kind of breach fails it."""
    pkg = tmp_path / "nbengine"
    for sub in ("frontend", "dashboard"):
        (pkg / sub).mkdir(parents=True)
    for rel in _OWNERS:
        (pkg / rel).write_text((PACKAGE / rel).read_text(encoding="utf-8"), encoding="utf-8")
    (pkg / "frontend" / "extra.py").write_text("from nbengine.dashboard.monitor import X\n")
    (pkg / "dashboard" / "ui.py").write_text(
        "def f(engine):\n    engine._call_soon(print)\n    return getattr(engine, '_x', 0)\n"
    )
    (pkg / "model.py").write_text("def g(llm):\n    return llm.engine._processor\n")
    assert sorted(seam_violations(pkg)) == [
        "dashboard/ui.py:2: engine._call_soon",
        "dashboard/ui.py:3: getattr(engine, '_x', 0)",
        "frontend/extra.py:1: import nbengine.dashboard.monitor",
        "model.py:2: llm.engine._processor",
    ]


# ---------------------------------------------------------------- acyclic packages
# The units are nbengine's subpackages and its top-level modules ("nbengine" is its
# __init__). An edge is any import that runs: at module level or inside a function (a
# lazy import); only `if TYPE_CHECKING:` blocks are left out (they never run). The
# graph must be acyclic (docs/architecture.md, "Layers"), except for the notebook
# conveniences named here, which import the UI lazily from the frontend.

ALLOWED_LAZY = {
    # (module, function, imported unit)
    ("frontend/notebook.py", "serve", "server"),
    ("frontend/notebook.py", "chat_ui", "dashboard"),
    # Engine.dashboard() and plot_timeline() reach the UI through `monitor`, which
    # creates the engine's EngineMonitor (the UI over its metrics log) on first use.
    ("frontend/notebook.py", "monitor", "dashboard"),
    # A handle displays as its widget: `_repr_mimebundle_` and `widget()` import the UI
    # when a notebook asks for them.
    ("frontend/handles.py", "_repr_mimebundle_", "dashboard"),
    ("frontend/handles.py", "widget", "dashboard"),
}


def _unit(rel: Path) -> str:
    if rel.parts == ("__init__.py",):
        return "nbengine"
    return rel.parts[0].removesuffix(".py")


def _target_unit(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "nbengine":
        return None
    return "nbengine" if len(parts) == 1 else parts[1]


def _runtime_imports(tree: ast.Module) -> list[tuple[ast.AST, str, str]]:
    """``(node, enclosing function or "", module)`` of every import that can run."""
    found: list[tuple[ast.AST, str, str]] = []

    def visit(node: ast.AST, func: str) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for other in node.orelse:
                visit(other, func)
            return
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            func = func or node.name  # a method's lazy import counts for the method
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "nbengine":  # `from nbengine import x`: x's unit
                found.extend((node, func, f"nbengine.{a.name}") for a in node.names)
            else:
                found.append((node, func, node.module))
        elif isinstance(node, ast.Import):
            found.extend((node, func, a.name) for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child, func)

    visit(tree, "")
    return found


def package_edges(package: Path) -> dict[tuple[str, str], list[str]]:
    """``(unit, imported unit) -> ["module:line", ...]`` over every runtime import,
    less ``ALLOWED_LAZY``."""
    edges: dict[tuple[str, str], list[str]] = {}
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package)
        src = _unit(rel)
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node, func, module in _runtime_imports(tree):
            dst = _target_unit(module)
            if dst is None or dst == src:
                continue
            if dst != "nbengine" and not (
                (package / dst).is_dir() or (package / f"{dst}.py").is_file()
            ):
                dst = "nbengine"  # `from nbengine import Engine`: the package's facade
            if (rel.as_posix(), func, dst) in ALLOWED_LAZY:
                continue
            edges.setdefault((src, dst), []).append(f"{rel.as_posix()}:{node.lineno}")
    return edges


def cycle_edges(package: Path) -> dict[tuple[str, str], list[str]]:
    """The edges that lie on a cycle (both ends in one strongly connected component)."""
    edges = package_edges(package)
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())

    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph[todo.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    reachable = {unit: reach(unit) for unit in graph}
    return {(a, b): locs for (a, b), locs in edges.items() if a in reachable[b]}


def test_the_package_graph_is_acyclic() -> None:
    found = {f"{a} -> {b}: {', '.join(locs)}" for (a, b), locs in cycle_edges(PACKAGE).items()}
    assert sorted(found) == []


def test_the_cycle_check_sees_lazy_imports(tmp_path: Path) -> None:
    """Not vacuous: a function-level import that closes a cycle is found; a
    TYPE_CHECKING-only import and an allowed notebook convenience are not edges."""
    pkg = tmp_path / "nbengine"
    for sub in ("core", "model", "frontend", "server"):
        (pkg / sub).mkdir(parents=True)
    (pkg / "core" / "a.py").write_text("def f():\n    from nbengine.model.b import g\n")
    (pkg / "model" / "b.py").write_text("from nbengine.core.a import f\n")
    (pkg / "frontend" / "notebook.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from nbengine.server import S\n"
        "def serve():\n    from nbengine.server import serve\n"
    )
    (pkg / "server" / "s.py").write_text("from nbengine.frontend.notebook import serve\n")
    assert cycle_edges(pkg) == {
        ("core", "model"): ["core/a.py:2"],
        ("model", "core"): ["model/b.py:1"],
    }
