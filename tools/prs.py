"""The three upstream PRs, the comment for PR #395 and the reply to #293, written from committed records.

The texts are templates (``data/upstream-prs/templates/*.md``) filled with :func:`fields`; the reply is
:func:`fastattn.lab.diagnosis.reply_293`'s. ``python -m tools.prs`` prints them; ``--write`` writes
``data/upstream-prs/*.md``, which a test checks are current. Each figure comes from one function reading
``data/results/``: :func:`machine_rows` (the right-sized decode per machine), :func:`matrix_rows` (the exactness
contract per torch), :func:`upstream_check` (the diffs on upstream's trees, upstream's own tests),
:func:`slice_evidence` (the slice fix under ``fullgraph``); the dtype and forms tables are
:mod:`tools.readme`'s.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

from fastattn.lab.bench.metrics import kv_mb, matrix_rows, newest, slice_backend, slice_evidence, whole_ratio
from fastattn.lab.bench.records import load_record
from fastattn.lab.bench.stats import YES, pct, verdict
from fastattn.lab.bench.stream import stream_trends
from fastattn.lab.paths import data_dir
from fastattn.lab.report import reply_for_293
from fastattn.lab.upstream import KITS
from tools.ingest import bench_table
from tools.sources import REFERENCE, form_words, machine_name, machines_with, records

__all__ = ["machine_rows", "matrix_rows", "upstream_check", "slice_evidence", "math_versions", "fields",
           "documents", "main", "REPO"]

REPO = "<link to this repository>"  # set where the PRs are posted: the records, kits and method live there
PRS = "upstream-prs"


def _results() -> Path:
    return Path(data_dir()) / "results"


def _matrix() -> list:
    return matrix_rows(_results() / "torch-matrix")


def _slice() -> tuple:
    return slice_evidence(_results() / "torch-matrix")


#: targets.json rows written before targets had ids, by their target text (up to the colon)
_OLD_IDS = {"decode step p=256 (bfloat16, hidden 2048)": "decode_bf16", "decode step p=256 (float32, hidden 2048)":
            "decode_fp32", "whole decode (full, bfloat16, 12 steps)": "whole"}


#: the window the right-sized diff hands out on CPU: a machine folder measured with another (an earlier 256-slot
#: design) does not measure the diff and is left out of its table
DIFF_BUCKET = 512


def _machines() -> list:
    """Every machine folder under data/results with a whole decode of this diff's design, by
    :func:`tools.sources.records`."""
    folders = [f for f in sorted(_results().iterdir()) if f.is_dir()]
    return [(f, r) for f, r in ((f, records(f)) for f in folders) if r["whole"] and r["targets"]
            and r["kv"] and r["kv"]["params"].get("bucket") == DIFF_BUCKET]


def machine_rows() -> list:
    """Per machine folder with a whole decode: KV MB of a 300-token request (upstream, patched), the decode step at
    p=256 (bf16, fp32) and the whole decode as targets.json judged them, and whether the outputs were identical."""
    rows = []
    for folder, r in _machines():
        t = {x.get("id") or _OLD_IDS.get(x["target"].split(":")[0]): x for x in r["targets"]["rows"]}
        whole, kv = r["whole"], r["kv"]
        rows.append({"machine": machine_name(whole["env"], folder), "kv_mb": kv_mb(kv),
                     "step_bf16": t["decode_bf16"], "step_fp32": t["decode_fp32"], "whole": whole_ratio(whole),
                     "whole_runs": _paired(whole),
                     "identical": whole["identical"], "steps": whole["params"]["steps"],
                     "reference": folder.name == REFERENCE})
    return rows


#: below this many runs a bootstrap interval says little: the PR gives the runs' own ratios instead
MIN_CI_RUNS = 10


def _paired(whole: dict) -> list:
    """A ``whole_decode`` record's patched / upstream wall time, repeat by repeat."""
    up, pa = ({r["repeat"]: r["wall_s"] for r in whole["rows"] if r["variant"] == v} for v in ("upstream", "patched"))
    return [pa[k] / up[k] for k in sorted(up) if k in pa]


def _whole_cell(r: dict) -> str:
    if r["whole"].n >= MIN_CI_RUNS or not r["whole_runs"]:
        return _ratio(r["whole"])
    return f"{r['whole'].value:.2f}x (runs: {', '.join(f'{x:.2f}x' for x in r['whole_runs'])})"


def _ratio(t) -> str:
    """A target row or a :class:`fastattn.lab.bench.metrics.Figure` as the PR quotes it."""
    value, ci, n = (t.value, t.ci, t.n) if hasattr(t, "value") else (
        t["measured"], (t["ci_low"], t["ci_high"]) if t.get("ci_low") is not None else None, t.get("n"))
    return f"{value:.2f}x" + (f" [{ci[0]:.2f}, {ci[1]:.2f}], n={n}" if ci else " (no interval recorded)")


def _window_runs() -> dict:
    """Per torch whose CPU runs this call through the math kernel: every decode with 512-slot windows over all the
    matrix records (forced, or the diff's own before the version gate)."""
    runs = {}
    for p in sorted((_results() / "torch-matrix").glob("exactness-*.json")):
        rec = load_record(p)
        if any(r.get("kernel", "").endswith("MATH") for r in rec["rows"]):
            runs.setdefault(rec["env"]["torch"].split("+")[0], []).extend(
                r for r in rec["rows"] if r["check"] == "decode, 512-slot windows forced"
                or (r["check"] == "decode through the diff" and r.get("capacity") not in (None, 8192)))
    return runs


def _forced_cell(version: str, newest: Optional[bool]) -> str:
    """The newest record's verdict, unless an earlier run of that torch differed: then how many of all did."""
    runs = _window_runs().get(version, [])
    bad = sum(not r.get("identical") for r in runs)
    if newest is None or not bad:
        return {True: "yes", False: "**no**", None: "not run"}[newest]
    return f"**{bad} of {len(runs)} runs differed**"


def matrix_table() -> str:
    yes = {True: "yes", False: "**no**", None: "not run"}
    lines = ["| torch | Python | SDPA kernel (CPU) | cache slots after the decode | decode through the diff = "
             "upstream (fp32 and bf16) | the same with 512-slot windows forced | the new tests, three PRs applied |",
             "|---|---|---|---|---|---|---|"]  # the contract, per torch
    lines += [f"| {r['torch']} | {r['python']} | {r['kernel']} | {r['slots']} | {yes[r['diff']]} | "
              f"{_forced_cell(r['torch'], r['forced'])} | {r['kits'][0]} passed, {r['kits'][1]} failed |"
              for r in _matrix()]
    return "\n".join(lines)


def math_versions() -> str:
    """What every matrix record says about the torch versions whose CPU runs this call through the math kernel:
    how often a decode with 512-slot windows (forced, or the diff's own before the version gate) matched upstream."""
    runs = _window_runs()
    if not runs:
        return ""
    bad = [(v, r) for v, rows in runs.items() for r in rows if not r.get("identical")]
    n = sum(len(rows) for rows in runs.values())
    out = (f"On torch {', '.join(runs)} SDPA runs this grouped-query call on CPU through its math kernel, where the "
           f"512-key argument does not hold: decodes with 512-slot windows matched upstream in {n - len(bad)} of {n} "
           "runs")
    out += "".join(f" (torch {v} {r['dtype']} differed once, max abs diff {r['max_abs_diff']:.2g})" for v, r in bad)
    return out + ". There is no guarantee, so before torch 2.9 the cache keeps `max_length` slots."


def upstream_check() -> dict:
    """The newest ``upstream_check`` record: the commits, whether every diff applied alone and stacked per tree,
    upstream's own tests on main, patched and not, and each PR's test file (``pr_tests[(test, how)]``, how: True
    stacked, False unmodified main, "alone" its own diff alone)."""
    rec = newest(_results() / "upstream", "upstream-check-*.json")[-1]
    rows = rec["rows"]
    trees = {r["tree"]: all(x["applies"] for x in rows if x["tree"] == r["tree"] and "applies" in x)
             for r in rows if "applies" in r}
    tests = {r["check"]: r for r in rows if "passed" in r and "kit" not in r}
    pr_tests = {(r["test"], {"stacked": True, "main": False, "alone": "alone"}[r["check"].split()[-1]]): r
                for r in rows if "test" in r}
    by_kit = lambda check: {k: [r for r in rows if r["check"].startswith(check) and r["kit"] == k]  # noqa: E731
                            for k in {r["kit"] for r in rows if r["check"].startswith(check)}}
    return {"commits": rec["params"]["commits"], "applies": trees, "tests": tests, "pr_tests": pr_tests,
            "bench": by_kit("the bench"), "scripts": by_kit("upstream's check script")}


def _script_line(kit: str) -> str:
    """The PR's change to an upstream check script and how that script ran on main with the diff alone."""
    u = upstream_check()
    runs = u.get("scripts", {}).get(kit)
    if not runs:
        return "Upstream's check scripts were not run here."
    ran = lambda r: f"{r['tail'] or 'no output'} (exit status {r['returncode']})"  # noqa: E731
    said = "; ".join(f"{_switch(r)}: {ran(r)}" for r in runs if r.get("script_changed", True))
    before = next((r for r in runs if r.get("script_changed") is False), None)
    return (f"`{runs[0]['script']}`: the CPU line of its \"non-mps is a no-op\" section now clears "
            "`VOXCPM_CPU_DTYPE` first, and a section checks the CPU override. Run on main "
            f"{u['commits']['main'][:7]} with this diff: {said}"
            + (f"; with the script left as it is on main and {_switch(before)[5:]} set: {ran(before)}" if before
               else "") + ".")


def _bench_rehearsal(kit: str) -> str:
    """The PR's bench command as run here on main with its diff alone: whether the waveforms matched, per switch."""
    u = upstream_check()
    runs = u["bench"].get(kit)
    if not runs:
        return "Not yet rehearsed on main here."
    said = []
    for r in runs:
        if r["returncode"]:
            said.append(f"{_switch(r)} the bench failed (exit status {r['returncode']})")
            continue
        step, ci = r.get("step_ratio", {}).get("256"), r.get("step_ratio_ci", {}).get("256")
        at = f" (its step {step:.2f}x" + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "") + \
            " main's at position 256, at this toy size)" if step else ""
        dtype = f", the PR running {r['dtypes'][1]}{at}" if r["dtypes"][0] != r["dtypes"][1] else ""
        same = "identical (`yes`)" if r["equal"] else "different (`no`)"
        said.append(f"{_switch(r)} the waveforms were {same}{dtype}")
    return (f"Rehearsed here on CPU with random weights (`--random tiny --quick`), main {u['commits']['main'][:7]} "
            f"against main with this diff alone: {'; '.join(said)}.")


def _switch(r: dict) -> str:
    return "with " + ", ".join(f"`{k}={v}`" for k, v in r["switch"].items()) if r["switch"] else "by default"


def _tests_line(kit_test: str) -> list:
    """How the PR's tests were run: its own test file, and upstream's own suite on main with the three diffs."""
    u = upstream_check()
    own = u["tests"]["upstream's own tests/, the three diffs stacked"]
    orig = u["tests"]["upstream's own tests/, unmodified"]
    same = "the same failures" if own["failed_tests"].keys() == orig["failed_tests"].keys() else "other failures"
    fails = ", ".join(f"`{n}`" for n in own["failed_tests"]) or "none"
    missing = r"import (\w+)\W{1,4}n?\s*ModuleNotFoundError"  # a failure that is the test machine's, not the change's
    why = {m[1] for msg in own["failed_tests"].values() for m in re.finditer(missing, msg)}
    mine, bare = u["pr_tests"][(kit_test, True)], u["pr_tests"][(kit_test, False)]
    alone = u["pr_tests"].get((kit_test, "alone"))
    counts = lambda r: (f"{r['passed']} passed, {r['failed']} failed"  # noqa: E731
                        + (f", {r['skipped']} skipped (CUDA only)" if r["skipped"] else ""))
    return [f"- `tests/{kit_test}` (new, in this diff), on main {u['commits']['main'][:7]}: "
            + (f"{counts(alone)} with this PR alone, " if alone else "")
            + f"{counts(mine)} with the three PRs applied; on unmodified main "
            + ("the file fails at collection (it reads what the diff adds)."
               if "collection failure" in bare["failed_tests"].values() else f"{bare['failed']} of them fail."),
            f"- Upstream's own `tests/` on main {u['commits']['main'][:7]} with the three PRs applied: {own['passed']} "
            f"passed, {own['failed']} failed ({fails}); unmodified main gives {same}"
            + (f" (the test machine lacks {', '.join(sorted(why))})." if why else ".")]


def _applies() -> str:
    u = upstream_check()
    names = {"main": f"main {u['commits']['main'][:7]}", "tag-2.0.3": "the 2.0.3 tag",
             "pr325": f"#325's merge ref {u['commits']['pr325'][:7]}"}
    ok = [names[t] for t, a in u["applies"].items() if a]
    bad = [names[t] for t, a in u["applies"].items() if not a]
    return (f"Applies alone and stacked with the other two PRs in every order on {', '.join(ok)}"
            + (f"; not on {', '.join(bad)}" if bad else "") + ".")


def _stream_line() -> str:
    """What the reference stream says of #293, its words chosen by the ledger's verdict on it."""
    from fastattn.lab.claims import claims_ledger
    ref = _results() / REFERENCE
    s, verdict = records(ref)["stream"], next(x for x in claims_ledger(ref) if x["claim"].endswith("(#293)"))["verdict"]
    six, p = s["sixths"], s["params"]
    device = "a GPU" if s["env"].get("device", "cpu").startswith("cuda") else "this CPU"
    lead = {"does not hold": "It is not a fix for #293's slowdown, which did not reproduce here",
            "holds": "#293's slowdown reproduced here, and this change does not remove it"}.get(
        verdict, f"It is not offered as a fix for #293's slowdown, which {device} with {p['weights']} weights cannot "
        "judge")
    t = stream_trends(s)["upstream"]
    return (f"{lead}: a {p['chunks']}-chunk stream on {machine_name(s['env'], ref)} takes "
            f"{six['upstream'][0] / 1e3:.2f} s per chunk upstream in its first sixth and "
            f"{six['upstream'][-1] / 1e3:.2f} s in its last ({pct(t['change'])} over the stream, 95% CI "
            f"[{pct(t['change_ci'][0])}, {pct(t['change_ci'][1])}], {t['repeats']} repeats); patched, "
            f"{six['exact'][0] / 1e3:.2f} s and {six['exact'][-1] / 1e3:.2f} s")


def _machine_table() -> str:
    layers = {r["dec32"]["params"].get("layers") for _, r in _machines() if r["dec32"]}
    step = f"the LM at full width, {layers.pop()} layers" if len(layers) == 1 else "the LM at full width"
    out = ["| machine | KV of a 300-token request | decode step at position 256 (" + step + "), bf16 / fp32 (patched "
           "/ upstream, 95% CI) | whole decode (patched / upstream) | outputs |", "|---|---|---|---|---|"]
    out += [f"| {r['machine']} | {r['kv_mb'][0]:.0f} MB -> {r['kv_mb'][1]:.0f} MB | {_ratio(r['step_bf16'])} / "
            f"{_ratio(r['step_fp32'])} | {_whole_cell(r)} ({r['steps']} steps) | "
            f"{'identical' if r['identical'] else '**differ**'} |" for r in machine_rows()]
    return "\n".join(out)


def _dtype_seen() -> str:
    from fastattn.devices import cpu_features, native_bf16
    from fastattn.lab.bench.decode import dtype_table

    def fp32_ci(rec):  # float32's step over the default's, 95% interval
        row = next(x for x in dtype_table(rec) if (x["dtype"], x["variant"]) == ("float32", "upstream"))
        return row["95% low"], row["95% high"]
    seen = [(r["dtypes"].get("flags") or {}, fp32_ci(r["dtypes"])) for _, r in _machines() if r["dtypes"]]
    natives = sum(bool(native_bf16(f)) for f, _ in seen)
    slower = sum(verdict(ci, lo=1.0) == YES for _, ci in seen)  # the one rule: the whole interval above 1x
    have = ("Both" if len(seen) == 2 else f"All {len(seen)}") if natives == len(seen) else \
        f"{natives} of the {len(seen)}"
    on = "each" if slower == len(seen) else f"{slower} of them"
    kinds = "; ".join(sorted({cpu_features(f) for f, _ in seen if native_bf16(f)}))
    return (f"{have} machines measured have bf16 instructions ({kinds}); on {on} float32's step is slower than the "
            "default's (its whole 95% interval above 1x)")


def _slice_table() -> str:
    how, note = slice_backend(_matrix())
    out = [f"| torch (CPU) | `torch.compile(..., {how}, fullgraph=True)` of the slice{note} |", "|---|---|"]
    ok = "traces (no error)" if note else "compiles"  # an eager-backend trace compiles nothing
    return "\n".join(out + [f"| {r['torch']} | " + (ok if r["slice"].get("compiles") else
                                                    f"refused: `{r['slice'].get('error', '?')[:90].strip()}`") + " |"
                            for r in _matrix()])


def _matrix_sizes() -> str:
    """The decode every matrix record ran (one size for all, else an error: the table would mix runs)."""
    sizes = {tuple(sorted(r["params"].items())) for r in _matrix()}
    if len(sizes) != 1:
        raise ValueError(f"the torch-matrix records ran different decodes: {sorted(sizes)}")
    p = dict(sizes.pop())
    from fastattn.models import voxcpm2_config
    cfg = voxcpm2_config(p["preset"])
    lm = cfg["lm_config"]
    return (f"VoxCPM2's architecture with random weights at hidden size {lm['hidden_size']}, "
            f"{lm['num_hidden_layers']}+{cfg['residual_lm_num_layers']} LM layers and {lm['num_attention_heads']}/"
            f"{lm['num_key_value_heads']} heads, a {p['text_chars']}-character prompt and {p['steps']} steps")


def _fp32_weights_x() -> float:
    """float32's weights over voxcpm's default dtype's, the largest over the machines' dtype records."""
    from fastattn.lab.bench.decode import dtype_table
    xs = []
    for _, r in _machines():
        if r["dtypes"]:
            gb = {x["dtype"]: x["weights GB"] for x in dtype_table(r["dtypes"]) if x["variant"] == "upstream"}
            xs.append(gb["float32"] / gb[r["dtypes"]["params"]["dtypes"][0]])
    return max(xs)


def _forms_geometry() -> str:
    """The head geometry the forms records ran (one for all)."""
    geo = {(r["params"]["hq"], r["params"]["hkv"], r["params"]["head_dim"], r["params"]["capacity"])
           for dt in ("bfloat16", "float32") for _, r in machines_with(_results(), "decode_forms", dtype=dt)}
    if len(geo) != 1:
        raise ValueError(f"the decode_forms records ran different geometries: {sorted(geo)}")
    hq, hkv, d, cap = geo.pop()
    return f"{hq} query heads, {hkv} KV heads, {d} dims, {cap} slots"


#: the compiled forms as a VoxCPM maintainer would name them (the workbook's own names stay out of the PR)
def _forms_winners() -> str:
    """How often this PR's form won the compiled-forms records (one per machine and dtype)."""
    from fastattn.lab.bench.forms import form_verdict
    recs = [r for dt in ("bfloat16", "float32") for _, r in machines_with(_results(), "decode_forms", dtype=dt)]
    won = sum(form_verdict(r)["winner"] == "flex_decode" for r in recs)
    if won == len(recs):
        return "FlexAttention was the fastest compiled variant in every row."
    return (f"FlexAttention was the fastest compiled variant in {won} of {len(recs)} rows: on CPU it is not always the "
            "fastest. This PR takes it because it keeps static shapes (one graph for a whole decode); what that is "
            "worth on a GPU is not measured.")


def _bf16_flags() -> str:
    """The bf16 instruction flags /proc/cpuinfo can show (:data:`fastattn.devices.BF16_FLAGS`), as a list in words."""
    from fastattn.devices import BF16_FLAGS
    names = [f"`{f}`" for f in BF16_FLAGS]
    return f"{', '.join(names[:-1])} or {names[-1]}" if len(names) > 1 else names[0]


def fields() -> dict:
    """Every figure the PR templates (``data/upstream-prs/templates/``) print, by name."""
    from fastattn.lab.upstream import LIVE_ERROR_BOUND
    from tools.readme import dtype_machines, forms_machines
    label = lambda folder, env: machine_name(env, folder)  # noqa: E731 - a machine in upstream's words, not a folder name
    tests = {k: _tests_line(f"test_{k}.py") for k in ("minicpm4_right_sized_cache", "cpu_dtype_override",
                                                       "minicpm4_decode_attention")}
    return {"machine_table": _machine_table(), "matrix_machine": _matrix()[0]["machine"].split(", torch")[0],
            "matrix_table": matrix_table(), "math_versions": math_versions(), "stream_line": _stream_line(),
            "applies": _applies(), "tests_right": "\n".join(tests["minicpm4_right_sized_cache"]),
            "tests_dtype_kit": tests["cpu_dtype_override"][0], "tests_upstream": tests["cpu_dtype_override"][1],
            "tests_live": "\n".join(tests["minicpm4_decode_attention"]), "repo": REPO,
            "dtype_table": dtype_machines(_results(), label).strip(), "dtype_seen": _dtype_seen(),
            "slice_evidence": _slice()[0], "live_bound": LIVE_ERROR_BOUND,
            "forms_table": forms_machines(_results(), label, form_words, noun="variant").strip(),
            "slice_table": _slice_table(),
            "forms_winners": _forms_winners(), "matrix_sizes": _matrix_sizes(), "fp32_weights_x": _fp32_weights_x(),
            "forms_geometry": _forms_geometry(), "bench_table": bench_table(none="(none yet)"),
            **{f"bench_{k.replace('-', '_')}": _bench_rehearsal(k) for k in KITS},
            "script_dtype": _script_line("cpu-dtype"), "bf16_flags": _bf16_flags()}


def reply_293_text() -> str:
    """The reply from every record of the reference run the diagnosis reads: the stream, the consumer matrix, the
    consumer beside the generator and the growing prompts."""
    return reply_for_293(_results() / REFERENCE) + "\n"


def documents() -> dict:
    """``{file name under data/upstream-prs: text}``: each template filled with :func:`fields`, and the reply."""
    f = fields()
    out = {p.name: p.read_text().format(**f) for p in sorted((Path(data_dir()) / PRS / "templates").glob("*.md"))}
    return {**out, "reply-293.md": reply_293_text()}


MATRIX_BEGIN, MATRIX_END = "<!-- matrix:begin -->", "<!-- matrix:end -->"


def install_matrix() -> str:
    """docs/install.md's tested matrix: CI's pair, then each torch of the exactness records (the contract's
    decode through the right-sized diff, and the kits' tests, stacked)."""
    yes = {True: "yes", False: "**no**", None: "not run"}
    out = ["| torch | Python | how | SDPA kernel (CPU) | default patch = upstream | kit tests |",
           "|---|---|---|---|---|---|",
           "| 2.13.0 | 3.11 | `make test` (CI) | FLASH_ATTENTION | every test | every test |"]
    py = lambda v: "" if v.startswith("3.11") else f" PY={'.'.join(v.split('.')[:2])}"  # noqa: E731
    out += [f"| {r['torch']} | {r['python']} | `make torch-matrix TORCH={r['torch']}{py(r['python'])} "
            "SUITE=exactness` | "
            f"{r['kernel']} | {yes[r['diff'] and r['exact']]} | {r['kits'][0]} passed, {r['kits'][1]} failed |"
            for r in _matrix()]
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="python -m tools.prs", description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help=f"write data/{PRS}/*.md")
    args = ap.parse_args(argv)
    if args.write:
        from fastattn.lab.paths import repo_root
        from tools.readme import replace_block
        replace_block(repo_root() / "docs" / "install.md", install_matrix(), MATRIX_BEGIN, MATRIX_END)
    for name, text in documents().items():
        if args.write:
            (Path(data_dir()) / PRS / name).write_text(text)
            print(Path(data_dir()) / PRS / name)
        else:
            print(f"===== {name}\n{text}")
    return 0


if __name__ == "__main__":
    import sys
    sys.exit(main())
