"""Re-execute the tutorial notebooks and store their outputs, clean, for nbval.

Run after anything that changes what the tutorials print (the default model, say):

    python scripts/refresh_notebooks.py                 # every notebook
    python scripts/refresh_notebooks.py 01-quickstart   # some of them
    python scripts/refresh_notebooks.py --clean-only 03 # clean, do not re-execute

Each notebook is executed in place under the ``nbengine`` kernelspec (install it first:
``nbengine install-kernel``), then cleaned: widget state and per-cell execution
metadata are dropped, widget views are dropped from outputs (they name a model of a
kernel that is gone; nbval compares their ``text/plain`` only), and cells marked
``NBVAL_IGNORE_OUTPUT`` keep no outputs, since what they show changes from run to run.

``--clean-only`` cleans without executing: for a notebook edited and saved in
JupyterLab, whose stored outputs are otherwise those of a real run. To read or run the
tutorials, ``nbengine tutorials`` opens working copies and leaves these files alone;
``tests/test_notebooks_clean.py`` refuses a notebook that is not clean.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import nbformat
from nbval.plugin import find_comment_markers

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def _output_ignored(cell: nbformat.NotebookNode) -> bool:
    tags = cell.get("metadata", {}).get("tags", [])
    markers = dict(find_comment_markers(cell.source))
    return markers.get("check") is False or "nbval-ignore-output" in tags


def execute(path: Path) -> float:
    """Run ``path`` top to bottom in place; returns the wall time in seconds."""
    start = time.monotonic()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "jupyter",
            "nbconvert",
            "--execute",
            "--to",
            "notebook",
            "--inplace",
            "--ExecutePreprocessor.kernel_name=nbengine",
            "--ExecutePreprocessor.timeout=300",
            str(path),
        ],
        check=True,
        cwd=NOTEBOOKS,
    )
    return time.monotonic() - start


WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def clean(path: Path) -> None:
    """Drop widget state and views, execution metadata and the outputs of unchecked cells."""
    nb = nbformat.read(path, as_version=4)
    nb.metadata.pop("widgets", None)
    nb.metadata["language_info"] = {
        "name": nb.metadata.get("language_info", {}).get("name", "python")
    }
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
        if cell.cell_type == "code" and _output_ignored(cell):
            cell.outputs = []
        for out in cell.get("outputs", []):
            out.get("data", {}).pop(WIDGET_VIEW, None)
    nbformat.write(nb, path)


def main(args: list[str]) -> int:
    clean_only = "--clean-only" in args
    names = [a for a in args if a != "--clean-only"]
    paths = sorted(NOTEBOOKS.glob("*.ipynb"))
    if names:
        paths = [p for p in paths if any(p.stem.startswith(n) for n in names)]
    for path in paths:
        if clean_only:
            clean(path)
            print(f"{path.name}: cleaned")
            continue
        seconds = execute(path)
        clean(path)
        print(f"{path.name}: executed in {seconds:.1f}s and cleaned")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
