"""The kits against upstream's own trees, as one record (run once per upstream snapshot, by hand).

    python scripts/upstream_check.py --main CHECKOUT --tag-2.0.3 CHECKOUT --pr325 CHECKOUT \\
        --commits main=SHA,tag-2.0.3=SHA,pr325=SHA --out data/results/upstream

Each CHECKOUT is an export of upstream's repository (``git archive``) at main, at tag 2.0.3 and at PR #325's merge
ref. Checks, in Python with exact context: every diff (the ``src`` ones; on 2.0.3's tree the 2.0.3 ones; the bench's
one diff on every tree) applied alone and all four stacked in every order, on each tree. Tests: upstream's own
``tests/`` on main with the four diffs stacked and unmodified; each PR's test (a new file under tests/, or PR 2's
cases added to ``tests/test_model_utils.py``) on main with the four stacked, with its own diff alone, and on
unmodified main with only the test added; the bench PR's test on the 2.0.3 tag too. Each fix PR's bench command
(the bench PR's ``scripts/voxcpm_decode_bench.py``) on main with the bench PR applied, against main with the bench
PR and the fix PR, on CPU with random tiny weights; upstream's check script PR 2 changes.
"""
import argparse
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from fastattn.lab.bench.records import env_record, record, save_record
from fastattn.lab.paths import data_dir
from fastattn.lab.upstream import (
    FIX_KITS,
    KITS,
    REPO_FILES,
    SCRIPT_PATCHES,
    DiffError,
    apply_diff,
    diff_root,
    test_setup,
)

BENCH_KIT = next(iter(REPO_FILES))
BENCH = next(iter(REPO_FILES[BENCH_KIT]))  # the bench's path in upstream's repository


def _diff(kit: str, layout: str = "src") -> str:
    return (data_dir() / KITS[kit][1][layout]).read_text()


def _copy(tree: Path, dest: Path, kits=(), layout: str = "src") -> Path:
    """A copy of ``tree`` (without its media) with ``kits``' ``layout`` diffs applied in order."""
    shutil.copytree(tree, dest, ignore=shutil.ignore_patterns("assets", "examples", ".git"))
    for k in kits:
        apply_diff(dest / diff_root(k, layout), _diff(k, layout))
    return dest


def applies(tree: Path, kits, layout: str) -> dict:
    """``layout``'s diffs of ``kits`` applied in order to a copy of ``tree`` (a 2.0.3 diff inside ``src/``)."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "t"
        for part in ("src", "scripts", "tests"):
            shutil.copytree(tree / part, root / part)
        try:
            offsets = [apply_diff(root / diff_root(k, layout), _diff(k, layout)) for k in kits]
        except DiffError as exc:
            return {"applies": False, "error": str(exc)}
    return {"applies": True, "max_offset": max(abs(o) for hunks in offsets for _, _, o in hunks)}


def pytest_outcomes(root: Path, paths: list) -> dict:
    (root / "r.xml").unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("VOXCPM_")}
    env["PYTHONPATH"] = str(root / "src")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--junitxml=r.xml", *paths],
                       cwd=root, capture_output=True, text=True, timeout=1800, env=env)
    cases = list(ET.parse(root / "r.xml").getroot().iter("testcase")) if (root / "r.xml").exists() else []
    why = {c.get("name"): (c.find("failure") if c.find("failure") is not None else c.find("error")) for c in cases}
    bad = {n: e.get("message", "")[-160:] for n, e in why.items() if e is not None}
    skipped = sum(c.find("skipped") is not None for c in cases)
    return {"passed": len(cases) - len(bad) - skipped, "failed": len(bad), "skipped": skipped, "failed_tests": bad,
            "tail": r.stdout.strip().splitlines()[-1:] if r.stdout.strip() else r.stderr[-300:]}


def test_runs(main: Path, tag: Path) -> list:
    """Upstream's own tests, then each PR's test (its own counts): on main with the four diffs stacked, on
    unmodified main with only the PR's test added, and on main with the PR's diff alone; the bench PR's test on the
    2.0.3 tag the same way."""
    own = sorted(p.relative_to(main).as_posix() for p in (main / "tests").rglob("test_*.py"))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = _copy(main, Path(tmp) / "stacked", KITS)
        rows.append({"tree": "main", "check": "upstream's own tests/, the four diffs stacked",
                     **pytest_outcomes(root, own)})
        rows += [{"tree": "main", "check": "a PR's test, the four diffs stacked", "kit": kit, "test": test,
                  **pytest_outcomes(root, [f"tests/{test}"])} for kit, (_, _, test) in KITS.items()]
    with tempfile.TemporaryDirectory() as tmp:
        rows.append({"tree": "main", "check": "upstream's own tests/, unmodified",
                     **pytest_outcomes(_copy(main, Path(tmp) / "main"), own)})
    for (tree, path), kit in itertools.product((("main", main), ("tag-2.0.3", tag)), KITS):
        if tree == "tag-2.0.3" and kit != BENCH_KIT:
            continue  # the fix PRs' tests are upstream's repository's (main): 2.0.3 is checked by the apply rows
        test = KITS[kit][2]
        for alone in (False, True):
            with tempfile.TemporaryDirectory() as tmp:
                root = _copy(path, Path(tmp) / "t", [kit] if alone else ())
                if not alone:  # the PR's test alone, on the unmodified tree
                    apply_diff(root, test_setup(kit))
                rows.append({"tree": tree, "check": "a PR's test, " + ("its diff alone" if alone else "unmodified"),
                             "kit": kit, "test": test, **pytest_outcomes(root, [f"tests/{test}"])})
    return rows


#: the switch each fix PR's bench command sets (its text's "Check it"); right-sized has none
SWITCH = {"right-sized": {}, "cpu-dtype": {"VOXCPM_CPU_DTYPE": "float32"},
          "decode-attention": {"VOXCPM_DECODE_ATTENTION": "live"}}


def bench_runs(main: Path) -> list:
    """Each fix PR's bench command rehearsed on CPU (random tiny weights, ``--quick``) with the bench PR applied:
    main's ``src/`` against a copy with the fix PR's diff, with the PR's switch unset and set. Which waveforms match
    is the outcome; the step ratios are a 2-core CPU's at toy size, kept as evidence only."""
    rows = []
    for kit in FIX_KITS:
        with tempfile.TemporaryDirectory() as tmp:
            base = _copy(main, Path(tmp) / "main", [BENCH_KIT])
            pr = _copy(main, Path(tmp) / "pr", [BENCH_KIT, kit])
            for env in ({}, SWITCH[kit]) if SWITCH[kit] else ({},):
                out = Path(tmp) / f"bench-{len(rows)}.json"
                clean = {k: v for k, v in os.environ.items() if not k.startswith("VOXCPM_")}
                t0 = time.perf_counter()
                r = subprocess.run([sys.executable, BENCH, "--random", "tiny", "--quick", "--device", "cpu",
                                    "--variant", "main=src", "--variant", f"pr={pr / 'src'}", "--out", str(out)],
                                   cwd=base, capture_output=True, text=True, timeout=1800, env={**clean, **env})
                row = {"tree": "main", "check": "the bench on main, its diff alone", "kit": kit, "switch": env,
                       "returncode": r.returncode, "wall_s": time.perf_counter() - t0,
                       "stderr": r.stderr[-300:] if r.returncode else ""}
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
            root = _copy(main, Path(tmp) / "pr", [kit])
            clean = {k: v for k, v in os.environ.items() if not k.startswith("VOXCPM_")}
            for env, mains in (({}, False), (SWITCH[kit], False), (SWITCH[kit], True)):
                if mains:
                    shutil.copy(main / script, root / script)
                r = subprocess.run([sys.executable, script], cwd=root, capture_output=True, text=True, timeout=600,
                                   env={**clean, **env})
                rows.append({"tree": "main", "check": "upstream's check script, its diff alone", "kit": kit,
                             "script": script, "switch": env, "script_changed": not mains,
                             "returncode": r.returncode, "tail": (r.stdout.strip().splitlines() or [""])[-1]})
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
    rows += test_runs(args.main, trees["tag-2.0.3"]) + bench_runs(args.main) + script_runs(args.main)
    commits = dict(kv.split("=") for kv in args.commits.split(","))
    rec = record("upstream_check", env=env_record("cpu"), params={"commits": commits, "kits": list(KITS)}, rows=rows)
    print(save_record(rec, args.out, f"upstream-check-main-{commits['main'][:7]}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
