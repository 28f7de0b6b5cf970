"""A run of ``scripts/voxcpm_decode_bench.py`` on someone else's machine, read back as a machine row.

``python -m tools.ingest FILE`` (in this repository) checks it (a malformed file is refused), stores it under
``data/results/bench/`` and prints its row of the ``docs/results.md`` and PR 1 table (:func:`bench_table`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Optional

from fastattn.lab.bench.records import save_record
from fastattn.lab.machine import machine_label
from fastattn.lab.paths import data_dir

__all__ = ["KIND", "check_bench", "bench_row", "bench_table", "ingest", "main"]

KIND = "voxcpm_decode_bench"
VERSION = 1


def _folder() -> Path:
    return Path(data_dir()) / "results" / "bench"


def check_bench(rec) -> dict:
    """``rec`` if it is a bench JSON this reader knows, else ValueError saying what is missing."""
    if not isinstance(rec, dict) or rec.get("kind") != KIND:
        raise ValueError(f"not a {KIND} record (kind {rec.get('kind') if isinstance(rec, dict) else None!r}); "
                         "write one with scripts/voxcpm_decode_bench.py --out FILE")
    if rec.get("version") != VERSION:
        raise ValueError(f"bench record version {rec.get('version')!r}: this reader knows version {VERSION}")
    for key in ("env", "weights", "params", "variants"):
        if key not in rec:
            raise ValueError(f"bench record lacks {key!r}")
    if not rec["variants"]:
        raise ValueError("bench record holds no variant")
    for v in rec["variants"]:
        missing = {"variant", "steps", "stream"} - set(v)
        if missing:
            raise ValueError(f"variant {v.get('variant', '?')!r} lacks {', '.join(sorted(missing))}")
        absent = [str(p) for p in rec["params"]["positions"] if str(p) not in v["steps"]]
        if absent:
            raise ValueError(f"variant {v['variant']!r} has no step timing at position {', '.join(absent)}")
    return rec


def _machine(env: dict) -> str:
    """The machine by what picks its kernels: the GPU and driver, or the project's CPU label (its features)."""
    if not env.get("gpu"):
        return machine_label({**env, "device_name": env.get("cpu") or "?"}, env.get("cpu_flags"))
    driver = f", driver {env['driver']}" if env.get("driver") else ""
    return f"{env['gpu']} ({env['device']}{driver}), torch {str(env['torch']).split('+')[0]}"


def _ci(x: Optional[list]) -> str:
    return f" [{x[0]:.2f}, {x[1]:.2f}]" if x else ""


def bench_row(rec: dict) -> dict:
    """The figures one bench run contributes: per variant that is not its own baseline (the first tree in its
    optimize mode), its decode step at each position over the baseline's (the bench's own ratio and interval), the
    stream's first and last sixth, RTF, equal waveforms."""
    check_bench(rec)
    first = rec["variants"][0]
    by = {v["variant"]: v for v in rec["variants"]}
    rest = [v for v in rec["variants"][1:] if v.get("baseline", first["variant"]) != v["variant"]]
    w = rec["weights"]
    weights = "checkpoint" if w.get("weights") == "checkpoint" else f"random {w.get('preset', '?')}"
    return {"machine": _machine(rec["env"]), "weights": weights, "dtype": first.get("dtype"),
            "chunks": rec["params"]["chunks"],
            "compared": [{"variant": v["variant"], "baseline": (b := by.get(v.get("baseline"), first))["variant"],
                          "steps": {p: (s.get("ratio_to_first"), s.get("ratio_ci")) for p, s in v["steps"].items()},
                          "stream": v["stream"], "base_stream": b["stream"], "equal": v["stream"].get("equal_to_first")}
                         for v in rest]}


def _stream(s: dict) -> str:
    if s.get("first_sixth_ms") is None:
        return "n/a"
    return (f"{s['first_sixth_ms']:.3g} -> {s['last_sixth_ms']:.3g} ms, RTF {s['rtf']:.3g}"
            if s.get("rtf") else f"{s['first_sixth_ms']:.3g} -> {s['last_sixth_ms']:.3g} ms")


def row_lines(row: dict) -> list:
    """The table rows of one bench run: one per variant compared with the baseline."""
    out = []
    for c in row["compared"]:
        steps = ", ".join(f"{p}: " + (f"{r:.2f}x{_ci(ci)}" if r is not None else "n/a")
                          for p, (r, ci) in c["steps"].items())
        out.append(f"| {row['machine']} | {row['weights']}, {row['dtype']} | {c['variant']} / {c['baseline']} | "
                   f"{steps} | {row['chunks']} chunks: {_stream(c['base_stream'])}; {_stream(c['stream'])} | "
                   f"{'identical' if c['equal'] else '**differ**'} |")
    return out


HEADER = ["| machine | weights, dtype | variant / baseline | decode step at each position (ratio, 95% CI) | "
          "stream, first -> last sixth per chunk (baseline; variant) | waveform |", "|---|---|---|---|---|---|"]


NONE = ("No run of `scripts/voxcpm_decode_bench.py` is recorded yet: its JSON becomes a row here through "
        "`python -m tools.ingest FILE`.")


def bench_table(folder: Optional[Path] = None, *, none: str = NONE) -> str:
    """Every ingested bench run as table rows, or ``none`` where no run is recorded yet."""
    folder = Path(folder or _folder())
    recs = [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))] if folder.is_dir() else []
    rows = [line for rec in recs if rec.get("kind") == KIND for line in row_lines(bench_row(rec))]
    if not rows:
        return none
    return "\n".join(HEADER + rows)


def ingest(path, *, dry_run: bool = False, into: Optional[Path] = None) -> tuple:
    """(its table rows, where it was stored or None with ``dry_run``) for the bench JSON at ``path``."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{p}: no such file")
    try:
        rec = json.loads(p.read_text())
    except ValueError as exc:
        raise ValueError(f"{p}: not JSON ({exc})") from None
    lines = row_lines(bench_row(rec))
    if dry_run:
        return lines, None
    env = rec["env"]
    name = "-".join(str(x) for x in ("bench", env.get("device", "").replace(":", ""),
                                     (env.get("gpu") or "").replace(" ", "_"), env.get("torch", "")) if x)
    return lines, save_record(rec, Path(into or _folder()), name)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.ingest", description=__doc__.split("\n\n")[0])
    ap.add_argument("file", help="the JSON scripts/voxcpm_decode_bench.py --out wrote")
    ap.add_argument("--dry-run", action="store_true", help="print the row, write nothing")
    args = ap.parse_args(argv)
    try:
        lines, where = ingest(args.file, dry_run=args.dry_run)
    except ValueError as exc:
        print(f"ingest: {exc}")
        return 2
    print("\n".join(HEADER + lines))
    if where:
        print(f"stored {where}; make docs puts it in docs/results.md and PR 1")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
