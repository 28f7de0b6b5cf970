"""Write the workbook's time calibration, ``data/budget/<kernel class>.json``, from finished runs of 01-05 and this
machine's probe:   .venv/bin/python scripts/calibrate_budget.py RUN [RUN ...] [--device cpu]"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

from fastattn.lab.budget import SCALABLE, probe, probe_ms
from fastattn.lab.paths import atomic_write_text, data_dir


def calibrate(run_dirs, probe_rec: dict, path: Optional[Path] = None) -> dict:
    """Write the calibration from finished runs (one run of 01-05, or several that cover them, the later one
    winning; budgeted or not) and this machine's probe: a notebook's fixed seconds are its duration less the sized
    measurements' own measured time (05's sweeps scaled to the default repeats). Written to
    ``data/budget/<the probe's kernel class>.json``."""
    runs = [Path(r) for r in ([run_dirs] if isinstance(run_dirs, (str, Path)) else run_dirs)]
    where, dur, used = {}, {}, {}
    for run in runs:
        for nb in json.loads((run / "summary.json").read_text())["notebooks"]:
            if nb.get("status") == "ok":
                stem = Path(nb["name"]).stem
                where[stem], dur[stem], used[stem] = run, nb["duration_s"], nb.get("parameters", {})
    missing = [s for s, _, _ in SCALABLE.values() if s not in where]
    if missing:
        raise ValueError(f"calibrate: no finished run of {', '.join(missing)} among {[str(r) for r in runs]}")
    stream = _record(where["01_root_cause"] / "01_root_cause" / "records", "stream_profile")
    whole = _record(where["05_profiling"] / "05_profiling" / "records", "dtype_decode")
    chunk = probe_ms(probe_rec)
    ran = used["05_profiling"].get("repeats", SCALABLE["repeats"][1])  # a budgeted run: scaled to the default
    sweep_s = _sweep_seconds(where["05_profiling"] / "05_profiling.ipynb") * SCALABLE["repeats"][1] / ran
    fixed = dict(dur)
    fixed["01_root_cause"] -= sum(r["ms"] for r in stream["rows"]) / 1e3
    fixed["05_profiling"] -= whole["spent_s"] + sweep_s * ran / SCALABLE["repeats"][1]
    cal = {"kernel_class": probe_rec["kernel_class"], "source": sorted({where[s].name for s in dur}),
           "probe": probe_rec, "fixed_s": fixed, "sweep_s": sweep_s,
           "full_build_s": whole["build_s"],
           "full_over_small": {d: whole["step_s"][d] / (chunk[d] / 1e3) for d in whole["step_s"] if d in chunk}}
    path = Path(path or data_dir() / "budget" / f"{cal['kernel_class']}.json")
    atomic_write_text(path, json.dumps(cal, indent=1) + "\n")
    return cal


def _sweep_seconds(executed: Path) -> float:
    """Seconds of an executed 05's cells that take its ``repeats`` (papermill's per-cell durations): its sweeps."""
    cells = json.loads(executed.read_text())["cells"]
    return sum(c.get("metadata", {}).get("papermill", {}).get("duration") or 0.0 for c in cells
               if c["cell_type"] == "code" and 'P["repeats"]' in "".join(c["source"]))


def _record(folder: Path, kind: str) -> dict:
    for f in sorted(folder.glob("*.json")):
        rec = json.loads(f.read_text())
        if rec.get("kind") == kind:
            return rec
    raise ValueError(f"{folder}: no {kind} record (calibrate from a default run of 01 and 05)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", metavar="RUN", help="reports/<run>/ folders that cover 01-05")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    cal = calibrate(args.runs, probe(args.device))
    keys = ("source", "fixed_s", "sweep_s", "full_build_s", "full_over_small")
    print(json.dumps({k: cal[k] for k in keys}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
