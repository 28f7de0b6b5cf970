"""The three upstream PRs, the comment for PR #395 and the reply to #293, written from committed records.

``python -m fastattn prs`` prints them; ``--write`` writes ``data/upstream-prs/*.md``, where a test checks they are
current. Each figure comes from one function below, reading ``data/results/``: :func:`machine_rows` (the right-sized
decode per machine), :func:`matrix_rows` (the exactness contract per torch), :func:`upstream_check` (the diffs on
upstream's trees and upstream's own tests), :func:`slice_evidence` (the slice fix under ``fullgraph``),
:func:`import_cost` (``import voxcpm`` with the live diff); the dtype and forms tables are :mod:`fastattn.readme`'s.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from .bench.records import load_record
from .paths import data_dir
from .readme import REFERENCE

__all__ = ["machine_rows", "matrix_rows", "upstream_check", "slice_evidence", "import_cost", "documents", "main",
           "REPO"]

REPO = "<link to this repository>"  # set where the PRs are posted: the records, kits and method live there
PRS = "upstream-prs"


def _results() -> Path:
    return Path(data_dir()) / "results"


def _newest(folder: Path, pattern: str) -> list:
    """The newest record per stem (``name.json``, ``name-2.json``, ...) in ``folder``."""
    best = {}
    for p in sorted(folder.glob(pattern), key=lambda p: p.stat().st_mtime):
        best[p.stem.rsplit("-", 1)[0] if p.stem.rsplit("-", 1)[-1].isdigit() else p.stem] = p
    return [load_record(p) for _, p in sorted(best.items())]


def _machine(env: dict) -> str:
    return (f"{env['threads']}-core {env['device_name']} ({env.get('cpu_capability', '?')}), "
            f"torch {env['torch'].split('+')[0]}")


#: targets.json rows written before targets had ids, by their target text (up to the colon)
_OLD_IDS = {"decode step p=256 (bfloat16, hidden 2048)": "decode_bf16", "decode step p=256 (float32, hidden 2048)":
            "decode_fp32", "whole decode (full, bfloat16, 12 steps)": "whole"}


def machine_rows() -> list:
    """Per machine folder with a whole decode: KV MB of a 300-token request (upstream, patched), the decode step at
    p=256 (bf16, fp32) and the whole decode as targets.json judged them, and whether the outputs were identical."""
    rows = []
    for tr in sorted(_results().glob("*/targets.json")):
        t = {r.get("id") or _OLD_IDS.get(r["target"].split(":")[0]): r for r in load_record(tr)["rows"]}
        kv = load_record(tr.parent / "kv_memory_full.json")
        whole = load_record(tr.parent / "whole_decode_full.json")
        kv_mb = (kv["upstream_bytes"] / 1e6, kv["patched_bytes"] / 1e6)
        rows.append({"machine": _machine(whole["env"]), "kv_mb": kv_mb,
                     "step_bf16": t["decode_bf16"], "step_fp32": t["decode_fp32"], "whole": t["whole"],
                     "identical": whole["identical"], "steps": whole["params"]["steps"],
                     "reference": tr.parent.name == REFERENCE})
    return rows


def _ratio(t: dict) -> str:
    ci = "" if t.get("ci_low") is None else f" [{t['ci_low']:.2f}, {t['ci_high']:.2f}]"
    return f"{t['measured']:.2f}x{ci}" + (f", n={t['n']}" if t.get("n") else " (no interval recorded)")


def matrix_rows() -> list:
    """The exactness contract per torch (newest record per version): kernel, windows, decodes, kit tests, slice."""
    out = []
    for rec in _newest(_results() / "torch-matrix", "exactness-*.json"):
        by = {(r["check"], r["dtype"]): r for r in rec["rows"]}

        def ok(check, by=by):  # None: not run by this record's script
            got = [by.get((check, d), {}).get("identical") for d in ("float32", "bfloat16")]
            return None if None in got else all(got)
        kits = by[("kit tests, diffs stacked", None)]
        out.append({"torch": rec["env"]["torch"].split("+")[0], "python": rec["env"]["python"],
                    "kernel": by[("sdpa kernel", "float32")].get("kernel", "?").replace("cpu ", ""),
                    "windows": ok("windows vs whole cache"), "diff": ok("decode through the diff"),
                    "forced": ok("decode, 512-slot windows forced"),
                    "forced_diff": max(by.get(("decode, 512-slot windows forced", d), {}).get("max_abs_diff", 0)
                                       for d in ("float32", "bfloat16")),
                    "slots": by[("decode through the diff", "float32")].get("capacity"),
                    "exact": ok("decode, exact patch"), "kits": (kits.get("passed"), kits.get("failed")),
                    "slice": by[("slice fix under fullgraph", None)], "machine": _machine(rec["env"])})
    return sorted(out, key=lambda r: tuple(int(x) for x in r["torch"].split(".")))


def matrix_table() -> str:
    yes = {True: "yes", False: "**no**", None: "not run"}
    lines = ["| torch | Python | SDPA kernel (CPU) | cache slots after the decode | decode through the diff = "
             "upstream (fp32 and bf16) | the same with 512-slot windows forced | kit tests, diffs stacked |",
             "|---|---|---|---|---|---|---|"]  # the contract, per torch
    lines += [f"| {r['torch']} | {r['python']} | {r['kernel']} | {r['slots']} | {yes[r['diff']]} | "
              f"{yes[r['forced']]} | {r['kits'][0]} passed, {r['kits'][1]} failed |" for r in matrix_rows()]
    return "\n".join(lines)


def math_versions() -> str:
    """What every matrix record says about the torch versions whose CPU runs this call through the math kernel:
    how often a decode with 512-slot windows (forced, or the diff's own before the version gate) matched upstream."""
    runs = {}
    for p in sorted((_results() / "torch-matrix").glob("exactness-*.json")):
        rec = load_record(p)
        if any(r.get("kernel", "").endswith("MATH") for r in rec["rows"]):
            runs.setdefault(rec["env"]["torch"].split("+")[0], []).extend(
                r for r in rec["rows"] if r["check"] == "decode, 512-slot windows forced"
                or (r["check"] == "decode through the diff" and r.get("capacity") not in (None, 8192)))
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
    and upstream's own tests on main, patched and not."""
    rec = _newest(_results() / "upstream", "upstream-check-*.json")[-1]
    rows = rec["rows"]
    trees = {r["tree"]: all(x["applies"] for x in rows if x["tree"] == r["tree"] and "applies" in x)
             for r in rows if "applies" in r}
    tests = {r["check"]: r for r in rows if "passed" in r}
    return {"commits": rec["params"]["commits"], "applies": trees, "tests": tests}


def slice_evidence() -> tuple:
    """(English, Chinese): on which torch versions the slice to ``position + 1`` compiled under ``fullgraph``."""
    rows = matrix_rows()
    if not rows:
        return "", ""
    no = [r["torch"] for r in rows if r["slice"].get("compiles") is False]
    yes = [r["torch"] for r in rows if r["slice"].get("compiles")]
    en = f"Measured on CPU: torch {', '.join(no) or 'none'} refuse it"
    zh = f"在 CPU 上实测：torch {'、'.join(no) or '无'} 拒绝编译"
    if yes:
        en += (f"; torch {', '.join(yes)} compiles it, with a length the host does not know (which a CUDA graph "
               "cannot hold, by a reading of torch's sources)")
        zh += f"；torch {'、'.join(yes)} 能编译，但长度在主机侧未知（按 torch 源码，CUDA graph 无法容纳）"
    return en + ".", zh + "。"


def import_cost() -> Optional[dict]:
    """The newest ``import_cost`` record (``import voxcpm`` in fresh processes), or None."""
    recs = _newest(_results() / "upstream", "import-cost-*.json")
    return recs[-1] if recs else None


def _tests_line(kit_test: str) -> list:
    """How the PR's tests were run: upstream's own suite on main with the three diffs, and the kits' tests."""
    u = upstream_check()
    own = u["tests"]["upstream's own tests/, the three diffs stacked"]
    orig = u["tests"]["upstream's own tests/, unmodified"]
    same = "the same failures" if own["failed_tests"].keys() == orig["failed_tests"].keys() else "other failures"
    fails = ", ".join(f"`{n}`" for n in own["failed_tests"]) or "none"
    return [f"- `tests/{kit_test}` passes with this change on main ({u['commits']['main'][:7]}) and fails without it.",
            f"- Upstream's own `tests/` on main {u['commits']['main'][:7]} with the three PRs applied: {own['passed']} "
            f"passed, {own['failed']} failed ({fails}); unmodified main gives {same} (this machine has no torchaudio)."]


def _applies() -> str:
    u = upstream_check()
    names = {"main": f"main {u['commits']['main'][:7]}", "tag-2.0.3": "the 2.0.3 tag",
             "pr325": f"#325's merge ref {u['commits']['pr325'][:7]}"}
    ok = [names[t] for t, a in u["applies"].items() if a]
    bad = [names[t] for t, a in u["applies"].items() if not a]
    return (f"Applies alone and stacked with the other two PRs in every order on {', '.join(ok)}"
            + (f"; not on {', '.join(bad)}" if bad else "") + ".")


def _stream_line() -> str:
    s = load_record(_results() / REFERENCE / "stream_profile_full.json")
    six, p = s["sixths"]["upstream"], s["params"]
    return (f"a {p['chunks']}-chunk stream on {_machine(s['env'])} ({p['weights']} weights) takes {six[0] / 1e3:.2f} s "
            f"per chunk in its first sixth and {six[-1] / 1e3:.2f} s in its last, with or without this change")


def right_sized_pr() -> str:
    rows = machine_rows()
    table = ["| machine | KV of a 300-token request | decode step at position 256, bf16 / fp32 (patched / upstream, "
             "95% CI) | whole decode (patched / upstream) | outputs |", "|---|---|---|---|---|"]
    table += [f"| {r['machine']} | {r['kv_mb'][0]:.0f} MB -> {r['kv_mb'][1]:.0f} MB | {_ratio(r['step_bf16'])} / "
              f"{_ratio(r['step_fp32'])} | {_ratio(r['whole'])} ({r['steps']} steps) | "
              f"{'identical' if r['identical'] else '**differ**'} |" for r in rows]
    return "\n".join([
        "# MiniCPM4 decode: a KV cache sized to the request, same outputs", "",
        "`StaticKVCache` allocates and zero-fills `max_length` (8192) slots for every request, and every decode step "
        "attends over all of them under a mask. A 300-token request pays for 8192 slots at every step.", "",
        "## What changes (`modules/minicpm4/cache.py`, `model.py`)", "",
        "- `StaticKVCache` keeps its name, constructor and methods, plus `granularity: Optional[int] = None`. "
        "A request starts at its prefill rounded up to `granularity`, doubles when decoding reaches the end, "
        "shrinks for a shorter request, and only slots an earlier request wrote are cleared. `kv_cache` is a view "
        "over the valid length rounded up to `granularity`.",
        "- `granularity` is 512 on CPU with torch >= 2.9, where SDPA runs this masked grouped-query call through "
        "its flash kernel, which walks keys in blocks of 512 (`aten/src/ATen/native/cpu/FlashAttentionKernel.cpp`, "
        "`flash_attention_kernel_impl`: `kv_split_size` 512). A window of 512-slot multiples hands it the same "
        "blocks; the whole cache's extra blocks are fully masked and add exact zeros.",
        "- Elsewhere `granularity` is `max_length`: on CUDA (and older torch on CPU) the step still attends over all "
        "8192 slots, as today; a later request clears `[length, written)` instead of the whole cache.",
        "- `forward_step` keeps the mask and calls `.contiguous()` only on MPS (a no-op on today's cache; on a window "
        "it would copy the window).", "",
        "## Measured (CPU only, random weights, the full VoxCPM2 architecture, bf16 unless noted)", ""] + table + [
        "", f"The contract per torch, where measured ({matrix_rows()[0]['machine'].split(', torch')[0]}; the tiny "
        "model, a ~430-token prompt and 120 steps, so the window crosses 512): a whole decode through this diff "
        "`torch.equal` to upstream's in float32 and bfloat16, the same with 512-slot windows forced, and the tests:",
        "", matrix_table(), "",
        math_versions(), "",
        "## What it does not do", "",
        "- Nothing changes on CUDA except the memset; no GPU was measured.",
        f"- It does not fix #293's slowdown: {_stream_line()}.", "",
        "## Related", "",
        "- #199 (closed) and #395 (open) slice to `position + 1` without the mask, on the same lines as this PR. That "
        "is faster per eager step, but changes the kernel's key blocks (not bit-identical), and under `optimize()` "
        "its length is data-dependent (details on #395).",
        "- #363/#366 (a fork): hoisting the mask and skipping the zero-fill matched 8/8 output hashes on CUDA; a "
        "256-slot window matched 0/10 and ran 12% slower on CUDA. That is why CUDA keeps the whole cache here.",
        f"- {_applies()}", "", "## Tests", ""] + _tests_line("test_minicpm4_right_sized_cache.py") + [
        "", f"Records, method and the patched sources: {REPO}", ""]).replace("\n\n\n", "\n\n")


def dtype_pr() -> str:
    from .bench.decode import dtype_table
    from .devices import native_bf16
    from .readme import dtype_machines
    recs = [load_record(p) for p in sorted(_results().glob("*/dtype_decode_full.json"))]
    natives = [native_bf16(r.get("flags") or {}) for r in recs]
    def fp32_ratio(rec):
        row = next(x for x in dtype_table(rec) if (x["dtype"], x["variant"]) == ("float32", "upstream"))
        return next(v for k, v in row.items() if k.startswith("x "))
    seen = "; ".join(f"{'with' if n else 'without'} native bf16, float32 takes {fp32_ratio(r):.2f}x the default's "
                     "step" for r, n in zip(recs, natives))
    return "\n".join([
        "# `VOXCPM_CPU_DTYPE`: an opt-in dtype on CPU", "",
        "On CPU voxcpm runs the checkpoint's bfloat16 and there is no way to choose float32, as `VOXCPM_MPS_DTYPE` "
        "allows on MPS. On a CPU without native bfloat16 instructions torch runs bfloat16 through float32 conversions.",
        "", "## What changes (`model/utils.py`)", "",
        "- `pick_runtime_dtype` honours `VOXCPM_CPU_DTYPE` on CPU. Unset, nothing changes on any device.",
        "- One helper, `_dtype_override(name)`, reads and validates both variables: same values, same error "
        "(`VOXCPM_MPS_DTYPE='x' is not one of [...]`) as today.",
        "- The docstring's first paragraph now says CPU keeps the checkpoint's dtype unless the variable is set.", "",
        "## Measured (whole decodes, full architecture, random weights)", "", dtype_machines(_results()).strip(), "",
        f"Measured on {len(recs)} machine(s): {seen}. No CPU without native bf16 was measured, and that is the case "
        "this is for, so the docstring only says float32 *may* be faster there.", "",
        "## What it does not do", "",
        "- It changes no default. float32 doubles the weights' memory (table) and rounds differently: audio changes.",
        "- It is not a fix for #293.", "", "## Related", "",
        "- #199, #395, #325 and #363/#366 do not touch `model/utils.py`. " + _applies(),
        "- A README line (EN and ZH) can follow: `VOXCPM_CPU_DTYPE=float32` on CPUs without native bf16; about 2x "
        "the weights' memory.", "", "## Tests", ""] + _tests_line("test_cpu_dtype_override.py")[:1] + [
        "  It loads `utils.py` by path with a `transformers` stub, as `tests/test_model_utils.py` does, and can be "
        "folded into that file.", _tests_line("test_cpu_dtype_override.py")[1], "",
        f"Records and method: {REPO}", ""])


def _import_line() -> str:
    rec = import_cost()
    if rec is None:
        return "- `import voxcpm` cost: not measured yet."
    by = {r["variant"]: r for r in rec["summary"]}

    def vs(name):
        r, (lo, hi) = by[name], by[name]["x_2.0.3_ci"]
        said = "undecided" if lo <= 1 <= hi else ("slower" if lo > 1 else "faster")
        return (f"{r['x_2.0.3']:.2f}x [{lo:.2f}, {hi:.2f}] ({said}), peak RSS {r['rss_mb']:.1f} MB, FlexAttention "
                f"{'loaded' if r['flex_loaded'] else 'not loaded'}")
    return (f"- `import voxcpm` in fresh processes after `import torch` ({_machine(rec['env'])}, "
            f"n={by['live diff']['n']} each, interleaved), against unpatched ({by['2.0.3']['median_s']:.2f} s, "
            f"{by['2.0.3']['rss_mb']:.1f} MB): this diff {vs('live diff')}; the diff with FlexAttention imported "
            f"at module level {vs('live diff, flex imported at module level')}.")


def live_pr() -> str:
    from .readme import forms_machines
    from .upstream import LIVE_ERROR_BOUND
    return "\n".join([
        "# Opt-in `VOXCPM_DECODE_ATTENTION=live`: decode attention over the valid keys only, under `optimize()` too",
        "", "**Status: held until it has GPU numbers.** Everything below was measured on CPU.", "",
        "The masked decode call reads all `max_length` slots every step. The slice to `position + 1` (#199, #395) "
        "reads only the valid keys, but under `optimize()`'s `fullgraph=True` its length is data-dependent. "
        + slice_evidence()[0], "", "## What changes (`modules/minicpm4/model.py` only)", "",
        "- `VOXCPM_DECODE_ATTENTION` (`masked`, the default: today's call; or `live`) is read and validated once, "
        "when a `MiniCPMModel` is built, for both LMs; `model.set_decode_attention(mode)` switches a built model.",
        "- `live`, eager: SDPA over keys `[0, position]` without a mask. `MiniCPMModel.forward_step` passes the "
        "position from the host (`kv_cache.current_length - 1`), so no layer reads the position tensor back (on CUDA "
        "that was a sync per layer). On CUDA cuDNN is left out of this call (flash, efficient or math): cuDNN builds "
        "a plan for every new key length, and from torch 2.11 it comes first on Hopper.",
        "- `live`, compiled: FlexAttention over the whole cache with a block mask made in the graph from the position "
        "tensor (full blocks, then the one partial block): static shapes, no host read, one graph for a whole decode.",
        "- FlexAttention is imported only when `live` is set. A torch without `flex_attention(enable_gqa=)` is refused "
        "then, with a clear error. torch 2.5 has no `BlockMask.from_kv_blocks(seq_lengths=)`: there the cache must "
        "be a multiple of 128 slots (8192 is). `compute_q_blocks=False` where torch has it.",
        "- `config.py` is untouched, so this applies on top of #325.", "", "## Measured (CPU)", "",
        f"- Accuracy (tests): one attention step in `live` is within {LIVE_ERROR_BOUND}x `masked`'s worst error "
        "against float64, at every key count around each 128-key block edge, in float32 and bfloat16.",
        _import_line(),
        "- The compiled forms at VoxCPM2's head geometry (16 query heads, 2 KV heads, 128 dims, 8192 slots), "
        "inductor, timed interleaved; `flex_decode` is this PR's form:", "", forms_machines(_results()).strip(), "",
        "## What it does not do", "",
        "- No GPU has run it: no CUDA timing, no CUDA-graph count, no audio-quality check over prompts. A fork "
        "(#363/#366) measured a sliced window 12% slower on CUDA, so a CUDA speedup cannot be assumed.",
        "- `live` is not bit-identical to `masked` (a free-running decode can drift within rounding; the stop step can "
        "move), so it is opt-in. It is not a fix for #293.", "", "## Related", "",
        "- If #395 is merged, this PR's eager path duplicates it and the PR reduces to making it survive `fullgraph`.",
        f"- {_applies()}", "", "## Tests", ""] + _tests_line("test_minicpm4_decode_attention.py") + [
        "- The inductor compile test is marked `slow` and runs on CUDA only; on CPU a counting backend checks the "
        "one graph.", "", f"Records and method: {REPO}", ""])


def comment_395() -> str:
    rows = matrix_rows()
    table = ["| torch (CPU) | `fullgraph=True` compile of the slice |", "|---|---|"]
    table += [f"| {r['torch']} | " + ("compiles" if r["slice"].get("compiles") else
                                      f"refused: `{r['slice'].get('error', '?')[:90]}`") + " |" for r in rows]
    return "\n".join([
        "Thanks for picking up #293. One thing to check before merging: on Linux with CUDA and triton, voxcpm's "
        "`optimize()` compiles `forward_step` with `fullgraph=True`, and a slice whose length is read from the "
        "`position_id` tensor is data-dependent.", "",
        "**What we ran** (CPU only): this PR's attention lines (`key_cache[:, :, : position_id + 1]`, a 1-element "
        "position tensor as voxcpm's loop passes it) under `torch.compile(..., fullgraph=True)`:", ""] + table + [
        "", "**What we only read, not ran** (torch's sources, CUDA):",
        "- before torch 2.14, SDPA's CUDA kernel selector guards on the unbacked length: the same refusal is expected "
        "on CUDA, and `torch.compile` is lazy, so it would surface at the first generate after model load;",
        "- from torch 2.14 it should compile on CUDA, but inductor runs a graph holding an unbacked length without a "
        "CUDA graph (`reduce-overhead` loses its graph).", "",
        "So on the default GPU path this change may fail at load or lose the CUDA graph; with `optimize=False` (and "
        "on Windows without triton) it is the eager speedup #199 measured. It also changes which key blocks the "
        "kernel reduces over, so outputs are not guaranteed to match today's bit for bit. Two PRs (links) keep "
        "today's outputs with a right-sized cache, and offer an opt-in that compiles (FlexAttention with a block "
        "mask built in the graph). Happy to help test on a GPU.", ""])


def reply_293_text() -> str:
    from .experiments.root_cause import diagnosis, reply_293
    stream = load_record(_results() / REFERENCE / "stream_profile_full.json")
    return reply_293(diagnosis(stream), stream, slice_evidence()) + "\n"


def documents() -> dict:
    """``{file name under data/upstream-prs: text}``."""
    return {"1-right-sized-decode.md": right_sized_pr(), "2-cpu-dtype.md": dtype_pr(),
            "3-live-decode-attention.md": live_pr(), "comment-395.md": comment_395(), "reply-293.md": reply_293_text()}


def main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="python -m fastattn prs", description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help=f"write data/{PRS}/*.md")
    args = ap.parse_args(argv)
    for name, text in documents().items():
        if args.write:
            (Path(data_dir()) / PRS).mkdir(exist_ok=True)
            (Path(data_dir()) / PRS / name).write_text(text)
            print(Path(data_dir()) / PRS / name)
        else:
            print(f"===== {name}\n{text}")
    return 0
