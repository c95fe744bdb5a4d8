"""``nbengine tutorials``: open the tutorial notebooks in JupyterLab, on a working copy.

Running a notebook in JupyterLab saves its new outputs (and, when asked, widget state)
over the file. The tracked notebooks in ``notebooks/`` hold the outputs nbval checks,
so the tutorials are opened from a copy in ``tutorials/`` (ignored by git) instead: the
checkout stays clean however much a reader runs, edits and saves. The copy is made
once; later calls never overwrite a reader's work (``--fresh`` starts over).
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["DEFAULT_DIR", "FIRST", "source_dir", "copy_tutorials", "lab_command"]

DEFAULT_DIR = Path("tutorials")
FIRST = "01-quickstart.ipynb"


def source_dir() -> Path:
    """The shipped tutorials: ``notebooks/`` of the checkout nbengine is installed from."""
    here = Path(__file__).resolve().parent.parent / "notebooks"
    if not (here / FIRST).is_file():
        raise FileNotFoundError(
            f"the tutorials are not next to this nbengine ({here} has no {FIRST}); they "
            "ship with the source checkout: clone the repository and install it with "
            "pip install -e '.[notebook]'"
        )
    return here


def copy_tutorials(target: Path, fresh: bool = False) -> list[Path]:
    """Copy every tutorial notebook into ``target``; returns the files written.

    A notebook already in ``target`` is kept (it may hold the reader's edits) unless
    ``fresh`` is true.
    """
    target.mkdir(parents=True, exist_ok=True)
    written = []
    for src in sorted(source_dir().glob("*.ipynb")):
        dst = target / src.name
        if dst.exists() and not fresh:
            continue
        shutil.copyfile(src, dst)
        written.append(dst)
    return written


def lab_command(target: Path, lab_args: Sequence[str] = ()) -> list[str]:
    """The ``jupyter lab`` command that opens the first tutorial in ``target``."""
    # As root (a container, say) JupyterLab refuses to start without --allow-root.
    as_root = ["--allow-root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else []
    return [
        sys.executable,
        "-m",
        "jupyter",
        "lab",
        f"--ServerApp.root_dir={target}",
        *as_root,
        *lab_args,
        str(target / FIRST),
    ]


def open_tutorials(
    target: Path, fresh: bool = False, launch: bool = True, lab_args: Sequence[str] = ()
) -> int:
    """Copy the tutorials into ``target`` and start JupyterLab there (replaces this
    process); with ``launch`` false only copy and print the command."""
    target = target.expanduser().resolve()
    written = copy_tutorials(target, fresh=fresh)
    kept = len(list(target.glob("*.ipynb"))) - len(written)
    print(
        f"Tutorials in {target}: {len(written)} copied"
        + (f", {kept} kept as you left them (--fresh replaces them)" if kept else "")
    )
    cmd = lab_command(target, lab_args)
    if not launch:
        print("Start JupyterLab with: " + " ".join(cmd))
        return 0
    try:
        import jupyterlab  # noqa: F401
    except ImportError:
        raise FileNotFoundError(
            "JupyterLab is not installed in this environment: pip install -e '.[notebook]'"
        ) from None
    sys.stdout.flush()
    os.execv(cmd[0], cmd)
    return 0  # not reached
