"""``import voxcpm`` with the live diff, before and after FlexAttention's import moved inside "live" (one record).

    python scripts/import_cost.py --out data/results/upstream [--rounds 12]

Three copies of the installed voxcpm 2.0.3: unmodified; with the live diff as it was at BEFORE (FlexAttention
imported at module level); with the live diff now. Each round imports each copy once in a fresh process, the order
rotated, after one untimed warm-up round: wall time of ``import voxcpm`` (after torch, so it is voxcpm's own cost),
peak RSS of the process, and whether ``torch.nn.attention.flex_attention`` got loaded.
"""
import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from fastattn.lab.bench.records import env_record, record, save_record
from fastattn.lab.bench.stats import ratio_ci
from fastattn.lab.paths import data_dir
from fastattn.lab.upstream import apply_diff, patched_copy, pristine_copy

BEFORE = "1bc9cf7"  # the last commit whose live diff imported FlexAttention at module level
PROBE = ("import resource, sys, time, torch, fastattn.compat as c; c.ensure_torchaudio(); t = time.perf_counter(); "
         "import voxcpm; s = time.perf_counter() - t; assert voxcpm.__file__.startswith(sys.argv[1]); "
         "print(s, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, 'torch.nn.attention.flex_attention' in "
         "sys.modules)")


def copies(tmp: Path) -> dict:
    old = subprocess.run(["git", "show", f"{BEFORE}:data/voxcpm-2.0.3-live-decode-attention.diff"], check=True,
                         capture_output=True, text=True, cwd=data_dir().parent).stdout
    before = pristine_copy(tmp / "before")
    apply_diff(before, old)
    return {"2.0.3": pristine_copy(tmp / "orig"), "live diff, flex imported at module level": before,
            "live diff": patched_copy(tmp / "now", "decode-attention")}


def probe(root: Path) -> tuple:
    r = subprocess.run([sys.executable, "-c", PROBE, str(root)], capture_output=True, text=True, check=True,
                       env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})
    s, rss, flex = r.stdout.split()
    return float(s), int(rss) / 1024, flex == "True"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=12)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        roots = copies(Path(tmp))
        names = list(roots)
        for rnd in range(args.rounds + 1):
            for name in names[rnd % 3:] + names[:rnd % 3]:
                s, rss, flex = probe(roots[name])
                if rnd:  # round 0 warms the page cache, untimed
                    rows.append({"variant": name, "round": rnd, "import_s": s, "rss_mb": rss, "flex_loaded": flex})
    times = {n: [r["import_s"] for r in rows if r["variant"] == n] for n in names}
    summary = [{"variant": n, "n": len(times[n]), "median_s": statistics.median(times[n]),
                "x_2.0.3": statistics.median(times[n]) / statistics.median(times["2.0.3"]),
                "x_2.0.3_ci": ratio_ci(times[n], times["2.0.3"]),
                "rss_mb": statistics.median(r["rss_mb"] for r in rows if r["variant"] == n),
                "flex_loaded": any(r["flex_loaded"] for r in rows if r["variant"] == n)} for n in names]
    rec = record("import_cost", env=env_record("cpu"), params={"rounds": args.rounds, "before": BEFORE}, rows=rows,
                 summary=summary)
    print(summary)
    print(save_record(rec, args.out, "import-cost-voxcpm"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
