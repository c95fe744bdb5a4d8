"""The tutorial notebooks are committed clean, so that nbval checks what matters.

Every notebook in ``notebooks/``:

- runs under the ``nbengine`` kernelspec (the one the test command names);
- carries no saved widget state (``metadata.widgets``: megabytes of model state, random ids)
  and no widget views in outputs (each names a model of a kernel long gone: random ids
  that change on every run; nbval compares a widget output's ``text/plain`` only);
- stores no output in cells marked ``# NBVAL_IGNORE_OUTPUT`` (those outputs change per run,
  so a stored copy would only be noise in diffs) and no error outputs anywhere;
- stores the outputs of a real run (nbval compares against them), with no ``stderr``
  stream: engine threads never print, and a warning stored in a cell would hide one;
- has no ``NBVAL_SKIP`` cells: every cell runs.

Cells whose output nbval does not check (``NBVAL_IGNORE_OUTPUT``), and why:

- 01-quickstart: none (a displayed handle's ``text/plain`` is ``RequestHandle(request_id=...)``,
  which never changes while it streams; nbval skips the widget-view data).
- 02-cancel-and-reuse: none (a sanitizer in ``notebooks/sanitize.cfg`` replaces the live
  status inside the ``RequestIdInUseError`` message, which depends on how far the request got).
- 03-dashboard-and-metrics: three cells. The ``request_stats()`` and ``step_stats()``
  previews (times in seconds) and the displayed ``plot_timeline()`` figure (its JSON holds
  timestamps). The cells after them check the deterministic facts instead: columns,
  statuses, prompt and token counts, the trace names of the figure. The dashboard cell
  itself is checked: its ``text/plain`` is always ``Dashboard()`` and nbval skips the
  widget-view data.
- 04-batch-and-sampling: the ``llm.generate`` cell with the progress bar (timings, tokens/s).
- 05-your-own-model: none.
- 06-under-the-hood: none.
- 07-chat-with-a-hub-model: none (a sanitizer replaces the free memory in the memory plan
  and in the out-of-memory message, which depends on the machine).
- 08-structured-outputs: none (greedy outputs, and a seeded check that prints only True).
- 09-serve-and-chat: none (greedy replies; the server's port is never printed; the chat
  panel's ``text/plain`` is always ``ChatPanel()``).
- 10-lora-adapters: none (the training prints only whether the loss fell tenfold, the
  greedy outputs only checks; the side-by-side ``HBox`` shows its handles' stable reprs).

``test_unchecked_cells_are_listed`` keeps this list honest: it fails when the notebooks'
ignored cells no longer match it.

Running a tutorial in JupyterLab saves its outputs over the file, so these checks fail
after a session in ``notebooks/``. Read and run the tutorials from working copies
instead (``nbengine tutorials``); to undo a session, ``git checkout notebooks/``; after
editing a tutorial, ``python scripts/refresh_notebooks.py NAME`` stores a clean run
(``--clean-only`` cleans without re-running).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
PATHS = sorted(NOTEBOOKS.glob("*.ipynb"))
IGNORE = "NBVAL_IGNORE_OUTPUT"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
FIX = (
    "run the tutorials from copies (nbengine tutorials); undo with git checkout "
    "notebooks/, or store a clean run: python scripts/refresh_notebooks.py"
)

# Number of code cells marked NBVAL_IGNORE_OUTPUT per notebook (see the module docstring).
EXPECTED_UNCHECKED: dict[str, int] = {
    "01-quickstart.ipynb": 0,
    "02-cancel-and-reuse.ipynb": 0,
    "03-dashboard-and-metrics.ipynb": 3,
    "04-batch-and-sampling.ipynb": 1,
    "05-your-own-model.ipynb": 0,
    "06-under-the-hood.ipynb": 0,
    "07-chat-with-a-hub-model.ipynb": 0,
    "08-structured-outputs.ipynb": 0,
    "09-serve-and-chat.ipynb": 0,
    "10-lora-adapters.ipynb": 0,
}


def _load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))


def _source(cell: dict[str, Any]) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def _markers(cell: dict[str, Any]) -> set[str]:
    """nbval's comment markers: a comment line that is exactly the marker name."""
    found = {
        line.strip().lstrip("#").strip()
        for line in _source(cell).splitlines()
        if line.strip().startswith("#")
    }
    tags = {t.upper().replace("-", "_") for t in cell.get("metadata", {}).get("tags", [])}
    return found | tags


def _code_cells(nb: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for c in nb["cells"] if c["cell_type"] == "code"]


def unchecked_cells() -> dict[str, list[int]]:
    """Notebook name -> indices (in nbval's numbering: all cells) of NBVAL_IGNORE_OUTPUT cells."""
    result: dict[str, list[int]] = {}
    for path in PATHS:
        nb = _load(path)
        result[path.name] = [
            i
            for i, c in enumerate(nb["cells"])
            if c["cell_type"] == "code" and IGNORE in _markers(c)
        ]
    return result


def test_the_tutorials_exist() -> None:
    assert [p.name for p in PATHS] == sorted(EXPECTED_UNCHECKED)


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.name)
def test_runs_under_the_nbengine_kernelspec(path: Path) -> None:
    spec = _load(path)["metadata"].get("kernelspec", {})
    assert spec.get("name") == "nbengine", f"{path.name}: kernelspec {spec!r}"


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.name)
def test_no_widget_state(path: Path) -> None:
    nb = _load(path)
    assert "widgets" not in nb["metadata"], f"{path.name} stores widget state; {FIX}"
    for i, cell in enumerate(nb["cells"]):
        assert "widgets" not in cell.get("metadata", {}), f"{path.name} cell {i}; {FIX}"
        for out in cell.get("outputs", []):
            assert WIDGET_VIEW not in out.get("data", {}), (
                f"{path.name} cell {i} stores a widget view; {FIX}"
            )


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.name)
def test_ignored_cells_store_no_output(path: Path) -> None:
    for i, cell in enumerate(_load(path)["cells"]):
        if cell["cell_type"] == "code" and IGNORE in _markers(cell):
            assert cell["outputs"] == [], (
                f"{path.name} cell {i} is ignored but stores output; {FIX}"
            )


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.name)
def test_no_errors_and_no_skipped_cells(path: Path) -> None:
    for i, cell in enumerate(_code_cells(_load(path))):
        assert "NBVAL_SKIP" not in _markers(cell), f"{path.name}: code cell {i} is skipped"
        kinds = [o.get("output_type") for o in cell["outputs"]]
        assert "error" not in kinds, f"{path.name}: code cell {i} stores an error"
        for o in cell["outputs"]:
            if o.get("output_type") == "stream":
                assert o["name"] != "stderr", f"{path.name}: code cell {i} stores stderr"
                text = "".join(o["text"]) if isinstance(o["text"], list) else o["text"]
                assert "Traceback" not in text, f"{path.name}: code cell {i}"


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.name)
def test_checked_cells_have_outputs(path: Path) -> None:
    """A checked cell that ends in an expression or prints must have a stored output."""
    nb = _load(path)
    executed = [c for c in _code_cells(nb) if c.get("execution_count") is not None]
    assert executed, f"{path.name} was never executed; store the outputs of a real run"
    stored = [c for c in _code_cells(nb) if IGNORE not in _markers(c) and c["outputs"]]
    assert stored, f"{path.name}: no checked cell stores an output"


def test_unchecked_cells_are_listed() -> None:
    found = {name: len(cells) for name, cells in unchecked_cells().items()}
    assert found == EXPECTED_UNCHECKED, (
        "NBVAL_IGNORE_OUTPUT cells changed; update the docstring of this module: "
        f"{unchecked_cells()}"
    )


if __name__ == "__main__":
    for name, cells in unchecked_cells().items():
        print(f"{name}: unchecked cells {cells}")
