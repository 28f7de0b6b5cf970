"""Where the workbook's files are, from the package, not the working directory (papermill kernels run anywhere).

``FASTATTN_ROOT`` overrides the repository root (a non-editable install has no ``data/`` beside it)."""

from __future__ import annotations

import csv
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Optional

__all__ = ["repo_root", "data_dir", "notebooks", "reports_dir", "atomic_write_text", "without_machine_paths"]


def repo_root() -> Path:
    """The checkout that holds ``data/`` and ``notebooks/``."""
    env = os.environ.get("FASTATTN_ROOT")
    root = Path(env).resolve() if env else Path(__file__).resolve().parents[2]
    if not (root / "data").is_dir():
        raise FileNotFoundError(
            f"fastattn's data/ folder was not found under {root}. Install fastattn from its checkout "
            "with `pip install -e .` or set FASTATTN_ROOT to the checkout."
        )
    return root


def data_dir() -> Path:
    return repo_root() / "data"


def notebooks() -> list[Path]:
    """The workbook's notebooks (``NN_*.ipynb``), in order."""
    return sorted((repo_root() / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def reports_dir() -> Path:
    return repo_root() / "reports"


def without_machine_paths(text: str, run_dir: Optional[Path] = None) -> str:
    """``text`` with ``run_dir`` as ``.`` and temporary, venv, checkout and home paths as placeholders."""
    text = re.sub(re.escape(tempfile.gettempdir()) + r"/tmp[\w.-]+", "<tmp>", text)
    runs = [(str(run_dir.resolve()), "."), (str(run_dir), ".")] if run_dir is not None else []
    for old, new in [*runs, (sys.prefix, "<python>"), (str(repo_root()), "<fastattn>"), (str(Path.home()), "~")]:
        if old and old not in (".", "/"):
            text = text.replace(old, new)
    return text


def atomic_write_text(path, text: str) -> Path:
    """Write ``text`` to ``path`` whole or not at all (temporary file, fsync, rename); errors propagate."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def load_published(name: str) -> list[dict]:
    """Rows of one CSV under data/published/ (the seeds' own figures, read, never typed)."""
    with (data_dir() / "published" / name).open(newline="") as f:
        return list(csv.DictReader(f))
