"""The four upstream PRs (the bench first), the comment for PR #395 and the reply to #293, written from committed
records.

The texts are templates (``data/upstream-prs/templates/*.md``) filled with :func:`fields`; the reply is
:func:`fastattn.lab.diagnosis.reply_293`'s. ``python -m tools.prs`` prints them; ``--write`` writes
``data/upstream-prs/*.md``, which a test checks are current and within :data:`BUDGETS`. Each figure comes from one
function reading ``data/results/``: :func:`machine_rows` (the right-sized decode per machine), :func:`matrix_rows`
(the exactness contract per torch), :func:`upstream_check` (the diffs on upstream's trees, upstream's own tests, the
bench run on each PR), :func:`slice_evidence` (the slice fix under ``fullgraph``), the ``dtype_decode`` and
``decode_forms`` records per machine, and ``wrapped_programs`` (upstream's CLI and a streaming service).
"""

from __future__ import annotations

import re
import statistics
from pathlib import Path

from fastattn.lab.bench.metrics import kv_mb, matrix_rows, newest, slice_evidence, whole_ratio
from fastattn.lab.bench.records import load_record
from fastattn.lab.bench.stats import quiet
from fastattn.lab.diagnosis import fix_evidence
from fastattn.lab.paths import data_dir
from fastattn.lab.report import reply_for_293
from fastattn.lab.upstream import FIX_KITS, KITS, REPO_FILES, TEST_PATCHES
from tools.sources import REFERENCE, machine_name, machines_with, records

__all__ = ["machine_rows", "matrix_rows", "upstream_check", "slice_evidence", "math_versions", "fields",
           "documents", "main", "BUDGETS", "words", "PLACEHOLDERS"]

PRS = "upstream-prs"
#: each text's word budget (:func:`words`); the reply's holds for each language. PR 1, PR 2 and the reply per
#: issue 56; the bench PR, PR 3 and the #395 comment: what their content needs and no more
BUDGETS = {"0-decode-bench.md": 400, "1-right-sized-decode.md": 500, "2-cpu-dtype.md": 350,
           "3-live-decode-attention.md": 600, "comment-395.md": 350, "reply-293.md": 400,
           "note-cpu-compile.md": 250}
#: what no text may carry: a link nobody can fill, a table row that says nothing
PLACEHOLDERS = ("<link to this repository>", "(none yet)")


def words(text: str) -> int:
    """Words as a reader counts them: whitespace-separated tokens with a letter or digit (a table's pipes and rules
    are not words), and Chinese at two characters a word."""
    cjk = len(re.findall(r"[\u4e00-\u9fff]", text))
    rest = re.sub(r"[\u3000-\u303f\u4e00-\u9fff\uff00-\uffef]", " ", text)
    return sum(bool(re.search(r"\w", w)) for w in rest.split()) + (cjk + 1) // 2


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
    runs = r["whole_runs"]
    return f"{r['whole'].value:.2f}x ({len(runs)} runs: {min(runs):.2f}x-{max(runs):.2f}x)"


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


def math_versions() -> str:
    """What every matrix record says about the torch versions whose CPU runs this call through the math kernel,
    in a clause: how often a decode with 512-slot windows (forced, or the diff's own before the version gate)
    matched upstream."""
    runs = _window_runs()
    if not runs:
        return ""
    n = sum(len(rows) for rows in runs.values())
    bad = [r for rows in runs.values() for r in rows if not r.get("identical")]
    versions = list(runs)
    said = f"{', '.join(versions[:-1])} and {versions[-1]}" if len(versions) > 1 else versions[0]
    return (f"On torch {said} the call runs the math kernel, where 512-slot windows matched in {n - len(bad)} of {n} "
            "decodes")


def _exact_versions() -> str:
    """The torch versions whose CPU runs the call through the flash kernel and where every matrix decode through the
    diff, and with 512-slot windows forced, was ``torch.equal`` to upstream's, as a list in words."""
    ok = [r["torch"] for r in _matrix() if r["kernel"].endswith("FLASH_ATTENTION") and r["diff"] and r["forced"]]
    return f"{', '.join(ok[:-1])} and {ok[-1]}" if len(ok) > 1 else "".join(ok)


def upstream_check() -> dict:
    """The newest ``upstream_check`` record: the commits, whether every diff applied alone and stacked per tree,
    upstream's own tests on main (``tests``, by how), each PR's test (``pr_tests[(tree, kit, how)]``, how:
    "stacked", "unmodified" or "alone"), the bench run on each fix PR and upstream's check scripts, by kit."""
    rec = newest(_results() / "upstream", "upstream-check-*.json")[-1]
    rows = rec["rows"]
    trees = {r["tree"]: all(x["applies"] for x in rows if x["tree"] == r["tree"] and "applies" in x)
             for r in rows if "applies" in r}
    tests = {r["check"].split(", ")[-1]: r for r in rows if "passed" in r and "kit" not in r}
    pr_tests = {(r["tree"], r["kit"], r["check"].split()[-1]): r for r in rows if "test" in r}
    by_kit = lambda check: {k: [r for r in rows if r["check"].startswith(check) and r["kit"] == k]  # noqa: E731
                            for k in {r["kit"] for r in rows if r["check"].startswith(check)}}
    return {"commits": rec["params"]["commits"], "applies": trees, "tests": tests, "pr_tests": pr_tests,
            "kits": rec["params"].get("kits", []), "bench": by_kit("the bench"),
            "scripts": by_kit("upstream's check script")}


def _main(u: dict) -> str:
    return f"main {u['commits']['main'][:7]}"


def _script_line(kit: str) -> str:
    """The PR's change to an upstream check script and how that script ran on main with the diff alone."""
    u = upstream_check()
    runs = u.get("scripts", {}).get(kit)
    if not runs:
        return "Upstream's check scripts were not run here."
    said = "; ".join(f"{_switch(r)} {r['tail'] or 'no output'}" for r in runs if r.get("script_changed", True))
    before = next((r for r in runs if r.get("script_changed") is False), None)
    return (f"`{runs[0]['script']}` clears the variable where it checks that non-MPS devices are untouched, and "
            f"checks the CPU override. On {_main(u)} with this PR: {said}"
            + (f"; main's unchanged script with {_switch(before)[5:]} set: {before['tail'] or 'no output'}"
               if before else "") + ".")


def _bench_rehearsal() -> str:
    """What each fix PR's bench command gave here (CPU, random tiny weights), from the record: one sentence."""
    u = upstream_check()
    runs = [(k, r) for k in FIX_KITS for r in u["bench"].get(k, [])]
    if not runs:
        return "It has not been run against the three decode PRs here yet."
    failed = [f"{k} {_switch(r)} (exit status {r['returncode']})" for k, r in runs if r["returncode"]]
    same = [r["equal"] for _, r in runs if not r["returncode"] and not r["switch"]]
    switched = [r["equal"] for _, r in runs if not r["returncode"] and r["switch"]]
    said = (f"Run that way here on CPU ({_bench_seconds(runs)}), {_main(u)} against each of the three decode PRs "
            f"gave identical waveforms in {sum(same)} of {len(same)} runs with the PRs' switches unset, and different "
            f"ones in {switched.count(False)} of {len(switched)} with them set (float32, or the other attention)")
    return said + (f"; failed: {', '.join(failed)}." if failed else ".")


def _bench_seconds(runs: list) -> str:
    secs = [r["wall_s"] for _, r in runs if r.get("wall_s")]
    return f"{min(secs):.0f}-{max(secs):.0f} s a run" if secs else "a CPU run"


def _switch(r: dict) -> str:
    return "with " + ", ".join(f"`{k}={v}`" for k, v in r["switch"].items()) if r["switch"] else "by default"


def _counts(r: dict) -> str:
    return (f"{r['passed']} passed" + (f", {r['failed']} failed" if r["failed"] else "")
            + (f", {r['skipped']} skipped (CUDA only)" if r["skipped"] else ""))


def _both(alone: dict, stacked: dict) -> str:
    """A PR's test counts with its diff alone and with all four, once where they are the same."""
    if _counts(alone) == _counts(stacked):
        return f"{_counts(alone)} with this PR alone and with all four"
    return f"{_counts(alone)} with this PR alone, {_counts(stacked)} with all four"


def _new_cases(kit: str) -> list:
    """The test functions a PR adds to an existing test file (:data:`TEST_PATCHES`)."""
    text = (data_dir() / "upstream-tests" / TEST_PATCHES[kit]).read_text()
    return re.findall(r"^\+def (test_\w+)", text, re.M)


def _tests_line(kit: str) -> str:
    """How the PR's tests ran on main: with its diff alone, with all four stacked, and with only the test on
    unmodified main (a new file, or new cases in an existing file); the bench's on the 2.0.3 tag too."""
    u = upstream_check()
    test = KITS[kit][2]
    alone, stacked, bare = (u["pr_tests"].get(("main", kit, how)) for how in ("alone", "stacked", "unmodified"))
    if not (alone and stacked and bare):
        return f"`tests/{test}` was not run here yet."
    if kit in TEST_PATCHES:
        new = _new_cases(kit)
        failing = [n for n in bare["failed_tests"] if n.split("[")[0] in new]
        head = (f"`tests/{test}` gains {len(new)} tests; the file on {_main(u)}: {_both(alone, stacked)}; on "
                f"unmodified main {len(failing)} of the new cases fail")
    else:
        bare_said = ("the file fails at collection" if "collection failure" in bare["failed_tests"].values()
                     else f"{bare['failed']} of them fail")
        head = f"`tests/{test}` (new) on {_main(u)}: {_both(alone, stacked)}; on unmodified main {bare_said}"
    if kit in REPO_FILES:
        tag_alone, tag_bare = (u["pr_tests"].get(("tag-2.0.3", kit, how)) for how in ("alone", "unmodified"))
        if tag_alone:
            head += f"; on the 2.0.3 tag {_counts(tag_alone)}"
            if tag_bare and tag_bare["failed"]:
                head += ", and without this PR it fails there too"
    return head + "."


def _own_tests() -> str:
    """Upstream's own tests on main with the four PRs and without."""
    u = upstream_check()
    own, orig = u["tests"].get("the four diffs stacked"), u["tests"].get("unmodified")
    if not own or not orig:
        return ""
    same = "the same test" if len(own["failed_tests"]) == 1 else "the same tests"
    if own["failed_tests"].keys() != orig["failed_tests"].keys():
        same = "other tests"
    missing = r"import (\w+)\W{1,4}n?\s*ModuleNotFoundError"  # a failure that is the test machine's, not the change's
    why = {m[1] for msg in own["failed_tests"].values() for m in re.finditer(missing, msg)}
    fails = ", ".join(f"`{n}`" for n in own["failed_tests"]) or "none"
    return (f"Upstream's own `tests/` with all four PRs: {own['passed']} passed, {own['failed']} failed ({fails}"
            + (f"; no {', '.join(sorted(why))} here" if why else "") + f"); unmodified main fails {same}.")


def _applies() -> str:
    u = upstream_check()
    names = {"main": _main(u), "tag-2.0.3": "the 2.0.3 tag", "pr325": f"#325's merge ref {u['commits']['pr325'][:7]}"}
    ok = [names[t] for t, a in u["applies"].items() if a]
    bad = [names[t] for t, a in u["applies"].items() if not a]
    others = {4: "three", 3: "two"}.get(len(u["kits"]), "other")
    where = f"{', '.join(ok[:-1])} and {ok[-1]}" if len(ok) > 1 else "".join(ok) or "no tree"
    return (f"Applies alone and stacked with the other {others} PRs in every order on {where}"
            + (f"; not on {', '.join(bad)}" if bad else "") + ".")


def _machine_table() -> str:
    layers = {r["dec32"]["params"].get("layers") for _, r in _machines() if r["dec32"]}
    step = f" ({layers.pop()} layers)" if len(layers) == 1 else ""
    steps = {r["steps"] for r in machine_rows()}
    whole = f", {steps.pop()} steps" if len(steps) == 1 else ""
    out = [f"| CPU | KV cache, 300 tokens | step at 256{step}, PR / main, 95% CI | decode{whole}, PR / main | "
           "outputs |", "|---|---|---|---|---|"]
    out += [f"| {r['machine']} | {r['kv_mb'][0]:.0f} MB -> {r['kv_mb'][1]:.0f} MB | {_ratio(r['step_bf16'])} | "
            f"{_whole_cell(r)} | {'identical' if r['identical'] else '**differ**'} |" for r in machine_rows()]
    return "\n".join(out)


def _programs_line() -> str:
    """The fix under upstream's own CLI and a streaming service, from the reference machine's (else the last)
    ``wrapped_programs`` record, worded by :func:`fastattn.lab.bench.programs.wrapped_sentence`; without a record,
    a line saying it is not measured."""
    found = machines_with(_results(), "wrapped_programs")
    if not found:
        return "Not measured yet: this change under upstream's own CLI and a streaming service."
    from fastattn.lab.bench.programs import wrapped_sentence
    said = wrapped_sentence(next((r for f, r in found if f.name == REFERENCE), found[-1][1])).strip()
    return said if said.endswith((".", "!", "?")) else said + "."


def _cpu_compile() -> str:
    """The note's answer: per machine with a ``compiled_decode`` record, its sentence by
    :func:`fastattn.lab.bench.metrics.compile_line`, then what the intervals say (compiled faster, slower or
    undecided against eager, by :func:`fastattn.lab.bench.stats.verdict`)."""
    from fastattn.lab.bench.metrics import compile_line
    from fastattn.lab.bench.stats import NO, UNDECIDED, YES, verdict
    found = machines_with(_results(), "compiled_decode")
    if not found:
        return "Not measured yet: the whole decode compiled on CPU."
    said = {YES: "faster", NO: "slower", UNDECIDED: "not decided by its interval"}
    cases = [(v, verdict(o["ratio_ci"], hi=1.0)) for _, rec in found for v, o in rec["variants"].items()]
    lines = [f"- {machine_name(rec['env'], folder)}: {compile_line(rec)}." for folder, rec in found]
    if {v for _, v in cases} in ({NO}, {YES}):
        answer = (f"compiling made the whole decode {said[cases[0][1]]} in every case, so on this evidence "
                  + ("`optimize()` should keep to CUDA" if cases[0][1] == NO else "a CPU path is worth a PR"))
    else:
        each = "; ".join(f"{name}: {said[v]}" for name, v in cases)
        answer = (f"the cases do not agree ({each})" if YES in {v for _, v in cases} else
                  f"compiling did not pay ({each})") + ", so no change is proposed on this evidence"
    return "\n".join(lines) + f"\n\nOn these machines {answer}."


def _dtype_table() -> str:
    """PR 2's table: per machine, its bf16 instructions, voxcpm's default step and float32's over it, decode by
    decode, and the weights' memory."""
    from fastattn.lab.bench.decode import dtype_table
    from fastattn.lab.machine import cpu_features
    out = ["| CPU | bf16 instructions | decode step, bfloat16 | float32 / bfloat16, each decode | weights GB, "
           "bf16 -> fp32 |", "|---|---|---|---|---|"]
    for folder, rec in machines_with(_results(), "dtype_decode"):
        rows = {(x["dtype"], x["variant"]): x for x in dtype_table(rec)}
        base, fp32 = rows[(rec["params"]["dtypes"][0], "upstream")], rows[("float32", "upstream")]
        out.append(f"| {machine_name(rec['env'], folder)} | {cpu_features(rec.get('flags') or {})} | "
                   f"{base['step s']:.2f} s | {', '.join(f'{x:.2f}x' for x in fp32['per decode'])} | "
                   f"{base['weights GB']:.1f} -> {fp32['weights GB']:.1f} |")
    return "\n".join(out)


def _dtype_seen() -> str:
    """What the dtype records show, decode by decode: on how many machines every float32 decode was slower."""
    from fastattn.lab.bench.decode import dtype_table
    from fastattn.lab.machine import native_bf16
    seen = []
    for _, rec in machines_with(_results(), "dtype_decode"):
        fp32 = next(x for x in dtype_table(rec) if (x["dtype"], x["variant"]) == ("float32", "upstream"))
        seen.append((native_bf16(rec.get("flags") or {}), min(fp32["per decode"]) > 1))
    natives, slower = sum(bool(n) for n, _ in seen), sum(s for _, s in seen)
    have = "Both CPUs measured have" if natives == len(seen) == 2 else f"{natives} of the {len(seen)} CPUs have"
    on = "each" if slower == len(seen) else f"{slower} of them"
    return f"{have} bf16 instructions, and on {on} every float32 decode was slower"


def _fp32_weights_x() -> float:
    """float32's weights over voxcpm's default dtype's, the largest over the machines' dtype records."""
    from fastattn.lab.bench.decode import dtype_table
    xs = []
    for _, r in machines_with(_results(), "dtype_decode"):
        gb = {x["dtype"]: x["weights GB"] for x in dtype_table(r) if x["variant"] == "upstream"}
        xs.append(gb["float32"] / gb[r["params"]["dtypes"][0]])
    return max(xs)


def _forms() -> list:
    found = [x for dt in ("bfloat16", "float32") for x in machines_with(_results(), "decode_forms", dtype=dt)]
    return sorted(found, key=lambda x: (x[0].name, x[1]["params"]["dtype"]))


def _forms_geometry() -> str:
    """The head geometry the forms records ran (one for all)."""
    geo = {(r["params"]["hq"], r["params"]["hkv"], r["params"]["head_dim"], r["params"]["capacity"])
           for _, r in _forms()}
    if len(geo) != 1:
        raise ValueError(f"the decode_forms records ran different geometries: {sorted(geo)}")
    hq, hkv, d, cap = geo.pop()
    return f"{hq} query heads, {hkv} KV heads, {d} dims, {cap} slots"


#: the compiled forms PR 3's table shows, in a maintainer's words: today's call, this PR's, the slice
FORMS_SHOWN = {"upstream_masked": "masked (today's)", "flex_decode": "FlexAttention (this PR)",
               "slice_live": "slice (`.item()`)"}
#: the positions PR 3's table shows (of those the records timed)
FORMS_POSITIONS = (0, 1024, 4096, 8000)


def _forms_ms_table(dtype: str = "bfloat16") -> str:
    """PR 3's table: per machine, each compiled form's median ms per call (quiet samples) at each position."""
    recs = [(f, r) for f, r in _forms() if r["params"]["dtype"] == dtype]
    positions = [p for p in recs[0][1]["params"]["positions"] if p in FORMS_POSITIONS]
    out = ["| CPU | compiled attention | " + " | ".join(f"ms at {p}" for p in positions) + " |",
           "|---|---|" + "---|" * len(positions)]
    for folder, rec in recs:
        for i, (form, name) in enumerate(FORMS_SHOWN.items()):
            ms = []
            for p in positions:
                row = next((r for r in rec["rows"] if (r["form"], r["position"], r["compiled"]) == (form, p, True)),
                           None)
                ms.append(f"{statistics.median(quiet(row['samples_ms'], row.get('disturbed_flags'))):.3g}"
                          if row else "n/a")
            out.append(f"| {machine_name(rec['env'], folder) if i == 0 else ''} | {name} | " + " | ".join(ms) + " |")
    return "\n".join(out)


def _forms_winners() -> str:
    """How often this PR's form won the compiled-forms records (one per machine and dtype)."""
    from fastattn.lab.bench.forms import form_verdict
    recs = [r for _, r in _forms()]
    won = sum(form_verdict(r)["winner"] == "flex_decode" for r in recs)
    return (f"FlexAttention was the fastest compiled form in {won} of {len(recs)} CPU-dtype pairs (float32 too); the "
            "slice compiles only with `capture_scalar_outputs=True`, which `optimize()` does not set.")


def _gate_layers() -> int:
    """Layers whose decode attention runs per step in VoxCPM2 (both LMs), from its architecture."""
    from fastattn.models import voxcpm2_config
    cfg = voxcpm2_config("full")
    return cfg["lm_config"]["num_hidden_layers"] + cfg["residual_lm_num_layers"]


def fields() -> dict:
    """Every figure the PR templates (``data/upstream-prs/templates/``) print, by name."""
    from fastattn.lab.upstream import LIVE_ERROR_BOUND
    from fastattn.models import voxcpm2_config
    cfg = voxcpm2_config("full")
    return {"machine_table": _machine_table(), "exact_versions": _exact_versions(), "math_versions": math_versions(),
            "programs": _programs_line(), "applies": _applies(), "own_tests": _own_tests(),
            **{f"tests_{k.replace('-', '_')}": _tests_line(k) for k in KITS},
            "dtype_table": _dtype_table(), "dtype_seen": _dtype_seen(), "fp32_weights_x": _fp32_weights_x(),
            "script_dtype": _script_line("cpu-dtype"), "slice_evidence": _slice()[0], "live_bound": LIVE_ERROR_BOUND,
            "slice_refused": fix_evidence(_matrix())[0],
            "forms_geometry": _forms_geometry(), "forms_table": _forms_ms_table(), "forms_winners": _forms_winners(),
            "bench_rehearsal": _bench_rehearsal(), "bench": next(iter(REPO_FILES["bench"])),
            "layers": _gate_layers(), "base_layers": cfg["lm_config"]["num_hidden_layers"],
            "residual_layers": cfg["residual_lm_num_layers"], "cpu_compile": _cpu_compile()}


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
