"""Records ``{kind, env, params, rows, ...}``: built by :func:`record`, never overwritten, read by :func:`load_run`."""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

import torch

from fastattn.devices import dtype_name, dtype_of, package_version

from ..machine import cpu_features, device_name, machine_label
from ..paths import atomic_write_text, repo_root, without_machine_paths


def git_commit() -> str:
    """The checkout's commit (``-dirty`` with uncommitted changes; ``unknown`` without git or a checkout)."""
    def git(*cmd) -> str:
        return subprocess.run(["git", *cmd], cwd=repo_root(), capture_output=True, text=True, timeout=10).stdout.strip()

    try:
        sha, dirty = git("rev-parse", "--short=12", "HEAD"), git("status", "--porcelain", "--untracked-files=no")
        return (sha + ("-dirty" if dirty else "")) if sha else "unknown"
    except Exception:  # noqa: BLE001 - no git, no checkout: the commit is unknown, not an error
        return "unknown"


def env_record(device="cpu", dtype=None) -> dict:
    """What a record needs to be compared across boxes (voxcpm's version read safely: torch-only use works)."""
    device = torch.device(device)
    return {
        "time_utc": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "torch": torch.__version__, "voxcpm": package_version("voxcpm"), "fastattn": package_version("fastattn"),
        "git_commit": git_commit(), "device": str(device), "device_name": device_name(device),
        "dtype": None if dtype is None else dtype_name(dtype_of(dtype)),
        "threads": torch.get_num_threads(),
        "cpu_capability": getattr(torch.backends.cpu, "get_cpu_capability", lambda: "unknown")(),
        "cpu_features": cpu_features() if device.type == "cpu" else None,
        "python": sys.version.split()[0],
    }


def record(kind: str, *, env: dict, params: dict, rows: list, **extra) -> dict:
    """The one record constructor: ``{"kind", "env", "params", "rows", ...extra}``, checked."""
    if not isinstance(kind, str) or not kind:
        raise ValueError(f"kind must be a non-empty str, got {kind!r}")
    if not isinstance(env, dict) or not isinstance(params, dict):
        raise TypeError("env and params must be dicts")
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise TypeError(f"rows of a {kind!r} record must be a list of dicts")
    clash = {"kind", "env", "params", "rows"} & set(extra)
    if clash:
        raise ValueError(f"extra fields may not shadow {sorted(clash)}")
    return {"kind": kind, "env": env, "params": params, "rows": rows, **extra}


def save_record(record: dict, out_dir, name: Optional[str] = None) -> Path:
    """Write ``record`` as JSON (and its rows as CSV) under a fresh name; never overwrites."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    env = record.get("env", {})
    stem = name or "-".join(str(x) for x in (record.get("kind", "record"), env.get("device", ""),
                                             (env.get("dtype") or "")) if x).replace(":", "")
    path = out_dir / f"{stem}.json"
    i = 1
    while path.exists() or path.with_suffix(".csv").exists():
        i += 1
        path = out_dir / f"{stem}-{i}.json"
    text, table = record_texts(record)
    atomic_write_text(path, text)
    if table is not None:
        atomic_write_text(path.with_suffix(".csv"), table)
    return path


def record_texts(record: dict) -> tuple:
    """``(JSON, CSV of its rows or None)`` as :func:`save_record` writes them, machine paths scrubbed."""
    rows, table = record.get("rows"), None
    if rows and isinstance(rows, list) and isinstance(rows[0], dict):
        keys = list(dict.fromkeys(k for r in rows for k in r if not isinstance(r[k], (dict, list))))
        buf = io.StringIO(newline="")
        w = csv.DictWriter(buf, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
        table = without_machine_paths(buf.getvalue())
    return without_machine_paths(json.dumps(record, indent=1, default=str)), table


def save_order(path: Path) -> tuple:
    """``(stem, n)``: a record file's stem and which save of it this is (:func:`save_record`'s ``-N``; 1 for none)."""
    base, _, n = Path(path).stem.rpartition("-")
    return (base, int(n)) if n.isdigit() and base else (Path(path).stem, 1)


def _latest_first(path: Path) -> tuple:
    """Name order, the latest save of a name first (so :meth:`Run.get` reads it)."""
    stem, n = save_order(path)
    return str(path.parent), stem, -n


def find_row(rows, **match) -> Optional[dict]:
    """The first row whose fields equal ``match`` (``find_row(rec["rows"], mode="fast", position=256)``), or None."""
    return next((r for r in rows if all(r.get(k) == v for k, v in match.items())), None)


def load_record(path) -> dict:
    return json.loads(Path(path).read_text())


def _read(path: Path) -> Optional[dict]:
    try:
        rec = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # a cut-short or foreign file is not a record
    return rec if isinstance(rec, dict) and "kind" in rec else None


class Run:
    """The records of a run folder (``<notebook>/records/*.json``), a notebook's (``records/*.json``) or a committed
    one (``*.json``), matched by kind and params."""

    def __init__(self, folder):
        self.folder = Path(folder)
        self.paths = {p: rec for g in ("*.json", "records/*.json", "*/records/*.json")
                      for p in sorted(self.folder.glob(g), key=_latest_first) if (rec := _read(p)) is not None}
        self.records = list(self.paths.values())
        self.findings = {}
        for p in sorted(self.folder.glob("*/findings.json")):
            self.findings.update(json.loads(p.read_text()))

    def all(self, kind: str, notebook: Optional[str] = None, **params) -> list:
        """Every record of ``kind`` whose params equal ``params`` (and that ``notebook`` wrote), latest save first."""
        return [r for p, r in self.paths.items() if r["kind"] == kind and (notebook is None or notebook in p.parts)
                and all(r.get("params", {}).get(k) == v for k, v in params.items())]

    def get(self, kind: str, notebook: Optional[str] = None, **params) -> Optional[dict]:
        return next(iter(self.all(kind, notebook, **params)), None)

    def machine(self, env: Optional[dict] = None) -> str:
        """``env``'s machine label (default: the first record's), with this run's CPU flags."""
        env = env or next((r["env"] for r in self.records if r.get("env", {}).get("device_name")), None)
        return machine_label(env, self.cpu_flags())

    def cpu_flags(self) -> Optional[dict]:
        """The CPU flags a dtype record of this run holds, or None."""
        return next((r["flags"] for r in self.records if r.get("flags")), None)


def load_run(folder) -> Run:
    """:class:`Run` over ``folder`` (a ``reports/<run>/`` or a ``data/results/<machine>/`` folder)."""
    return Run(folder)
