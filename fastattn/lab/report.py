"""What maintainers receive: a run's landing page, a GitHub-ready summary, and a hardware matrix across runs.

:func:`fmt` formats every number; :func:`write_report` writes a run folder's ``index.html`` and ``summary.md``."""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Optional

from . import profiling
from .bench.metrics import matrix_rows
from .bench.records import Run, load_run
from .bench.stats import fmt_ci
from .bench.targets import TARGETS_MET, met_count, met_word, run_targets
from .claims import claims_ledger
from .diagnosis import diagnosis, diagnosis_findings, fix_evidence, reply_293, stream_findings
from .machine import cpu_features
from .paths import atomic_write_text, data_dir
from .tables import fmt, html_table, md_table, md_text, pairs_table, short

CSS = ("body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}"
       "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:4px 8px;text-align:left;"
       "vertical-align:top}th{background:#f3f3f3}.ok{color:#1e7b34;font-weight:600}.bad{color:#b3261e;"
       "font-weight:600}img{max-width:240px;border:1px solid #ddd;margin:4px}code{background:#f6f6f6}")


def _fresh(run: Run, targets: list, judged: list, rows: Optional[list]) -> dict:
    """``{notebook stem: ({finding: value}, key or None)}`` that this code derives again from the run's records,
    over what the notebook printed when it ran: 05's findings (else its targets met), 01's streams and #293.
    ``targets``: the rows shown; ``judged``: :func:`run_targets` of ``run``; ``rows``: :func:`_diagnosis` of it."""
    out = {}
    try:
        found = profiling.findings(run, judged)
        out["05_profiling"] = (found, profiling.headline_key(found))
    except ValueError:  # a run without 05's records (05 not run, or stopped): its targets met, where any
        if targets:
            out["05_profiling"] = ({TARGETS_MET: met_count(targets)}, None)
    stream = run.get("stream_profile", notebook="01_root_cause")
    if stream:
        out["01_root_cause"] = ({**stream_findings(stream), **diagnosis_findings(rows)}, None)
    return out


def _findings_note(summary: dict, fresh: dict) -> str:
    """Which findings this page derives again (``fresh``: :func:`_fresh`), and whose code wrote each notebook's page."""
    commit = (summary.get("environment") or {}).get("git_commit") or "unknown"
    said = {"05_profiling": "05's findings" if fresh.get("05_profiling", ({}, None))[1] else "05's targets met",
            "01_root_cause": "01's streams and #293's readings"}
    again = ", ".join(words for stem, words in said.items() if stem in fresh)
    head = (f"{again[0].upper()}{again[1:]} are derived again from the records by this code, as the verdicts and the "
            "ledger are; the other findings are" if again else "The verdicts and the ledger are derived again from the "
            "records by this code; the findings are")
    return (f"{head} as each notebook printed them when it ran. Each notebook's own page is the notebook as it ran, "
            f"at commit {commit}: where its text differs from this page, this page is the current code's reading of "
            "the same records.")


def _environment(summary: dict, run: Run) -> dict:
    """The run's environment, with CPU features (AMX, AVX512-BF16, ...) from its records if missing."""
    env = dict(summary.get("environment") or {})
    if str(env.get("device", "cpu")).startswith("cpu") and not env.get("cpu_features"):
        flags = run.cpu_flags()
        env["cpu_features"] = cpu_features(flags) if flags else None
    keys = ("device_name", "device", "cpu_features", "torch", "voxcpm", "fastattn", "git_commit", "threads",
            "cpu_capability")
    return {k: env.get(k) for k in keys if env.get(k) is not None}


_MET_CLASS = {"yes": "ok", "no": "bad", "undecided": "", None: ""}  # not applicable here: neither


def _verdict_rows(targets: list) -> list:
    """One row per target: measured, 95% CI, n; ``met`` None where it does not apply here."""
    def measured(t):
        ci = f" {fmt_ci((t['ci_low'], t['ci_high']))}" if t.get("ci_low") is not None else ""
        return fmt(t["measured"]) + ci + (f" (n={t['n']})" if t.get("n") else "")
    return [{"claim": t["target"], "measured (95% CI)": measured(t), "goal": t["goal"],
             "met": met_word(t), "note": short(t.get("note", ""), None)} for t in targets]


def _split_findings(nb: dict, fresh: dict) -> tuple:
    """(key findings, the rest) of a notebook's entry, each as [(name, value)]; ``fresh``: :func:`_fresh` (a whole
    set with its key replaces what the notebook printed; a partial one overrides the findings it names)."""
    found, key = fresh.get(Path(nb["name"]).stem, ({}, None))
    items = found if key else {k: found.get(k, v) for k, v in (nb.get("findings") or {}).items()}
    key = [k for k in key or nb.get("key_findings", list(items)[:4]) if k in items]
    return [(k, items[k]) for k in key], [(k, v) for k, v in items.items() if k not in key]


def report_texts(run_dir, summary: dict) -> dict:
    """``{file name: text}`` of a run's ``claims_ledger.json``, ``index.html`` and ``summary.md``."""
    run_dir, run = Path(run_dir), load_run(run_dir)
    stored = run.get("targets")  # judged again from the records by this code; the stored record where none is left
    judged, rows = run_targets(run), _diagnosis(run)
    targets = judged or (stored["rows"] if stored else [])
    env, verdicts, fresh = _environment(summary, run), _verdict_rows(targets), _fresh(run, targets, judged, rows)
    full = claims_ledger(run)
    ledger = [dict(r, evidence=short(r["evidence"], None)) for r in full]  # whole: an interval is never cut
    return {"claims_ledger.json": json.dumps(full, indent=1),
            "index.html": _index_html(run_dir, summary, env, verdicts, ledger, fresh),
            "summary.md": _summary_md(run_dir, summary, env, verdicts, ledger, fresh, reply_for_293(run, rows))}


def write_report(run_dir, summary: dict) -> tuple:
    """Write :func:`report_texts` into ``run_dir``; return the paths of ``index.html`` and ``summary.md``."""
    paths = {name: atomic_write_text(Path(run_dir) / name, text)
             for name, text in report_texts(run_dir, summary).items()}
    return paths["index.html"], paths["summary.md"]


def _params_line(summary: dict) -> str:
    """The user's parameters, and the profile whose sizes each notebook ran at (each notebook's in summary.json)."""
    given = ", ".join(f"{k}={v}" for k, v in (summary.get("parameters") or {}).items())
    prof = summary.get("profile")
    return "; ".join(x for x in (given, prof and f"profile {prof} (each notebook's sizes in summary.json)") if x) \
        or "defaults"


def _index_html(run_dir: Path, summary: dict, env: dict, verdicts: list, ledger: list, fresh: dict) -> str:
    e = html.escape
    status = summary.get("status", "?")
    run = summary.get("run") or run_dir.name
    out = [f"<!doctype html><html><head><meta charset='utf-8'><title>fastattn {e(run)}</title>"
           f"<style>{CSS}</style></head><body>",
           f"<h1>fastattn workbook: {e(run)}</h1>",
           f"<p>Overall: <span class='{'ok' if status == 'ok' else 'bad'}'>{e(status)}</span>. Weights are random "
           "unless a checkpoint was given; timings are real.</p>", "<h2>Environment</h2>"
           + pairs_table([*((k, fmt(v)) for k, v in env.items()), ("parameters", _params_line(summary))],
                         lambda v, k: v, "th")]
    if verdicts:
        met = lambda r, c, s: f"<td class='{_MET_CLASS[r['met']]}'>{s}</td>" if c == "met" else f"<td>{s}</td>"  # noqa: E731
        na = lambda v: "n/a" if v is None else str(v)  # noqa: E731
        out += ["<h2>Verdicts (targets judged in this run)</h2>",
                html_table(verdicts, ["claim", "measured (95% CI)", "goal", "met", "note"], text=na, td=met)]
    if ledger:
        cls = {"holds": "ok", "does not hold": "bad"}
        verdict = lambda r, c, s: f"<td class='{cls.get(r['verdict'], '')}'>{s}</td>" if c == "verdict" else \
            f"<td>{s}</td>"  # noqa: E731
        rows = [dict(r, **{"its scale": r.get("scale", "")}) for r in ledger]
        out += ["<h2>The seeds' claims, judged on this device</h2>",
                html_table(rows, ["source", "claim", "its scale", "verdict", "evidence"], text=str, td=verdict)]
    if summary.get("plan"):
        out.append("<h2>What the time budget scaled</h2><ul>"
                   + "".join(f"<li>{e(line[2:])}</li>" for line in _plan_md(summary)) + "</ul>")
    out.append(f"<h2>Notebooks</h2><p>{e(_findings_note(summary, fresh))}</p>")
    for nb in summary.get("notebooks", []):
        link = nb.get("html") or nb.get("executed")
        cls = "ok" if nb.get("status") == "ok" else "bad"
        out.append(f"<h3><a href='{e(link)}'>{e(nb['name'])}</a> <span class='{cls}'>{e(nb.get('status', '?'))}"
                   f"</span> ({fmt(nb.get('duration_s', float('nan')))} s)</h3>")
        if nb.get("error"):
            out.append(f"<p class='bad'>{e(short(nb['error'], 300))}</p>")
        key, rest = _split_findings(nb, fresh)
        if key:
            out.append(pairs_table(key, fmt))
        if rest:
            out.append(f"<details><summary>{len(rest)} more findings</summary>{pairs_table(rest, fmt)}</details>")
        figs = sorted((run_dir / Path(nb["name"]).stem / "figures").glob("*.png"))
        out += [f"<a href='{e(link)}'><img src='{e(str(f.relative_to(run_dir)))}' alt='{e(f.stem)}'></a>"
                for f in figs[:4]]
    out.append("</body></html>")
    return "\n".join(out)


def _summary_md(run_dir: Path, summary: dict, env: dict, verdicts: list, ledger: list, fresh: dict,
                reply: Optional[str]) -> str:
    lines = [f"## fastattn workbook: `{summary.get('run') or run_dir.name}` ({summary.get('status', '?')})", "",
             "Environment: " + ", ".join(f"{k} {fmt(v)}" for k, v in env.items()), ""]
    if verdicts:
        lines += ["### Verdicts", ""] + md_table([{**v, "met": "**no**" if v["met"] == "no" else v["met"] or "n/a"}
                                                   for v in verdicts]) + [""]
    if ledger:
        lines += ["### The seeds' claims, judged on this device", ""] + md_table(ledger) + [""]
    dtype = next((c for c in ledger if c["source"] == "voxcpm" and "dtype" in c["claim"]), None)
    if dtype and dtype["verdict"] in ("holds", "does not hold"):
        lines += ["### Which dtype to run on this machine", "", dtype["evidence"], ""]
    if reply:
        lines += ["### A reply for OpenBMB/VoxCPM #293 (from this run's 01)", "", reply, ""]
    if summary.get("plan"):
        lines += ["### What the time budget scaled", ""] + _plan_md(summary) + [""]
    lines += ["### Notebooks", "", _findings_note(summary, fresh), ""]
    for nb in summary.get("notebooks", []):
        link = nb.get("html") or nb.get("executed")
        lines.append(f"* [{nb['name']}]({link}): {nb.get('status')} in {fmt(nb.get('duration_s', float('nan')))} s")
        if nb.get("error"):
            lines.append(f"  * error: {short(nb['error'], 300)}")
        key, rest = _split_findings(nb, fresh)
        lines += [f"  * {md_text(k)}: {fmt(v, k)}" for k, v in key]
        if rest:
            lines += ["", f"  <details><summary>{len(rest)} more findings</summary>", ""]
            lines += [f"  * {md_text(k)}: {fmt(v, k)}" for k, v in rest] + ["", "  </details>", ""]
    return "\n".join(lines) + "\n"


def _diagnosis(run: Run) -> Optional[list]:
    """#293's diagnosis rows from a run's 01 records; None without a stream."""
    kind = lambda k: run.get(k, notebook="01_root_cause")  # noqa: E731
    stream = kind("stream_profile")
    return None if stream is None else diagnosis(stream, kind("consumer_matrix"), stream.get("env", {}).get(
        "device", "cpu"), kind("prompt_growth"), kind("consumer_contention"))


def reply_for_293(run_dir, rows: Optional[list] = None) -> Optional[str]:
    """The #293 reply from a run's 01 records (a folder, or a :class:`Run` already loaded) and the committed torch
    matrix; None without a stream. ``rows``: :func:`_diagnosis` of that run where the caller holds it."""
    run = run_dir if isinstance(run_dir, Run) else load_run(run_dir)
    rows = _diagnosis(run) if rows is None else rows
    if rows is None:
        return None
    stream = run.get("stream_profile", notebook="01_root_cause")
    return reply_293(rows, stream, fix_evidence(matrix_rows(data_dir() / "results" / "torch-matrix")),
                     machine=run.machine(stream.get("env")), consumers=run.get("consumer_matrix", notebook=NB01),
                     contention=run.get("consumer_contention", notebook=NB01))


NB01 = "01_root_cause"  # the notebook whose records the #293 reply reads


def _plan_md(summary: dict) -> list:
    """The runner's plan: what it scaled and why, and each notebook's estimate beside its duration."""
    plan = summary["plan"]
    out = [f"* {s['param']} {s['default']} -> {s['value']}: {s['why']}" for s in plan.get("scaled", [])] or \
        [f"* nothing: every measurement ran at its default within {fmt(plan['budget_s'])} s"]
    for nb in summary.get("notebooks", []):
        est = nb.get("planned_s", plan.get("estimate_s", {}).get(Path(nb["name"]).stem))
        out.append(f"* {Path(nb['name']).stem}: planned about {fmt(est)} s, took {fmt(nb.get('duration_s'))} s")
    return out
