#!/usr/bin/env python3
"""Every generated file of the repository, written from the committed records and the code: ``make docs``.

README's findings, docs/results.md, docs/install.md's matrix, upstream-PR.md's tables,
the PR texts, the #395 comment and the #293 reply, the stored diffs and data/results/headline.png. ``--check``
writes nothing and exits 1 naming each file that would change (one test runs it, in ``make test``).
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/ beside fastattn/

from fastattn.lab.bench.records import load_run, record_texts  # noqa: E402
from fastattn.lab.bench.targets import run_targets  # noqa: E402
from fastattn.lab.paths import atomic_write_text, data_dir, repo_root  # noqa: E402
from fastattn.lab.report import report_texts  # noqa: E402
from fastattn.lab.upstream import KITS, upstream_diff  # noqa: E402
from tools import prs, readme, sources  # noqa: E402


def _with_block(text: str, block: str, begin: str, end: str) -> str:
    """``text`` with what lies between the markers ``begin`` and ``end`` replaced by ``block``."""
    return text[:text.index(begin) + len(begin)] + "\n" + block + text[text.index(end):]


def generated() -> dict:
    """``{path: text or PNG bytes}``: every generated file as the records and the code make it now."""
    root, data = Path(repo_root()), Path(data_dir())
    results, ref = data / "results", data / "results" / sources.REFERENCE
    out: dict = {}

    def block(path: Path, text: str, begin: str = readme.BEGIN, end: str = readme.END) -> None:
        out[path] = _with_block(out.get(path) or path.read_text(), text, begin, end)

    block(root / "README.md", readme.findings_table(ref))
    block(root / "docs" / "results.md", readme.reference_findings(ref, results / sources.OTHER))
    block(root / "docs" / "install.md", prs.install_matrix(), prs.MATRIX_BEGIN, prs.MATRIX_END)
    dtype_block, forms_block = readme.pr_tables(results)  # machines and forms in a maintainer's words
    for name in readme.PR_FILES:
        path = data / name
        if readme.DTYPE_BEGIN in path.read_text():
            block(path, dtype_block, readme.DTYPE_BEGIN, readme.DTYPE_END)
        if readme.FORMS_BEGIN in path.read_text():
            block(path, forms_block, readme.FORMS_BEGIN, readme.FORMS_END)
    out.update({data / prs.PRS / name: text for name, text in prs.documents().items()})
    for kit, (_, diffs, _) in KITS.items():
        out[data / diffs["wheel"]] = upstream_diff("wheel", kit)
        if kit != "cpu-dtype":  # its src diff is made against upstream's main tree (python -m fastattn diff)
            out[data / diffs["src"]] = upstream_diff("src", kit)
    for folder in sorted(p for p in results.iterdir() if (p / "summary.json").exists()):  # a committed run's reports
        summary = json.loads((folder / "summary.json").read_text())
        out.update({folder / name: text for name, text in report_texts(folder, summary).items()})
    with tempfile.TemporaryDirectory() as tmp:
        out[results / readme.HEADLINE] = readme.headline_figure(ref, Path(tmp) / "headline.png").read_bytes()
    return out


def stale(files: dict) -> list:
    """The paths in ``files`` whose content on disk differs."""
    def now(p: Path, v):
        return (p.read_bytes() if isinstance(v, bytes) else p.read_bytes().decode()) if p.exists() else None
    return [p for p, v in files.items() if now(p, v) != v]


def targets_rejudged() -> dict:
    """``{path: text}``: each committed run's ``targets`` record (JSON and CSV) judged again from its records by
    today's rules (:func:`fastattn.lab.bench.targets.run_targets`), its env and params kept. The reports read it."""
    out = {}
    for folder in sorted(p for p in (Path(data_dir()) / "results").iterdir() if (p / "summary.json").exists()):
        run = load_run(folder)
        for path, rec in run.paths.items():
            if rec["kind"] == "targets":
                text, table = record_texts(dict(rec, rows=run_targets(run)))
                out[path] = text
                if table is not None:
                    out[path.with_suffix(".csv")] = table
    return out


def _write(files: dict, check: bool) -> list:
    changed = stale(files)
    root = Path(repo_root())
    for p in changed:
        print(("would rewrite " if check else "wrote ") + str(p.relative_to(root)))
        if not check:
            p.write_bytes(files[p]) if isinstance(files[p], bytes) else atomic_write_text(p, files[p])
    return changed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 naming each file that would change")
    args = ap.parse_args(argv)
    first = _write(targets_rejudged(), args.check)  # the reports below read the targets as judged now
    if args.check and first:
        return 1
    files = generated()
    changed = _write(files, args.check)
    return 1 if args.check and changed else 0


if __name__ == "__main__":
    sys.exit(main())
