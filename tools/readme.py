"""README's findings table, headline figure and ``docs/results.md``, written from the committed reference run
(never typed by hand). ``python -m tools.readme`` prints README's block; ``--write`` rewrites the blocks between
their markers in README.md, docs/results.md and the PR files, and ``data/results/headline.png``. Tests fail when
any of them and the records disagree. Records are found by kind and params (:func:`fastattn.lab.bench.load_run`), so a
workbook run folder and a flat record folder read alike."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from fastattn.lab.bench.metrics import (
    HEADLINES,
    attention_free_ratio,
    attention_share,
    call_ratio,
    compile_line,
    dtype_ratio_text,
    dtype_recommendation,
    dtype_table,
    headlines,
    kv_mb,
    matrix_rows,
    others_line,
    split_line,
    time_shares,
    vae_line,
    whole_ratio,
)
from fastattn.lab.bench.programs import wrapped_sentence
from fastattn.lab.bench.records import find_row, load_run
from fastattn.lab.bench.stream import stream_verdicts
from fastattn.lab.bench.targets import met_count
from fastattn.lab.claims import claims_ledger, math_fallback_reason
from fastattn.lab.machine import cpu_features, runtime_dtype
from fastattn.lab.paths import data_dir, repo_root
from fastattn.static import FORMS
from tools.ingest import bench_table
from tools.sources import OTHER, REFERENCE, form_words, machine_name, machines_with, records

BEGIN, END = "<!-- findings:begin -->", "<!-- findings:end -->"
DTYPE_BEGIN, DTYPE_END = "<!-- dtype:begin -->", "<!-- dtype:end -->"
FORMS_BEGIN, FORMS_END = "<!-- forms:begin -->", "<!-- forms:end -->"
HEADLINE = "headline.png"
MATRIX_CASE = "upstream: bool mask over full cache + GQA"


def _kernel(r: dict) -> tuple:
    """(dtype voxcpm runs, upstream's masked call's row, the no-GQA row) of the backend matrix."""
    dt = runtime_dtype(r["targets"]["env"].get("device", "cpu"))
    rows = r["matrix"]["rows"]
    return dt, find_row(rows, case=MATRIX_CASE, dtype=dt, head_dim=128), \
        find_row(rows, case="bool mask, no enable_gqa (K/V repeated)", dtype=dt, head_dim=128)


def _symptom(r: dict) -> str:
    row = next(x for x in claims_ledger(r["run"].folder) if x["claim"].endswith("(#293)"))
    s = r["stream"]
    return (f"{stream_verdicts(s)['upstream']} over {s['params']['chunks']} chunks ({s['params']['preset']} model, "
            f"{s['params']['dtype']}): the claim "
            + ("was not measured at its scale" if row["verdict"] == "not measured at its scale" else row["verdict"])
            + f" here (its scale: {row['scale']})")


def _exact(r: dict) -> str:
    chosen = sorted({x["chosen"] for x in r["ladder"]["rows"]}, key=str)
    if any(c is not None for c in chosen):
        held = [m["torch"] for m in matrix_rows(r["run"].folder.parent / "torch-matrix")
                if m["kernel"].endswith("FLASH_ATTENTION") and m["diff"]]  # committed records only: a run has none
        also = f"; the contract also held on torch {held[0]} to {held[-1]} (docs/install.md)" if held else ""
        return (f"yes on this CPU and torch, by construction: windows of {', '.join(map(str, chosen))} keys (the CPU "
                f"flash kernel's block){also}")
    return "yes: no window is exact here, so it keeps upstream's call"


def _whole(r: dict) -> str:
    w = r["whole"]
    return (f"{w['median_wall_s']['upstream']:.1f} s -> {w['median_wall_s']['patched']:.1f} s, "
            f"{whole_ratio(w).text()}, {'bit-identical' if w['identical'] else 'NOT identical'}")


def _dtype(r: dict) -> Optional[str]:
    dd = r["dtypes"]
    if not dd:
        return None
    rec = dtype_recommendation(dd, dd.get("flags"))
    return (f"{rec['dtype']}{' with the fix' if rec['patched'] else ''}: {rec['ratio_text']} of voxcpm's default "
            f"step; {others_line(rec)}")


def findings_table(ref: Path) -> str:
    """README's findings: one row per question, its measured answer on the reference machine (records only)."""
    r = records(ref)
    run, t, kv = r["run"], r["targets"], r["kv"]
    dt, masked, _ = _kernel(r)
    rows = [("Does upstream's per-chunk cost grow along a stream (#293)?", _symptom(r)),
            (f"Which kernel runs upstream's masked {dt} decode call?",
             f"`{masked['kernel']}`, over all {masked['keys']} slots"),
            ("Is the default fix bit-identical to upstream?", _exact(r)),
            ("One attention call at position 256, fp32: `exact` / upstream",
             HEADLINES["exact / reference, one call, p=256, fp32"](run).text()),
            ("A real-width decode step at position 256, bf16: patched / upstream",
             HEADLINES["patched / upstream, decode step, p=256, bf16"](run).text()),
            (f"The whole {r['whole']['params']['preset']} model, {r['whole']['params']['dtype']}, "
             f"{r['whole']['params']['steps']} steps: patched / upstream", _whole(r)),
            (f"KV of a {kv['params']['prefill'] + kv['params']['steps']}-token request",
             "{:.0f} MB -> {:.0f} MB".format(*kv_mb(kv)) + _kv_where(kv))]
    if _dtype(r):
        rows.append(("Which dtype should this CPU run?", _dtype(r)))
    if r["forms"]:
        rows.append(("Compiled (fullgraph, inductor), bf16: the fastest decode form at VoxCPM2's geometry",
                     forms_answer(r["forms"])))
    if _split(ref):
        rows.append(("How close is a decode step to this machine's limit, and where does it go?", _split(ref)))
    rows.append(("Targets met", f"{met_count(t['rows'])} (docs/results.md gives each target's goal, verdict and "
                 "note)"))
    head = [f"Measured on a {machine_name(t['env'], ref)}: the committed reference run "
            f"`data/results/{Path(ref).name}/`. "
            "Every figure, its interval and n: [docs/results.md](docs/results.md).", "",
            "| question | measured |", "|---|---|"]
    return "\n".join(head + [f"| {q} | {a} |" for q, a in rows]) + "\n"


def _kv_where(kv: dict) -> str:
    """Where that KV saving holds: on the device measured, with its window; CUDA keeps every slot."""
    if not kv.get("right_sized"):
        return f" (no exact window on {kv['env'].get('device', '?')}: every slot kept)"
    return (f" on {kv['env'].get('device', '?')}, {kv['params']['bucket']}-slot windows; on CUDA the cache keeps all "
            f"{kv['params']['max_length']} slots")


def _floor(r: dict) -> str:
    cold, fa = r["cold"], find_row(r["cold"]["rows"], mode="fast", position=4096)
    gm = find_row(cold["rows"], mode="gemm_floor", position=4096)
    return (f"fast {fa['x_floor']:.1f}x the DRAM floor (live K+V once at {cold['bandwidth']['gb_per_s']:.0f} GB/s, "
            f"K/V rotated over {cold['params']['caches']} caches); its two bare GEMMs alone {gm['x_floor']:.1f}x: "
            f"fast is {call_ratio(cold, 'fast', 'gemm_floor', 4096).value:.2f}x the best torch's BLAS does with those "
            "bytes")


def _costs(r: dict) -> str:
    c = r["costs"]
    conv = find_row(c["rows"], op="bf16 -> fp32 conversion of K")["median_ms"]
    return (f"bf16 / fp32: {c['ratios']['SDPA over the slice']:.1f}x in SDPA over the slice, "
            f"{c['ratios']['masked SDPA over the capacity (upstream)']:.1f}x in upstream's masked call, "
            f"{c['ratios']['bare GEMM q @ k^T']:.1f}x in a bare GEMM; converting the live K to fp32: {conv:.2f} ms")


def _memory(r: dict) -> str:
    kv, rs, g = r["kv"], r["rss"]["summary"], r["growth"]
    return ("KV {:.0f} MB -> {:.0f} MB (read from the caches); ".format(*kv_mb(kv))
            + f"peak RSS of a short {r['rss']['params']['preset']}-preset request, {rs['runs']} fresh processes each: "
            f"patched {rs['peak_difference_bytes'] / 1e6:+.0f} MB (spread {rs['peak_spread_bytes'] / 1e6:.0f} MB); a "
            f"{g['params']['prefill']} + {g['params']['steps']}-step request moves its cache {g['summary']['moves']} "
            f"times: {g['summary']['step_total_s']:.2f} s in `step()` over the request, its longest step "
            f"{g['summary']['max_step_ms']:.0f} ms, against upstream's zero-fill of {g['params']['max_length']} slots "
            f"once per request ({g['summary']['upstream_fill_ms']:.1f} ms in this one unrepeated pass)")


def _amdahl(r: dict) -> str:
    share, free = time_shares(r["whole"]), attention_free_ratio(r["whole"])
    return (f"upstream's LM decode attention {share['lm_attention']:.0%} of its wall time, the local DiT "
            f"{share['local_dit']:.0%}: were that attention free, the ratio would be about {free:.2f}, an estimate, "
            f"not a bound (patched / upstream measured {whole_ratio(r['whole']).value:.3g})")


def _compiled(r: dict) -> Optional[str]:
    c = r["comp"]
    return None if not c else (f"`torch.compile` ({c['params']['backend']}, {c['params']['preset']} preset, positions "
                               f"{c['params']['positions'][0]}-{c['params']['positions'][-1]}): "
                               f"{c['graphs']['unique_graphs']} graphs, {c['graphs']['graph_breaks']} graph breaks")


def reference_findings(ref: Path, other: Optional[Path] = None) -> str:
    """docs/results.md's block: every finding of the reference run in one table (figure, interval, n), the
    claims ledger, and the machines side by side (``other``: a second machine's records)."""
    from fastattn.lab.tables import md_table
    from tools.compare import compare, compare_markdown
    r = records(ref)
    run, t = r["run"], {x["id"]: x for x in r["targets"]["rows"]}
    dt, masked, no_gqa = _kernel(r)
    gpu = str(r["targets"]["env"].get("device", "cpu")).startswith("cuda")
    rows = [("#293's decay, here", _symptom(r)),
            (f"kernel of upstream's masked {dt} call", f"`{masked['kernel']}` (dispatcher {masked['backend']}) on "
             f"this {'GPU' if gpu else 'CPU'}: " + math_fallback_reason(masked, no_gqa)[1]),
            ("`exact` bit-identical to upstream", _exact(r) if not _exact(r).startswith("yes:") else
             "No key window is exact by construction on this device's kernels: `exact` attends over all "
             f"{masked['keys']} slots, upstream's computation minus its per-request zero-fill")]
    rows += [(k, f.text()) for k, f in headlines(run).items()]
    rows += [(f"target: {x['target']}", f"{x.get('verdict') or 'n/a'} ({x['goal']}); {x['note']}".rstrip("; "))
             for x in t.values()]
    rows += [(k, v) for k, v in (("fast against the floor, p=4096, fp32", r["cold"] and _floor(r)),
                                 ("bf16 against fp32", r["costs"] and _costs(r)),
                                 ("memory", r["rss"] and r["growth"] and _memory(r)),
                                 ("where a whole decode's time goes", r["whole"] and _amdahl(r)),
                                 ("the compiled step", _compiled(r))) if v]
    lines = [f"Measured on a {machine_name(r['targets']['env'], ref)}: `data/results/{Path(ref).name}/` at commit "
             f"{r['targets']['env'].get('git_commit', '?')[:7]}.", "", "| finding | measured |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in rows]
    ledger = [{k: x[k] for k in ("source", "claim", "scale", "verdict", "evidence")} for x in claims_ledger(ref)]
    lines += ["", "The seeds' claims, judged on this machine:", ""] + md_table(ledger)
    if other:
        lines += ["", f"The machines side by side (`python -m tools.compare data/results/{Path(ref).name} "
                      f"data/results/{Path(other).name}`):", "", compare_markdown(compare([ref, other])).rstrip("\n")]
    lines += ["", "Why the bf16 step ratio differs between machines: the attention's share of upstream's step, from "
              "each machine's decode-step record.", "", attention_shares(ref.parent).rstrip("\n")]
    readings = machine_readings(ref.parent)
    if readings:
        lines += ["", "Measured on the machines that hold these records (a decode step against the machine, "
                      "compiling the whole decode on CPU, the exact fix for the step's biggest lever, the fix in "
                      "programs this project did not write):", "",
                  readings]
    lines += ["", "Runs of `scripts/voxcpm_decode_bench.py` on other machines (`python -m tools.ingest FILE`):", "",
              bench_table()]
    return "\n".join(lines) + "\n"


#: record kind -> (what it answers, the one function that reads it): readings a machine folder may hold beside (or
#: without) a whole reference run
MACHINE_READINGS = {"step_split": ("a decode step against the machine", split_line),
                    "compiled_decode": ("the whole decode compiled on this CPU (`fastattn.optimize`, inductor)",
                                        compile_line),
                    "vae_stream": ("the AudioVAE, the step's biggest lever here: the patch's exact fix for part of it",
                                   vae_line),
                    "wrapped_programs": ("upstream's CLI and a streaming service under `python -m fastattn run`",
                                         wrapped_sentence)}


def machine_readings(results: Path) -> str:
    """Each machine folder's record of each :data:`MACHINE_READINGS` kind, read by its one function."""
    from fastattn.lab.tables import md_table
    rows = [{"machine": machine_name(rec["env"], folder), "question": what, "measured": read(rec)}
            for kind, (what, read) in MACHINE_READINGS.items() for folder, rec in machines_with(results, kind)]
    return "\n".join(md_table(rows)) if rows else ""


def _split(ref: Path) -> Optional[str]:
    """README's step-against-the-machine answer: the reference run's record, else the newest machine folder's."""
    own = records(ref)["run"].get("step_split")
    found = [(ref, own)] if own else machines_with(ref.parent, "step_split")
    if not found:
        return None
    folder, rec = found[-1]
    fix = [v for f, v in machines_with(ref.parent, "vae_stream") if f == folder] if rec["lever"]["component"] == \
        "audio_vae" else []
    return split_line(rec) + (f"; {vae_line(fix[-1])}" if fix else "") + (
        "" if folder == ref else f" (on {machine_name(rec['env'], folder)}: not the reference run's machine)")


def attention_shares(results: Path, position: int = 256) -> str:
    """Per machine folder with a bf16 decode-step record that timed the attention in the step: its CPU features,
    upstream's attention call and layer, the share, the patched / upstream step (:func:`attention_share`)."""
    out = ["| machine | upstream's bf16 attention call / layer (ms) | attention's share | patched / upstream step |",
           "|---|---|---|---|"]
    for folder, rec in machines_with(results, "decode_step", dtype="bfloat16"):
        a = attention_share(rec, position)
        if a:
            out.append(f"| {machine_name(rec['env'], folder)} | {a['attention_ms']:.3g} / {a['layer_ms']:.3g} | "
                       f"{a['share']:.0%} | {a['ratio']:.2f}x |")
    return "\n".join(out) + "\n"


def _code(form: str) -> str:
    return f"`{form}`"


def forms_answer(rec: dict, verdict: dict | None = None, name=_code) -> str:
    """One line from a ``decode_forms`` record (and its :func:`~fastattn.lab.bench.forms.form_verdict`,
    computed here where not given): the winner, the runner-up's time over it, decided or not. ``name(form)``
    writes a form's name."""
    from fastattn.lab.bench.forms import form_verdict
    v = verdict or form_verdict(rec)
    if v["runner_up"] is None:
        return f"{name(v['winner'])} (the only eligible form)" if v["winner"] else "no eligible form"
    lo = min(x["ratio"] for x in v["per_position"].values())
    hi = max(x["ratio"] for x in v["per_position"].values())
    ps = rec["params"]["positions"]
    where = ("decided at every position" if v["decided"] else
             f"decided at {', '.join(map(str, v['decided_at'])) or 'no position'}"
             + "".join(f"; {name(f)} faster at {p}" for p, f in v["other_winners"].items()))
    caveat = f"; {FORMS[v['winner']].graphs}" if FORMS[v["winner"]].scalar_outputs else ""
    return (f"{name(v['winner'])}; {name(v['runner_up'])} takes {v['margin']:.2f}x its time (geometric mean; "
            f"{lo:.2f}x-{hi:.2f}x over positions {ps[0]}-{ps[-1]}), {where}{caveat}")


def _folder_label(folder: Path, env: dict) -> str:
    """A committed machine folder by its name and the machine its records name, CPU features included."""
    return f"`{folder.name}`: {load_run(folder).machine(env)}"


def forms_machines(results: Path, label=_folder_label, name=_code, noun: str = "form") -> str:
    """The table of the compiled decode forms: per machine folder and dtype, the verdict; a line saying none
    exists otherwise. ``label(folder, env)`` names the machine, ``name(form)`` a form, ``noun`` the header's word."""
    found = [x for dt in ("bfloat16", "float32") for x in machines_with(results, "decode_forms", dtype=dt)]
    if not found:
        return "No machine has a `decode_forms` record yet.\n"
    from fastattn.lab.bench.forms import form_verdict
    out = [f"| machine | dtype | fastest compiled {noun}, margin | its max error vs float64 (upstream's) |",
           "|---|---|---|---|"]
    for folder, rec in sorted(found, key=lambda x: (x[0].name, x[1]["params"]["dtype"])):
        verdict = form_verdict(rec)
        won = next((c for c in rec["checks"] if c["form"] == verdict["winner"]), None)
        err = f"{won['max_err']:.3g} ({won['reference_err']:.3g})" if won else "n/a"
        out.append(f"| {label(folder, rec['env'])} | {rec['params']['dtype']} | "
                   f"{forms_answer(rec, verdict, name)} | {err} |")
    return "\n".join(out) + "\n"


def dtype_machines(results: Path, label=_folder_label) -> str:
    """Per machine folder with a whole-decode dtype comparison: its CPU, its bf16 features, each dtype's median step
    against voxcpm's default and the weights' memory. ``label(folder, env)`` names the machine."""
    out = ["| machine | bf16 instructions | decode step, voxcpm's default | float32 / default (95% CI) | "
           "float32 + right-sized cache / default (95% CI) | weights GB |", "|---|---|---|---|---|---|"]
    for folder, rec in machines_with(results, "dtype_decode"):
        rows = {(x["dtype"], x["variant"]): x for x in dtype_table(rec)}
        base = rows[(rec["params"]["dtypes"][0], "upstream")]
        out.append(f"| {label(folder, rec['env'])} | "
                   f"{cpu_features(rec.get('flags') or {}, rec['env'].get('cpu_capability', 'n/a'))} | "
                   f"{base['dtype']} {base['step s']:.2f} s | {dtype_ratio_text(rows[('float32', 'upstream')])} | "
                   f"{dtype_ratio_text(rows[('float32', 'patched')])} | "
                   + ", ".join(f"{d} {x['weights GB']:.1f}" for (d, v), x in rows.items() if v == "upstream") + " |")
    return "\n".join(out) + "\n"


def headline_figure(ref: Path, path: Path) -> Path:
    """README's figure: a real-width decode step's cost against position in bf16, upstream and the fix (the
    reference run's bf16 decode-step sweep), drawn by :func:`fastattn.lab.plots.decode_step`."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fastattn.lab.plots import decode_step
    fig = decode_step(load_run(ref).get("decode_step", dtype="bfloat16"))
    fig.savefig(path, dpi=90, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)
    return path


def _readme() -> Path:
    return Path(repo_root()) / "README.md"


def _results_md() -> Path:
    return Path(repo_root()) / "docs" / "results.md"


def current_block(path: Optional[Path] = None, begin: str = BEGIN, end: str = END) -> str:
    text = (path or _readme()).read_text()
    return text[text.index(begin) + len(begin):text.index(end)].strip("\n") + "\n"


def replace_block(path: Path, block: str, begin: str = BEGIN, end: str = END) -> None:
    text = path.read_text()
    head, tail = text[:text.index(begin) + len(begin)], text[text.index(end):]
    path.write_text(head + "\n" + block + tail)


#: the files whose dtype and forms blocks are written from every machine's records
PR_FILES = ("upstream-PR.md",)


def pr_tables(results: Path) -> tuple:
    """(dtype block, forms block) of :data:`PR_FILES` in a maintainer's words: each machine by what it is, not its
    results folder, and each form by what it does (:data:`tools.sources.FORM_WORDS`), not its key."""
    label = lambda folder, env: machine_name(env, folder)  # noqa: E731 - the machine, not the folder name
    return dtype_machines(results, label), forms_machines(results, label, form_words)


def main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="python -m tools.readme", description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help="replace the blocks in README.md, docs and the PR files")
    args = ap.parse_args(argv)
    results = Path(data_dir()) / "results"
    block = findings_table(results / REFERENCE)
    if not args.write:
        print(block, end="")
        return 0
    replace_block(_readme(), block)
    replace_block(_results_md(), reference_findings(results / REFERENCE, results / OTHER))
    headline_figure(results / REFERENCE, results / HEADLINE)
    dtype_block, forms_block = pr_tables(results)
    for name in PR_FILES:
        path = Path(data_dir()) / name
        if DTYPE_BEGIN in path.read_text():
            replace_block(path, dtype_block, DTYPE_BEGIN, DTYPE_END)
        if FORMS_BEGIN in path.read_text():
            replace_block(path, forms_block, FORMS_BEGIN, FORMS_END)
    return 0
