"""README's findings table, headline figure and ``docs/results.md``, written from the committed reference records
(never typed by hand).

``python -m fastattn readme`` prints README's block; ``--write`` replaces it in README.md between the markers
``<!-- findings:begin -->`` and ``<!-- findings:end -->``, the same block of ``docs/results.md`` (every finding
in prose, and the two CPUs side by side) and the headline figure ``data/results/headline.png``. Tests fail when
any of them and the records disagree.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from .bench.metrics import step_ratio
from .bench.records import find_row, load_record
from .claims import math_fallback_reason
from .devices import runtime_dtype
from .paths import data_dir, repo_root

BEGIN, END = "<!-- findings:begin -->", "<!-- findings:end -->"
REFERENCE = "cpu-epyc-avx512-2threads-torch2.13.0"
OTHER = "cpu-xeon-avx512-2threads-torch2.13.0"


def _ci(t: dict) -> str:
    """A judged ratio as README quotes it: 3 significant digits, its 95% interval and n where it has them."""
    from .bench.stats import fmt_ci
    return f"{t['measured']:.3g}x" + ("" if t.get("ci_low") is None else
                                      f" (95% CI {fmt_ci((t['ci_low'], t['ci_high']))}, n={t['n']})")


def _saving(rows, slow: dict, fast: dict, key: str = "median_ms") -> Optional[float]:
    """``slow[key] - fast[key]`` of two rows; None where either figure was not measured (on CUDA the in-step
    kernel time is not profiled)."""
    a, b = find_row(rows, **slow)[key], find_row(rows, **fast)[key]
    return None if a is None or b is None else a - b


def reference_findings(ref: Path, other: Optional[Path] = None) -> str:
    """The findings block for README from the record folder ``ref`` (and ``other``, a second machine).
    Every figure and every verdict word is read from the records (or from :data:`bench.GOALS`)."""
    from .bench.metrics import time_shares
    from .bench.targets import GOALS
    rec = lambda n: load_record(ref / f"{n}.json")  # noqa: E731
    tr = rec("targets")
    env, t = tr["env"], {x["id"]: x for x in tr["rows"]}
    att32, cold, costs, matrix = (rec(n) for n in ("attention_float32", "attention_float32_cold", "dtype_costs",
                                                   "backend_matrix"))
    whole, kv, rss, growth, comp = (rec(n) for n in ("whole_decode_full", "kv_memory_full", "peak_rss_small",
                                                     "cache_growth_full", "compiled_step_tiny"))
    stream, d32 = rec("stream_profile_full"), rec("decode_step_float32")
    six, sp = stream["sixths"], stream["params"]
    ladder = rec("exactness_calibration")["rows"]
    bad = {r["dtype"]: r for r in ladder if r["candidate"] == 256 and r["lq"] == 5 and not r["bit_identical"]}
    chosen = sorted({r["chosen"] for r in ladder}, key=str)
    fa, gm = (find_row(cold["rows"], mode=m, position=4096) for m in ("fast", "gemm_floor"))
    share = time_shares(whole)
    xo = (lambda n: load_record(other / f"{n}.json")) if other else None
    up, pa = {"variant": "upstream", "position": 256}, {"variant": "patched", "position": 256}
    layers, dp = d32["params"]["layers"], d32["params"]
    step_saving = _saving(d32["rows"], up, pa) / layers
    in_step = _saving(d32["rows"], up, pa, "attention_in_step_ms")
    call = {n: _saving(r["rows"], {"mode": "reference", "position": 256}, {"mode": "exact", "position": 256})
            for n, r in (("warm", att32), ("cold", cold))}
    brackets = min(call.values()) <= step_saving <= max(call.values())
    windowed = any(c is not None for c in chosen)
    floor_goal = GOALS["fast_floor_4096"][1]
    gpu = str(env.get("device", "cpu")).startswith("cuda")
    kind = "GPU" if gpu else "CPU"
    mdt = runtime_dtype(env.get("device", "cpu"))  # the dtype voxcpm runs there: kernel claims are about it
    masked = find_row(matrix["rows"], case="upstream: bool mask over full cache + GQA", dtype=mdt, head_dim=128)
    no_gqa = find_row(matrix["rows"], case="bool mask, no enable_gqa (K/V repeated)", dtype=mdt, head_dim=128)
    conv = find_row(costs["rows"], op="bf16 -> fp32 conversion of K")["median_ms"]
    slice32 = find_row(costs["rows"], op="SDPA over the slice", dtype="float32")["median_ms"]
    decays = stream.get("trend", {}).get("upstream", {}).get("verdict", "") == "grows" or \
        stream["verdict"]["upstream"].startswith("decays")  # the reference record predates the trend verdict
    rs, wp = rss["summary"], whole["params"]
    winners = ", ".join(sorted({c["winner"] for c in att32["fast_choice"]}))
    machine = (f"{env['device_name']} (CUDA, torch {env['torch']})" if gpu else
               f"{env['threads']}-core {env['device_name']} ({env['cpu_capability']}, torch {env['torch']})")
    lines = [
        f"Findings on a {machine}, "
        f"from the committed reference run `data/results/{ref.name}/` (made by `python -m fastattn bench reference "
        f"--repeats {dp['repeats']}` at commit {env['git_commit'][:7]}; its `targets.json` judges every target, with "
        "a paired bootstrap 95% interval and n for every timing ratio, and says why where one is missed); rerun "
        "`make workbook` to measure your own machine."
        + (f" The first round's run on a 2-core Xeon (`data/results/{other.name}/`, an earlier commit with 256-slot "
           "windows) is quoted beside it where the two differ." if other else ""),
        "",
        f"* The symptom users cite (#293: streaming slows from ~0.3 s to 1-2 s per chunk after 400+ chunks) "
        f"{'shows' if decays else 'does not show'} on this {kind}: a {sp['chunks']}-chunk `generate_streaming` run of "
        f"the {sp['preset']} model in {sp['dtype']} costs {six['upstream'][0] / 1e3:.2f} s per chunk upstream in the "
        f"first sixth and {six['upstream'][-1] / 1e3:.2f} s in the last ({stream['verdict']['upstream']}), "
        f"{six['exact'][0] / 1e3:.2f} -> {six['exact'][-1] / 1e3:.2f} s patched (`exact`, every chunk "
        f"{'bit-identical' if stream['identical']['exact'] else 'NOT identical'})."
        + ("" if decays else " The full-cache attention makes every chunk slow from the start; it does not make the "
           "stream decay here, so #293's decay has another cause (see `01_root_cause`)."),
        f"* Upstream's masked decode call in {mdt} runs `{masked['kernel']}` on this {kind} "
        f"(dispatcher: {masked['backend']}"
        + (", after an `aten::where` that turns the mask into -inf" if "aten::where" in masked["helpers"] else "")
        + ") at every position: "
        + math_fallback_reason(masked, no_gqa)[1] + "."
        + ("" if gpu else " (On CUDA torch's flash kernel rejects any `attn_mask`; `python -m fastattn gpu-check` "
           "records which kernel a GPU runs.)"),
        (f"* `exact` is bit-identical to upstream **by construction**: its window is a multiple of the CPU flash "
         f"kernel's 512-key block, confirmed on every machine by `calibrate_exact` (3 draws, every length around each "
         f"block edge, capacity 8192; here {', '.join(map(str, chosen))} for fp32 and bf16, Lq 1 and 5)."
         if windowed else
         f"* No key window is exact by construction on this device's kernels (`calibrate_exact`: granularity "
         f"{', '.join(map(str, chosen))}): `exact` attends over all {masked['keys']} slots, upstream's computation "
         "minus its per-request zero-fill, and the speed path is the opt-in `fast`.")
        + (f" The first round's 256-slot window was not: it differs at length {bad['float32']['first_diff_length']} "
           f"for Lq = 5 here (fp32 {bad['float32']['max_abs_diff']:.1e}, bf16 {bad['bfloat16']['max_abs_diff']:.1e})."
           if {"float32", "bfloat16"} <= set(bad) else ""),
        f"* One attention call at position 256 (fp32, capacity 8192): `exact` {_ci(t['exact_p256'])} and `fast` "
        f"{_ci(t['fast_p256'])} of `reference`. `fast` picks {winners} here and against the public slice fix "
        f"costs {_ci(t['fast_slice_bf16@2048'])} in bf16 and "
        f"{_ci(t['fast_slice_fp32@2048'])} in fp32 at position 2048, with an error against float64 at most "
        f"{t['fast_error@float32']['measured']:.2f}x (fp32) and {t['fast_error@bfloat16']['measured']:.2f}x (bf16) "
        "`reference`'s.",
        f"* Read cache-cold, as a model step reads {cold['params']['caches']} layers' caches: `fast` at 4096 in fp32 "
        f"is {fa['x_floor']:.1f}x the DRAM floor (live K+V once at {cold['bandwidth']['gb_per_s']:.0f} GB/s), and "
        f"the two bare GEMMs of its grouped form alone are {gm['x_floor']:.1f}x: `fast` is "
        f"{fa['median_ms'] / gm['median_ms']:.2f}x the best torch's BLAS does with those bytes"
        + (f", so the {floor_goal:g}x goal needs a custom kernel." if gm["x_floor"] > floor_goal else ".")
        + (f" A decode step saves {step_saving:.2f} ms per layer in fp32 at position 256; the same attention call "
           f"saves {call['warm']:.2f} ms measured warm, {call['cold']:.2f} ms cold and {in_step:.2f} ms as the SDPA "
           f"kernel profiled inside the step ({step_saving / in_step:.2f}x)"
           + (": the isolated benchmarks bracket the step's saving, the in-step kernel matches it." if brackets else
              ": the in-step kernel figure is the one to compare.") if windowed and in_step else ""),
        f"* bf16 costs {costs['ratios']['SDPA over the slice']:.1f}x fp32 in SDPA over the slice, "
        f"{costs['ratios']['masked SDPA over the capacity (upstream)']:.1f}x in upstream's masked call and "
        f"{costs['ratios']['bare GEMM q @ k^T']:.1f}x in a bare GEMM; converting the live K to fp32 takes "
        f"{conv:.2f} ms against {slice32:.2f} ms for one fp32 call over the slice"
        + (". So `fast`'s grouped form (convert once, fp32 GEMMs) gains most in bf16, voxcpm's own dtype."
           if costs["ratios"]["SDPA over the slice"] > costs["ratios"]["bare GEMM q @ k^T"] else "."),
        f"* A real-width decode step ({layers} layers, hidden {dp['hidden']}) at position 256: {_ci(t['decode_bf16'])} "
        f"in bf16, {_ci(t['decode_fp32'])} in fp32"
        + (f" (Xeon: {step_ratio(xo('decode_step_bfloat16')).value:.2f}x, "
           f"{step_ratio(xo('decode_step_float32')).value:.2f}x)" if xo else "") + ".",
        f"* KV of a {kv['params']['prefill'] + kv['params']['steps']}-token request of the {kv['params']['preset']} "
        f"model, read from the cache objects: {kv['upstream_bytes'] / 1e6:.0f} MB to {kv['patched_bytes'] / 1e6:.0f} "
        + ("MB." if kv.get("right_sized", True) else f"MB ({kv['note']}).")
        + f" Peak RSS of a short {rss['params']['preset']}-preset request ({rs['runs']} fresh CPU processes each): "
        f"patched {rs['peak_difference_bytes'] / 1e6:+.0f} MB against upstream (spread "
        f"{rs['peak_spread_bytes'] / 1e6:.0f} MB), the caches holding {rs['cache_bytes_saved'] / 1e6:.0f} MB less. A "
        f"{growth['params']['prefill']} + {growth['params']['steps']}-step request at the {growth['params']['preset']} "
        f"base LM's geometry moves its cache {growth['summary']['moves']} times"
        + ("" if growth["summary"].get("right_sized", True) else " (it holds all max_length slots here)") + " "
        f"({growth['summary']['step_total_s']:.2f} s in `step()` over the whole request; upstream zero-fills "
        f"{growth['params']['max_length']} slots per request instead, {growth['summary']['upstream_fill_ms']:.1f} ms).",
        f"* The {wp['preset']} model in {wp['dtype']}, {wp['steps']} steps: {whole['median_wall_s']['upstream']:.1f} s "
        f"to {whole['median_wall_s']['patched']:.1f} s, {_ci(t['whole'])}, "
        f"{'bit-identical' if whole['identical'] else 'NOT identical'}"
        + (f" (Xeon: {xo('whole_decode_full')['median_wall_s']['upstream']:.1f} s to "
           f"{xo('whole_decode_full')['median_wall_s']['patched']:.1f} s, {xo('whole_decode_full')['ratio']:.2f}x)"
           if xo else "")
        + f". The LMs' decode attention is {share['lm_attention']:.0%} of upstream's wall time and the local DiT "
        f"{share['local_dit']:.0%}, so removing all attention time alone would leave about "
        f"{1 - share['lm_attention']:.2f}"
        + (f": no attention fix halves this {kind}'s wall time." if share["lm_attention"] < 0.5
           else "."),
        f"* Compiled (`torch.compile`, {comp['params']['backend']}, {comp['params']['preset']} preset, positions "
        f"{comp['params']['positions'][0]}-{comp['params']['positions'][-1]}): the patched step traced "
        f"{comp['graphs']['unique_graphs']} graphs (a recompile would add one) with {comp['graphs']['graph_breaks']} "
        "graph breaks (`04_patch_application` shows the published slice fix failing "
        "under upstream's `fullgraph=True`).",
    ]
    if other:
        from .report import compare, compare_markdown
        lines += ["", f"The two CPUs side by side (`python -m fastattn compare data/results/{ref.name} "
                      f"data/results/{other.name}`; the Xeon's records predate the cold sweeps and the stream):", "",
                  compare_markdown(compare([ref, other])).rstrip("\n")]
    return "\n".join(lines) + "\n"


def findings_table(ref: Path) -> str:
    """README's findings: one row per question, its measured answer on the reference machine (records only)."""
    from .bench.targets import met_count
    rec = lambda n: load_record(ref / f"{n}.json")  # noqa: E731
    tr = rec("targets")
    env, t = tr["env"], {x["id"]: x for x in tr["rows"]}
    stream, whole, kv, matrix = (rec(n) for n in ("stream_profile_full", "whole_decode_full", "kv_memory_full",
                                                  "backend_matrix"))
    mdt = runtime_dtype(env.get("device", "cpu"))
    masked = find_row(matrix["rows"], case="upstream: bool mask over full cache + GQA", dtype=mdt, head_dim=128)
    chosen = sorted({r["chosen"] for r in rec("exactness_calibration")["rows"]}, key=str)
    sp, wp = stream["params"], whole["params"]
    rows = [
        ("Does upstream's per-chunk cost grow along a stream (#293)?",
         f"{stream['verdict']['upstream']} over {sp['chunks']} chunks ({sp['preset']} model, {sp['dtype']})"
         + ("" if "trend" in stream else "; this record predates the trend verdict over repeats: one run's sixths")),
        (f"Which kernel runs upstream's masked {mdt} decode call?", f"`{masked['kernel']}`, over all {masked['keys']} "
         "slots"),
        ("Is the default fix bit-identical to upstream?",
         f"yes, by construction: windows of {', '.join(map(str, chosen))} keys (the CPU kernel's block)"
         if any(c is not None for c in chosen) else "yes: no window is exact here, so it keeps upstream's call"),
        ("One attention call at position 256, fp32: `exact` / upstream", _ci(t["exact_p256"])),
        ("A real-width decode step at position 256, bf16: patched / upstream", _ci(t["decode_bf16"])),
        (f"The whole {wp['preset']} model, {wp['dtype']}, {wp['steps']} steps: patched / upstream",
         f"{whole['median_wall_s']['upstream']:.1f} s -> {whole['median_wall_s']['patched']:.1f} s, {_ci(t['whole'])}"
         f", {'bit-identical' if whole['identical'] else 'NOT identical'}"),
        (f"KV of a {kv['params']['prefill'] + kv['params']['steps']}-token request",
         f"{kv['upstream_bytes'] / 1e6:.0f} MB -> {kv['patched_bytes'] / 1e6:.0f} MB"),
    ]
    if (ref / "dtype_decode_full.json").exists():
        from .bench.metrics import dtype_recommendation
        dd = rec("dtype_decode_full")
        r = dtype_recommendation(dd, dd.get("flags"))
        others = ", ".join(f"{d} {x:.2f}x" for d, x in r["others"].items() if d != r["default"])
        rows.append(("Which dtype should this CPU run?", f"{r['dtype']}{' with the fix' if r['patched'] else ''} "
                     f"({r['ratio']:.2f}x of voxcpm's default step; upstream in {others})"))
    if (ref / "decode_forms_bfloat16.json").exists():
        rows.append(("Compiled (fullgraph), bf16: the fastest static-shape decode form", forms_answer(
            rec("decode_forms_bfloat16"))))
    rows.append(("Targets met", f"{met_count(tr['rows'])} (`targets.json` says why each miss)"))
    machine = f"{env['threads']}-core {env['device_name']} ({env['cpu_capability']}, torch {env['torch']})"
    head = [f"Measured on a {machine}: the committed reference run `data/results/{ref.name}/`. Every figure, its "
            "interval and n, in prose: [docs/results.md](docs/results.md).", "",
            "| question | measured |", "|---|---|"]
    return "\n".join(head + [f"| {q} | {a} |" for q, a in rows]) + "\n"


HEADLINE = "headline.png"
DTYPE_BEGIN, DTYPE_END = "<!-- dtype:begin -->", "<!-- dtype:end -->"
FORMS_BEGIN, FORMS_END = "<!-- forms:begin -->", "<!-- forms:end -->"


def forms_answer(rec: dict, verdict: dict | None = None) -> str:
    """One line from a ``decode_forms`` record (and its :func:`~fastattn.experiments.decode_forms.form_verdict`,
    computed here where not given): the winner, the runner-up's time over it, decided or not."""
    from .experiments.decode_forms import form_verdict
    v = verdict or form_verdict(rec)
    if v["runner_up"] is None:
        return f"`{v['winner']}` (the only eligible form)" if v["winner"] else "no eligible form"
    lo = min(x["ratio"] for x in v["per_position"].values())
    hi = max(x["ratio"] for x in v["per_position"].values())
    ps = rec["params"]["positions"]
    where = ("decided at every position" if v["decided"] else
             f"decided at {', '.join(map(str, v['decided_at'])) or 'no position'}"
             + "".join(f"; `{f}` faster at {p}" for p, f in v["other_winners"].items()))
    return (f"`{v['winner']}`; `{v['runner_up']}` takes {v['margin']:.2f}x its time ({lo:.2f}x-{hi:.2f}x over "
            f"positions {ps[0]}-{ps[-1]}), {where}")


def forms_machines(results: Path) -> str:
    """``upstream-PR.md``'s table of the compiled decode forms: per machine folder and dtype with a
    ``decode_forms_<dtype>.json`` record, the verdict (:func:`forms_answer`); a line saying none exists otherwise."""
    paths = sorted(results.glob("*/decode_forms_*.json"))
    if not paths:
        return "No machine has a `decode_forms` record yet.\n"
    from .experiments.decode_forms import form_verdict
    out = ["| machine | dtype | fastest compiled form, margin | its max error vs float64 (upstream's) |",
           "|---|---|---|---|"]
    for path in paths:
        rec = load_record(path)
        verdict = form_verdict(rec)
        won = next((c for c in rec["checks"] if c["form"] == verdict["winner"]), None)
        err = f"{won['max_err']:.3g} ({won['reference_err']:.3g})" if won else "n/a"
        out.append(f"| `{path.parent.name}`: {rec['env'].get('device_name', '')} | {rec['params']['dtype']} | "
                   f"{forms_answer(rec, verdict)} | {err} |")
    return "\n".join(out) + "\n"


def dtype_machines(results: Path) -> str:
    """``upstream-PR.md``'s table: per machine folder under ``results`` with a whole-decode dtype comparison
    (``dtype_decode_full.json``), its CPU, native bf16, each dtype's median step against voxcpm's default and the
    weights' memory."""
    from .bench.metrics import dtype_table
    from .devices import native_bf16
    out = ["| machine | native bf16 | decode step, voxcpm's default | float32 / default (95% CI) | "
           "float32 + fix / default (95% CI) | weights GB |", "|---|---|---|---|---|---|"]
    for path in sorted(results.glob("*/dtype_decode_full.json")):
        rec = load_record(path)
        rows = {(r["dtype"], r["variant"]): r for r in dtype_table(rec)}
        key = next(k for k in next(iter(rows.values())) if k.startswith("x "))
        base = rows[(rec["params"]["dtypes"][0], "upstream")]
        ci = lambda r, key=key: f"{r[key]:.2f}x ([{r['95% low']:.2f}, {r['95% high']:.2f}], n={r['n']})"  # noqa: E731
        out.append(f"| `{path.parent.name}`: {rec['env'].get('device_name', '')} | "
                   f"{ {True: 'yes', False: 'no', None: 'n/a'}[native_bf16(rec.get('flags') or {})]} | "
                   f"{base['dtype']} {base['step s']:.2f} s"
                   f" | {ci(rows[('float32', 'upstream')])} | {ci(rows[('float32', 'patched')])} | "
                   + ", ".join(f"{d} {r['weights GB']:.1f}" for (d, v), r in rows.items() if v == "upstream") + " |")
    return "\n".join(out) + "\n"


def headline_figure(ref: Path, path: Path) -> Path:
    """README's figure: a real-width decode step's cost against position in bf16, upstream flat, the fix growing
    with the position (the reference run's ``decode_step_bfloat16``), drawn by :func:`fastattn.plots.decode_step`."""
    import matplotlib
    matplotlib.use("Agg")
    from .plots import decode_step
    fig = decode_step(load_record(ref / "decode_step_bfloat16.json"))
    fig.savefig(path, dpi=90, bbox_inches="tight", metadata={"Software": None})
    import matplotlib.pyplot as plt
    plt.close(fig)
    return path


def _readme() -> Path:
    return Path(repo_root()) / "README.md"


def _results_md() -> Path:
    return Path(repo_root()) / "docs" / "results.md"


def current_block(path: Optional[Path] = None, begin: str = BEGIN, end: str = END) -> str:
    text = (path or _readme()).read_text()
    return text[text.index(begin) + len(begin):text.index(end)].strip("\n") + "\n"


def _replace_block(path: Path, block: str, begin: str = BEGIN, end: str = END) -> None:
    text = path.read_text()
    head, tail = text[:text.index(begin) + len(begin)], text[text.index(end):]
    path.write_text(head + "\n" + block + tail)


def main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="python -m fastattn readme", description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help="replace the block in README.md")
    args = ap.parse_args(argv)
    results = Path(data_dir()) / "results"
    block = findings_table(results / REFERENCE)
    if not args.write:
        print(block, end="")
        return 0
    _replace_block(_readme(), block)
    _replace_block(_results_md(), reference_findings(results / REFERENCE, results / OTHER))
    headline_figure(results / REFERENCE, results / HEADLINE)
    _replace_block(Path(data_dir()) / "upstream-PR.md", dtype_machines(results), DTYPE_BEGIN, DTYPE_END)
    _replace_block(Path(data_dir()) / "upstream-PR.md", forms_machines(results), FORMS_BEGIN, FORMS_END)
    return 0
