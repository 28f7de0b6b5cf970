"""The kits against upstream's own trees, as one record (run once per upstream snapshot, by hand).

    python scripts/upstream_check.py --main CHECKOUT --tag-2.0.3 CHECKOUT --pr325 CHECKOUT --out data/results/upstream

Each CHECKOUT is an export of upstream's repository (``git archive``) at main, at tag 2.0.3 and at PR #325's merge
ref. Checks: every diff (the ``src`` ones; on 2.0.3's tree the 2.0.3 ones) applied alone and all three stacked in
every order, on each tree (in Python, exact context); upstream's own ``tests/`` and the kits' upstream-style tests
(each src diff carries its own, a new file under tests/) on main with the three diffs stacked, with its own diff
alone and on unmodified main, each PR's test file counted alone; each PR's bench command (scripts/
voxcpm_decode_bench.py) on main against main with its diff alone, on CPU with random tiny weights.
"""
import argparse
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

from fastattn.lab.bench.records import env_record, record, save_record
from fastattn.lab.paths import data_dir
from fastattn.lab.upstream import KITS, SCRIPT_PATCHES, DiffError, apply_diff


def applies(tree: Path, kits, layout: str) -> dict:
    """``layout``'s diffs of ``kits`` applied in order to a copy of ``tree``'s ``src/`` and ``scripts/`` (wheel
    diffs: inside ``src/``)."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "t"
        for part in ("src", "scripts"):
            shutil.copytree(tree / part, root / part)
        at = root if layout == "src" else root / "src"
        try:
            offsets = [apply_diff(at, (data_dir() / KITS[k][1][layout]).read_text()) for k in kits]
        except DiffError as exc:
            return {"applies": False, "error": str(exc)}
    return {"applies": True, "max_offset": max(abs(o) for hunks in offsets for _, _, o in hunks)}


def pytest_outcomes(root: Path, paths: list) -> dict:
    (root / "r.xml").unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": str(root / "src")}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--junitxml=r.xml", *paths],
                       cwd=root, capture_output=True, text=True, timeout=1800, env=env)
    cases = list(ET.parse(root / "r.xml").getroot().iter("testcase")) if (root / "r.xml").exists() else []
    why = {c.get("name"): (c.find("failure") if c.find("failure") is not None else c.find("error")) for c in cases}
    bad = {n: e.get("message", "")[-160:] for n, e in why.items() if e is not None}
    skipped = sum(c.find("skipped") is not None for c in cases)
    return {"passed": len(cases) - len(bad) - skipped, "failed": len(bad), "skipped": skipped, "failed_tests": bad,
            "tail": r.stdout.strip().splitlines()[-1:] if r.stdout.strip() else r.stderr[-300:]}


def test_runs(main: Path) -> list:
    """Upstream's own tests, then each PR's new test file (its own counts), on main patched and unmodified. The src
    diffs carry their tests (new files under tests/); unmodified main gets the same files copied in."""
    own = sorted(p.relative_to(main).as_posix() for p in (main / "tests").rglob("test_*.py"))
    rows = []
    for patched in (True, False):
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp) / "main"
            shutil.copytree(main, root)
            for k in KITS if patched else ():
                apply_diff(root, (data_dir() / KITS[k][1]["src"]).read_text())
            rows.append({"check": "upstream's own tests/, " + ("the three diffs stacked" if patched else "unmodified"),
                         **pytest_outcomes(root, own)})
            for kit, (_, _, test) in KITS.items():
                if not patched:
                    shutil.copy(data_dir() / "upstream-tests" / test, root / "tests" / test)
                rows.append({"check": "a PR's test, " + ("the three diffs stacked" if patched else "unmodified main"),
                             "kit": kit, "test": test, **pytest_outcomes(root, [f"tests/{test}"])})
    for kit, (_, diffs, test) in KITS.items():  # each PR's test with its own diff alone
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp) / "main"
            shutil.copytree(main, root)
            apply_diff(root, (data_dir() / diffs["src"]).read_text())
            rows.append({"check": "a PR's test, its diff alone", "kit": kit, "test": test,
                         **pytest_outcomes(root, [f"tests/{test}"])})
    return rows


#: the switch each PR's bench command sets (its text's "Check it on your machine"); right-sized has none
SWITCH = {"right-sized": {}, "cpu-dtype": {"VOXCPM_CPU_DTYPE": "float32"},
          "decode-attention": {"VOXCPM_DECODE_ATTENTION": "live"}}
BENCH = Path(__file__).resolve().parent / "voxcpm_decode_bench.py"


def bench_runs(main: Path) -> list:
    """Each PR's bench command rehearsed on CPU (random tiny weights, ``--quick``): main's ``src/`` against a copy
    with the PR's diff alone, with the PR's switch unset and set. Which waveforms match is the outcome; the step
    ratios are a 2-core CPU's at toy size, kept as evidence only."""
    rows = []
    for kit, (_, diffs, _) in KITS.items():
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp) / "pr"
            shutil.copytree(main, root)
            apply_diff(root, (data_dir() / diffs["src"]).read_text())
            for env in ({}, SWITCH[kit]) if SWITCH[kit] else ({},):
                out = Path(tmp) / f"bench-{len(rows)}.json"
                r = subprocess.run([sys.executable, str(BENCH), "--random", "tiny", "--quick", "--device", "cpu",
                                    "--variant", f"main={main / 'src'}", "--variant", f"pr={root / 'src'}", "--out",
                                    str(out)], capture_output=True, text=True, timeout=1800, env={**os.environ, **env})
                row = {"check": "the bench on main, its diff alone", "kit": kit, "switch": env,
                       "returncode": r.returncode, "stderr": r.stderr[-300:] if r.returncode else ""}
                if out.exists():
                    a, b = json.loads(out.read_text())["variants"]
                    row.update(equal=b["stream"]["equal_to_first"], dtypes=[a["dtype"], b["dtype"]],
                               seeding=[a["stream"]["seeding"], b["stream"]["seeding"]],
                               step_ratio={p: s["ratio_to_first"] for p, s in b["steps"].items()},
                               step_ratio_ci={p: s["ratio_ci"] for p, s in b["steps"].items()})
                rows.append(row)
    return rows


def script_runs(main: Path) -> list:
    """Upstream's own check scripts a PR changes (``SCRIPT_PATCHES``), run on main with the PR's diff alone, with its
    switch unset and set in the environment (a maintainer's shell may have it set), and once more with the switch set
    and main's own script (the PR's package change without its script change)."""
    rows = []
    for kit, patch in SCRIPT_PATCHES.items():
        script = next(line[6:].strip() for line in (data_dir() / "upstream-tests" / patch).read_text().splitlines()
                      if line.startswith("+++ b/"))
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp) / "pr"
            shutil.copytree(main, root)
            apply_diff(root, (data_dir() / KITS[kit][1]["src"]).read_text())
            clean = {k: v for k, v in os.environ.items() if k not in SWITCH[kit]}
            for env, mains in (({}, False), (SWITCH[kit], False), (SWITCH[kit], True)):
                if mains:
                    shutil.copy(main / script, root / script)
                r = subprocess.run([sys.executable, script], cwd=root, capture_output=True, text=True, timeout=600,
                                   env={**clean, **env})
                rows.append({"check": "upstream's check script, its diff alone", "kit": kit, "script": script,
                             "switch": env, "script_changed": not mains, "returncode": r.returncode,
                             "tail": (r.stdout.strip().splitlines() or [""])[-1]})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name in ("main", "tag-2.0.3", "pr325"):
        ap.add_argument(f"--{name}", type=Path, required=True)
    ap.add_argument("--commits", required=True, help="main=SHA,tag-2.0.3=SHA,pr325=SHA (what the exports are)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    trees = {"main": args.main, "tag-2.0.3": getattr(args, "tag_2.0.3"), "pr325": args.pr325}
    rows = []
    for tree, path in trees.items():
        layout = "wheel" if tree == "tag-2.0.3" else "src"  # 2.0.3's tree takes the 2.0.3 diffs
        for kit in KITS:
            rows.append({"check": "applies alone", "tree": tree, "diffs": layout, "kits": kit,
                         **applies(path, [kit], layout)})
        for order in itertools.permutations(KITS):
            rows.append({"check": "applies stacked", "tree": tree, "diffs": layout, "kits": " + ".join(order),
                         **applies(path, order, layout)})
    rows += [{"tree": "main", **r} for r in test_runs(args.main) + bench_runs(args.main) + script_runs(args.main)]
    commits = dict(kv.split("=") for kv in args.commits.split(","))
    rec = record("upstream_check", env=env_record("cpu"), params={"commits": commits}, rows=rows)
    print(save_record(rec, args.out, f"upstream-check-main-{commits['main'][:7]}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
