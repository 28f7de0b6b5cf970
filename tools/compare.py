"""``python -m tools.compare FOLDER ...``: a hardware matrix, one column per machine, across run folders and
committed record folders (markdown; ``--html F`` also as a page)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fastattn.lab.bench.metrics import attention_record, headlines, kv_mb
from fastattn.lab.bench.records import load_run
from fastattn.lab.bench.stream import stream_verdicts
from fastattn.lab.bench.targets import target_records
from fastattn.lab.paths import atomic_write_text
from fastattn.lab.report import CSS
from fastattn.lab.tables import html_table, md_table


def _measures(run) -> dict:
    """The headline measures one machine's records hold (:data:`fastattn.lab.bench.metrics.HEADLINES`, then what
    ``fast`` chose, the cache growth and the stream verdicts); absent ones are simply missing."""
    out = {k: f.text() for k, f in headlines(run).items()}
    for dt in ("float32", "bfloat16"):
        warm = [r for r in run.all("attention", dtype=dt) if r["params"].get("caches", 1) == 1]
        att = attention_record(run, dt) or (warm[0] if warm else None)  # 05's sweep, else 01's (its granularity)
        fc = run.get("fast_choice")  # 02's record of the choice per key-count class, where no sweep kept one
        won = {c["winner"] for c in att["fast_choice"]} if att and att.get("fast_choice") else \
            {r["candidate"] for r in (fc or {}).get("rows", []) if r.get("winner") and r["class"].startswith(dt)}
        if won:
            out[f"fast's implementation, {dt}"] = ", ".join(sorted(won))
        if att and "exact_granularity" in att["params"]:
            out[f"exact granularity, {dt}"] = str(att["params"]["exact_granularity"])
    found = target_records(run)
    whole, kv = found["whole"], found["kv"]
    if whole:
        out["whole decode output"] = "bit-identical" if whole["identical"] else "differs"
    if kv:
        out["KV of a 300-token request, full model, bf16"] = "{:.3g} MB -> {:.3g} MB".format(*kv_mb(kv))
    for r in run.all("stream_profile"):
        for v, text in stream_verdicts(r).items():
            out[f"stream {r['params']['preset']} {r['params']['chunks']} chunks: {v}"] = text
    return out


def _machine(run) -> str:
    has_env = any(isinstance(r.get("env"), dict) and r["env"].get("device_name") for r in run.records)
    return f"{run.machine() if has_env else run.folder.name} ({run.folder.name})"


def compare(paths) -> dict:
    """``{"machines": [...], "rows": [{"measure": ..., machine: value or "not measured"}]}`` over folders."""
    cols, per = [], []
    for p in map(Path, paths):
        if not p.is_dir():
            raise ValueError(f"{p}: not a run folder or a record folder")
        run = load_run(p)
        if not run.records:
            raise ValueError(f"{p}: holds no fastattn records")
        cols.append(_machine(run))
        per.append(_measures(run))
    names = list(dict.fromkeys(k for m in per for k in m))
    rows = [{"measure": n, **{c: m.get(n, "not measured") for c, m in zip(cols, per)}} for n in names]
    return {"machines": cols, "rows": rows}


def compare_markdown(matrix: dict) -> str:
    return "\n".join(md_table(matrix["rows"])) + "\n"


def compare_html(matrix: dict) -> str:
    table = html_table(matrix["rows"], ["measure", *matrix["machines"]], text=str)
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>fastattn hardware matrix</title>"
            f"<style>{CSS}</style></head><body><h1>fastattn hardware matrix</h1>{table}</body></html>")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.compare",
                                 description="A hardware matrix across runs and committed record folders.")
    ap.add_argument("folders", nargs="+", help="reports/<run>/ or data/results/<box>/ folders")
    ap.add_argument("--html", default=None, help="also write the matrix as HTML to this file (never overwritten)")
    args = ap.parse_args(argv)
    try:
        matrix = compare(args.folders)
    except ValueError as exc:
        print(f"[fastattn] error: {exc}", file=sys.stderr)
        return 2
    print(compare_markdown(matrix), end="")
    if args.html:
        out = Path(args.html)
        if out.exists():
            print(f"[fastattn] error: --html {out}: exists (never overwritten)", file=sys.stderr)
            return 2
        atomic_write_text(out, compare_html(matrix))
        print(f"[fastattn] wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
