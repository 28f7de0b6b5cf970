"""Every checkable claim of the three seeds, with this device's verdict from a run's records (notebook 02, summary).

Verdicts come from a run folder's records and findings plus a few millisecond measurements, never typed in. An
interval across its bound reads UNDECIDED; a run below the claim's scale (device, weights, steps) NOT_SCALE."""

from __future__ import annotations

import inspect
import statistics
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import torch

from fastattn.models import MAX_LENGTH

from .bench.metrics import dtype_recommendation, kv_mb, patched_is_upstream, step_ratio, whole_ratio
from .bench.records import Run, find_row, load_run
from .bench.stats import NO, YES, fmt_ci, quiet, ratio_ci, scaled_ci, verdict
from .bench.stream import stream_trends
from .bench.trend import describe
from .machine import runtime_dtype
from .paths import load_published

HOLDS, FAILS, NOT_HERE, NOT_RUN = "holds", "does not hold", "not measurable here", "not measured in this run"
UNDECIDED, PARTLY, NOT_SCALE = "undecided", "holds in part", "not measured at its scale"
#: the chunk count #293's decay is reported after
SYMPTOM_CHUNKS = 400
MATH_OP = "aten::_scaled_dot_product_attention_math"


def math_fallback_reason(up: dict, no_gqa: Optional[dict]) -> tuple:
    """``(holds, why)`` for "a bool attn_mask makes SDPA fall back to MATH", from the matrix's upstream row and its
    "bool mask, no enable_gqa" row: where only the latter runs a fused kernel, GQA is the cause, not the mask."""
    if up["kernel"] != MATH_OP:
        return False, f"a fused kernel takes the bool mask, but still reads all {up['keys']} keys"
    if no_gqa is not None and no_gqa["kernel"] != MATH_OP:
        return False, (f"the math kernel runs, but the same bool mask without enable_gqa (K/V repeated) runs "
                       f"{no_gqa['kernel']}: the fallback is caused by GQA, not by the mask")
    return True, "the bool mask forces the math kernel" + ("" if no_gqa is None else ", with or without GQA")


def math_fallback_verdict(up: dict, no_gqa: Optional[dict]) -> tuple:
    """``(verdict, evidence)`` of the same claim, as the ledger and 02 print it."""
    holds, why = math_fallback_reason(up, no_gqa)
    return (HOLDS if holds else FAILS,
            f"{up['dtype']} upstream call ran {up['kernel']} (dispatcher: {up['backend']}): {why}")


def _first(recs, kind, **params):
    """The record of ``kind`` with ``params`` a claim reads: the first in :class:`records.Run`'s order (its latest)."""
    return next((r for r in recs.get(kind, []) if all(r["params"].get(k) == v for k, v in params.items())), None)


def within(ci, lo: float, hi: float) -> str:
    """:func:`stats.verdict` in the ledger's words: HOLDS inside ``[lo, hi]``, FAILS wholly outside, else UNDECIDED."""
    return {YES: HOLDS, NO: FAILS}.get(verdict(ci, lo, hi), UNDECIDED)


def _unpaired(a: dict, b: dict) -> tuple:
    """``(median ratio, 95% interval)`` of two timed rows from different timings (quiet samples of each)."""
    qa, qb = (quiet(r["samples_ms"], r.get("disturbed_flags")) for r in (a, b))
    return statistics.median(qa) / statistics.median(qb), ratio_ci(qa, qb, paired=False)


#: the seed's own end-to-end record (data/published/pr199.csv): 951 -> 699 s over min_len=3500 on CUDA
END_TO_END_STEPS = 3500


def _off_scale(rec: dict, evidence: str, *, real_weights: bool = False, min_steps: Optional[int] = None,
               claim_on: str = "a CUDA GPU") -> Optional[tuple]:
    """``(NOT_SCALE, why and what ran)`` off a CUDA claim's scale (device, random weights, fewer steps), else None."""
    why = [] if _device(rec) == "cuda" else [f"measured on {_device(rec)}, the claim on {claim_on}"]
    if real_weights and rec["params"].get("weights", "random") != "checkpoint":
        why.append("random weights, the claim on the real checkpoint")
    if min_steps and rec["params"].get("steps", 0) < min_steps:
        why.append(f"{rec['params'].get('steps')} steps, the claim over {min_steps}+")
    return (NOT_SCALE, f"{'; '.join(why)}. What ran: {evidence}") if why else None


def _symptom(recs, finds):
    s = _first(recs, "stream_profile")
    if not s:
        return NOT_RUN, "01_root_cause measures it (bench.stream_profile)"
    t, n = stream_trends(s).get("upstream"), s["params"]["chunks"]
    sp = s["params"]
    where = (f"upstream over {n} chunks ({sp.get('preset')} preset, {sp.get('dtype', 'bfloat16')}, "
             f"{sp.get('weights', 'random')} weights, {_device(s)})")
    if n < SYMPTOM_CHUNKS:
        return NOT_SCALE, f"({n} of {SYMPTOM_CHUNKS}+ chunks) {where}: the claim is about chunk {SYMPTOM_CHUNKS} on"
    off = _off_scale(s, f"{where}: {describe(t) if t else s.get('verdict', {}).get('upstream')}", real_weights=True,
                     claim_on="CUDA (the post names no GPU)")
    if off:
        return off
    if t is None:  # a record from before the trend verdict: one run's sixths, which one burst decides
        return NOT_RUN, f"{where}: this record has no trend verdict (one run's sixths cannot decide it); rerun 01"
    return {"inconclusive": NOT_HERE, "grows": HOLDS}.get(t["verdict"], FAILS), f"{where}: {describe(t)}"


def _mask_alloc(recs, finds):
    m = _first(recs, "backend_matrix")
    up = find_row(m["rows"], case="upstream: bool mask over full cache + GQA") if m else None
    if not up:
        return NOT_RUN, "02_backend_selection measures it"
    return (HOLDS if up["mask"].startswith("bool") else FAILS,
            f"upstream's call passes a {up['mask']} mask over {up['keys']} keys")


def _contiguous(recs, finds):
    from voxcpm.modules.minicpm4.cache import StaticKVCache
    k, _ = StaticKVCache(2, 2, 16, 1, "cpu", torch.float32, max_length=64).get_layer_cache(1)
    same = k.contiguous().data_ptr() == k.data_ptr()
    return (HOLDS if same else FAILS, f"a layer view of StaticKVCache is contiguous: {k.is_contiguous()}; "
            f".contiguous() returns the same storage: {same}")


def _device(rec: dict) -> str:
    """The device type a record was measured on ("cpu" for records that predate the field)."""
    return str(rec.get("env", {}).get("device") or "cpu").split(":")[0]


def runtime_rows(rows: list, device) -> list:
    """A backend matrix's rows in voxcpm's runtime dtype on ``device`` (bf16 on CPU and CUDA); all where it has none."""
    dt = runtime_dtype(device)
    return [r for r in rows if r["dtype"] == dt] or rows


def _matrix_row(recs, case):
    """02's recorded matrix row of ``case`` in voxcpm's runtime dtype on its device (:func:`runtime_rows`)."""
    m = _first(recs, "backend_matrix")
    rows = runtime_rows(m["rows"], _device(m)) if m else []
    return next((r for r in rows if r["case"].startswith(case)), None)


def _math_fallback(recs, finds):
    up = _matrix_row(recs, "upstream")
    if not up:
        return NOT_RUN, "02_backend_selection measures it"
    return math_fallback_verdict(up, _matrix_row(recs, "bool mask, no enable_gqa"))


def _slice_flash(recs, finds):
    """The slice *lets* flash run only where upstream's masked call does not already run it."""
    fast, up = _matrix_row(recs, "fast"), _matrix_row(recs, "upstream")
    if not fast:
        return NOT_RUN, "02_backend_selection measures it"
    flash = lambda r: bool(r and r["kernel"] and "flash" in r["kernel"])  # noqa: E731
    line = f"{fast['dtype']} sliced call ran {fast['kernel']}"
    if not flash(fast):
        return FAILS, line
    if flash(up):
        return PARTLY, f"{line}, as upstream's masked call already does here: the slice is not what lets flash run"
    return HOLDS, line + (f"; upstream's masked call ran {up['kernel']}" if up else "")


def _o_position(recs, finds):
    """The slice fix grows > 2x from first to last position (O(position)), upstream's call < 1.5x (O(max_length))."""
    a = next((r for r in recs.get("attention", []) if len(r["params"]["positions"]) > 2
              and any(x["mode"] == "slice_fix" for x in r["rows"])), None)
    if not a:
        return NOT_RUN, "05_profiling measures it (the attention sweep's slice_fix rows)"
    ps = sorted(a["params"]["positions"])
    at = lambda m, p: find_row(a["rows"], mode=m, position=p)  # noqa: E731
    (grows, gci), (flat, fci) = (_unpaired(at(m, ps[-1]), at(m, ps[1])) for m in ("slice_fix", "reference"))
    parts = [within(gci, 2, float("inf")), within(fci, 0, 1.5)]
    verdict = FAILS if FAILS in parts else HOLDS if parts == [HOLDS, HOLDS] else UNDECIDED
    return verdict, (f"{a['params']['dtype']}: the slice fix {grows:.3g}x {fmt_ci(gci)} from p={ps[1]} to p={ps[-1]}, "
                     f"upstream's call {flat:.3g}x {fmt_ci(fci)}")


#: what "~1e-6" is read as: the sliced call's error against float64, per dtype
ROUNDING_BOUND = 1e-5


def _rounding(recs, finds):
    """The sliced call vs float64 (head_dim 128) within ROUNDING_BOUND: in every dtype HOLDS, in float32 only PARTLY."""
    m, sweep = _first(recs, "backend_matrix"), _first(recs, "exactness_sweep")
    if not m:
        return NOT_RUN, "02_backend_selection measures it"
    worst = {r["dtype"]: r["max_abs_err"] for r in m["rows"] if r["case"].startswith("fast") and
             r["head_dim"] == 128}
    small = {dt: e <= ROUNDING_BOUND for dt, e in worst.items()}
    verdict = HOLDS if all(small.values()) else PARTLY if small.get("float32") else FAILS
    text = "; ".join(f"{dt} {e:.2g}" for dt, e in worst.items())
    if sweep:
        text += "; across 03's sweep, max |fast - upstream|: " + "; ".join(
            f"{dt} {max(r['fast_max_abs'] for r in sweep['rows'] if r['dtype'] == dt):.2g}"
            for dt in sorted({r["dtype"] for r in sweep["rows"]}))
    return verdict, (f"the sliced call vs float64: {text} (the stop-token shift is not measurable with random "
                     "weights)")


def _per_position(recs, finds):
    """The slice fix's step rows, else fastattn's ``exact`` step where it windows (CPU), never upstream's own call."""
    d = _first(recs, "decode_step", dtype="bfloat16")
    if not d:
        return NOT_RUN, "05_profiling measures it"
    variant = ("slice_fix" if any(r["variant"] == "slice_fix" for r in d["rows"]) else
               "patched" if _device(d) == "cpu" else None)
    if variant is None:
        return NOT_RUN, (f"this run's patched step is upstream's own call on {_device(d)} (no exact window) and "
                         "the slice fix's step was not timed (decode_step_sweep(slice_fix=True) times it)")
    sp = [(p, step_ratio(d, p, num="upstream", den=variant)) for p in d["params"]["positions"]]
    verdicts = [within(f.ci, 2.5, 3.5) for _, f in sp]
    verdict = HOLDS if HOLDS in verdicts else FAILS if set(verdicts) == {FAILS} else UNDECIDED
    text = ", ".join(f"p={p}: {f.value:.3g}x {fmt_ci(f.ci)}" for p, f in sp)
    who = "the slice fix" if variant == "slice_fix" else "fastattn's exact step (the slice fix was not timed here)"
    evidence = f"decode step speedup of {who}, bf16, {d['params']['layers']} real-width layers: {text}"
    return _off_scale(d, evidence) or (verdict, evidence)


def _end_to_end(recs, finds):
    w = _first(recs, "whole_decode")
    if not w:
        return NOT_RUN, "05_profiling measures it"
    if patched_is_upstream(w):
        return NOT_RUN, (f"this run's patched decode is upstream's own computation on {_device(w)} (no exact "
                         "window); the slice fix's whole decode was not timed")
    f = whole_ratio(w)  # patched / upstream wall time; "36% faster" is 1.36x speed (26.5% less time), read as written
    speed_ci = None if f.ci is None else (1 / f.ci[1], 1 / f.ci[0])
    evidence = (f"{w['params']['preset']} preset, {w['params']['dtype']}, {w['params']['steps']} steps, n={f.n}: "
                f"{1 / f.value:.2f}x the speed (95% CI {fmt_ci(speed_ci)}; "
                f"{'bit-identical' if w['identical'] else 'differs'})")
    return _off_scale(w, evidence, min_steps=END_TO_END_STEPS) or (within(speed_ci, 1.30, 1.42), evidence)


def _sdpa_kernel_process_wide(recs, finds):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    before = torch.backends.cuda.flash_sdp_enabled()
    with ThreadPoolExecutor(1) as pool, sdpa_kernel([SDPBackend.MATH]):
        flash = pool.submit(torch.backends.cuda.flash_sdp_enabled).result(5)  # read by another thread, inside
    return (HOLDS if before and flash is False else FAILS,
            f"inside sdpa_kernel([MATH]) in one thread, another thread sees flash enabled = {flash}")


def _default_exact(recs, finds):
    sweep, gen = _first(recs, "exactness_sweep"), finds.get("exact patch, generate(): waveform torch.equal to upstream")
    if not sweep and gen is None:
        return NOT_RUN, "03_causality_checks and 04_patch_application measure it"
    rows = sweep["rows"] if sweep else []
    ps = sorted({r["position"] for r in rows})
    parts = [f"exact == reference in {sum(r['exact_identical'] for r in rows)} of {len(rows)} calls ({len(ps)} "
             f"positions {ps[0]}-{ps[-1]} x {', '.join(sorted({r['dtype'] for r in rows}))}, capacity "
             f"{sweep['params']['capacity']})"] if sweep else []
    if gen is not None:
        parts.append(f"whole generate() torch.equal to upstream: {gen}")
    ok = all(r["exact_identical"] for r in rows) and gen is not False
    verdict = HOLDS if ok else FAILS
    reach = ps[-1] + 1 if sweep else None  # what was swept, not the capacity
    if ok and (reach is None or reach < MAX_LENGTH):  # past the sweep: 03's calibration at the block edges
        edges = _ladder_edges(_first(recs, "exactness_calibration"))
        verdict = HOLDS if edges else PARTLY
        parts.append(edges or (f"positions {reach} to {MAX_LENGTH - 1} were not swept here" if reach else
                               "no position sweep ran"))
    return verdict, "; ".join(parts)


def _ladder_edges(rec: Optional[dict]) -> Optional[str]:
    """03's calibration in words where its chosen window stayed bit-identical at every block edge to MAX_LENGTH."""
    rows = [r for r in (rec or {}).get("rows", []) if r["lq"] == 1 and r["candidate"] == r["chosen"]]
    if not rows or rec["params"]["capacity"] < MAX_LENGTH or not all(r["bit_identical"] for r in rows):
        return None
    return (f"03's calibration found the chosen {rows[0]['chosen']}-key window bit-identical to the full call at "
            f"every block edge up to {rec['params']['capacity']} ({', '.join(r['dtype'] for r in rows)})")


def position_cost(att: dict, mode: str = "reference") -> dict:
    """One mode's call cost, a sweep's first to last position: ``{first_ms, last_ms, growth, ci, verdict, line}``;
    ``verdict`` is "flat" (the interval of last / first within 1.5x), "grows" (wholly above) or "undecided"."""
    ps = sorted(att["params"]["positions"])
    first, last = (find_row(att["rows"], mode=mode, position=p) for p in (ps[0], ps[-1]))
    growth, ci = _unpaired(last, first)
    verdict, word = {HOLDS: ("flat", "stays flat"), FAILS: ("grows", "grows with the position"),
                     UNDECIDED: ("undecided", "neither stays within 1.5x nor clearly grows")}[within(ci, 0, 1.5)]
    line = (f"{mode}'s {att['params'].get('dtype', '')} call costs {first['median_ms']:.3g} ms at p={ps[0]} and "
            f"{last['median_ms']:.3g} ms at p={ps[-1]} ({growth:.3g}x, 95% CI {fmt_ci(ci)}, capacity "
            f"{att['params']['capacity']}): it {word}")
    return {"first_ms": first["median_ms"], "last_ms": last["median_ms"], "growth": growth, "ci": ci,
            "verdict": verdict, "line": line}


def _o_max_length(recs, finds):
    """A floor set by max_length (slice fix vs upstream at the first position) and growth (:func:`position_cost`)."""
    a = next((r for r in recs.get("attention", []) if any(x["mode"] == "slice_fix" for x in r["rows"])), None) or \
        next((r for r in recs.get("attention", []) if r["params"]["modes"][:1] == ["reference"]), None)
    if not a:
        return NOT_RUN, "01_root_cause and 05_profiling measure it"
    cost, p0 = position_cost(a), min(a["params"]["positions"])
    grows = within(cost["ci"], 0, 1.5)  # HOLDS: the cost stays flat
    sl = find_row(a["rows"], mode="slice_fix", position=p0)
    if sl is None:
        return (UNDECIDED if grows == HOLDS else grows), cost["line"] + "; the slice fix was not timed: the floor " \
            "is not judged"
    floor, fci = _unpaired(sl, find_row(a["rows"], mode="reference", position=p0))
    text = cost["line"] + f"; the slice fix at p={p0} costs {floor:.2g}x {fmt_ci(fci)} of upstream's: the floor is " \
        "max_length's"
    floor_holds = within(fci, 0, 0.5)
    if floor_holds != HOLDS:
        return floor_holds, text
    return {HOLDS: HOLDS, FAILS: PARTLY, UNDECIDED: UNDECIDED}[grows], text + (
        ", and on top of it the cost grows with the position" if grows == FAILS else "")


def _zero_fill_source(recs, finds):
    from voxcpm.modules.minicpm4.cache import StaticKVCache
    src = inspect.getsource(StaticKVCache.fill_caches)
    return (HOLDS if "zero_()" in src else FAILS,
            "the installed StaticKVCache.fill_caches calls kv_cache.zero_() over all max_length slots per request")


def _kv_sizes(recs, finds):
    kv = _first(recs, "kv_memory", dtype="float32", preset="full")
    if not kv:
        return NOT_RUN, "01_root_cause measures it"
    if not kv.get("right_sized", True):
        return NOT_HERE, f"{kv['note']}: a right-sized cache would change results here, so the default keeps them"
    up, pa = kv_mb(kv)
    return (HOLDS if 550 <= up <= 650 and 15 <= pa <= 45 else FAILS,
            f"full model, fp32, a {kv['params']['prefill'] + kv['params']['steps']}-token request: {up:.3g} MB -> "
            f"{pa:.3g} MB ({kv['note']})")


def _bit_identical(recs, finds):
    w = _first(recs, "whole_decode")
    if not w:
        return NOT_RUN, "05_profiling measures it"
    return (HOLDS if w["identical"] else FAILS), \
        f"{w['params']['preset']} preset whole decode, patched torch.equal to upstream: {w['identical']}"


def _zero_fill_cost(recs, finds):
    """Two parts: the zero-fill takes ~0.1-0.2 s, and that is a small share of a request."""
    fc, w = _first(recs, "fill_cost"), _first(recs, "whole_decode")
    up = find_row(fc["rows"], variant="upstream") if fc else None
    if not up or not w:
        return NOT_RUN, "01_root_cause (fill_cost) and 05_profiling (the whole decode) measure it"
    if _device(w) != "cpu":
        return NOT_HERE, f"a CPU claim; this run measured on {_device(w)}"
    ci = scaled_ci(quiet(up["samples_ms"], up.get("disturbed_flags")), 1e3) if "samples_ms" in up else None
    fill, wall = up["median_ms"] / 1e3, w["median_wall_s"]["upstream"]
    size = within(ci, 0.05, 0.3)
    theirs = next(r["before"] for r in load_published("seed003_per_request.csv")
                  if r["metric"] == "KV path per request incl. import scratch")
    text = (f"upstream's per-request zero-fill of the full base LM cache ({fc['params']['layers']} layers): "
            f"{fill * 1e3:.3g} ms (95% CI {fmt_ci(ci and (ci[0] * 1e3, ci[1] * 1e3))} ms), {fill / wall:.2%} of a "
            f"{wall:.3g} s, {w['params']['steps']}-step request here (their 0.1-0.2 s counts {theirs} MB incl. import "
            "scratch)")
    return (HOLDS if size == HOLDS else PARTLY if size == FAILS and fill / wall < 0.01 else size), text


def _default_dtype(recs, finds):
    d = _first(recs, "dtype_decode")
    if not d:
        return NOT_RUN, "05_profiling measures it (bench.dtype_decode)"
    r = dtype_recommendation(d, d.get("flags"))
    return (FAILS if r["decided"] and r["dtype"] != r["default"] else HOLDS), r["line"]


#: (source, claim, the scale it speaks of, judge: a function of the records, or the verdict where no record decides)
CLAIMS = [
    ("seed 000", "Streaming slows from ~0.3 s to 1-2 s per chunk after 400+ chunks (#293)",
     f"a stream of {SYMPTOM_CHUNKS}+ chunks on the reporter's machine (CUDA with optimize(); no GPU named), "
     "real weights", _symptom),
    ("seed 000", "Every step builds a bool mask over all max_length (8192) slots", "every decode step", _mask_alloc),
    ("seed 000", ".contiguous() on the layer caches is a no-op (no copy)", "upstream's cache views", _contiguous),
    ("seed 000", "A bool attn_mask makes SDPA fall back to the math kernel", "voxcpm's dtype on the device",
     _math_fallback),
    ("seed 000", "Slicing the cache to position+1 lets SDPA use flash attention", "voxcpm's dtype on the device",
     _slice_flash),
    ("seed 000", "After the fix a step costs O(position), not O(max_length)", f"positions up to {MAX_LENGTH}",
     _o_position),
    ("seed 000", "The sliced result differs only by ~1e-6 (which can shift the stop token)", "fp32 and bf16",
     _rounding),
    ("seed 000", "2.5-3.5x faster per position", "a decode step on the reporter's CUDA GPU, bf16", _per_position),
    ("seed 000", "~36% faster end to end", f"{END_TO_END_STEPS}+ steps of the full model on CUDA (1.36x speed)",
     _end_to_end),
    ("seed 000", "MPS needs .contiguous() on sliced views", "an MPS device",
     (NOT_HERE, "no MPS device on this machine; fastattn keeps upstream's .contiguous() on MPS only")),
    ("seed 000", "torch.compile(fullgraph) inlines forward_step: a later monkeypatch is ignored", "optimize()",
     (NOT_RUN, "no record measures a patch applied after optimize()'s compile; fastattn refuses to patch a model "
      "whose forward_step was compiled (tests/runtime/test_patch.py::test_compiled_model_is_refused)")),
    ("seed 002", "The default mode never changes results",
     f"every position below {MAX_LENGTH} and whole decodes, on the device", _default_exact),
    ("seed 002", "sdpa_kernel switches SDPA's kernel for all threads (process-wide)", "any torch",
     _sdpa_kernel_process_wide),
    ("seed 003", "Decode attention cost scales with max_length, not with the sequence",
     f"positions up to {MAX_LENGTH}", _o_max_length),
    ("seed 003", "Every request zero-fills the whole cache of both LMs", "voxcpm 2.0.3's source", _zero_fill_source),
    ("seed 003", "KV allocation ~605 MB -> ~20-38 MB per request (fp32)", "a 300-token request, full model",
     _kv_sizes),
    ("seed 003", "Output is bit-identical before and after the fix", "a whole decode of the full model",
     _bit_identical),
    ("seed 003", "On CPU the zero-fill is only ~0.1-0.2 s of a ~50 s request", "a CPU request", _zero_fill_cost),
    ("voxcpm", "Its default dtype (the checkpoint's bf16 on CPU and CUDA) is the fastest to run here",
     "the whole decode on this machine", _default_dtype),
]


#: the seed's kernel claims 02 checks on its matrix: its table and the ledger show the same rows
MATRIX_JUDGES = (_math_fallback, _slice_flash, _rounding)


def matrix_claims(matrix: dict) -> list:
    """The ledger's rows for :data:`MATRIX_JUDGES`, from a ``backend_matrix`` record (02's, before it is saved)."""
    recs = {"backend_matrix": [matrix]}
    return [{"source": src, "claim": claim, "scale": scale, **dict(zip(("verdict", "evidence"), judge(recs, {})))}
            for src, claim, scale, judge in CLAIMS if judge in MATRIX_JUDGES]


def claims_ledger(run_dir=None) -> list:
    """``[{source, claim, scale, verdict, evidence}]`` of ``run_dir``'s records (a folder, or a :class:`.records.Run`
    already loaded); ``scale``: what the claim is about."""
    run = run_dir if isinstance(run_dir, Run) else load_run(run_dir) if run_dir else None
    finds, recs, out = run.findings if run else {}, {}, []
    for r in run.records if run else []:
        recs.setdefault(r["kind"], []).append(r)
    for source, claim, scale, judge in CLAIMS:
        try:
            verdict, evidence = judge(recs, finds) if callable(judge) else judge
        except Exception as exc:  # noqa: BLE001 - a record of another shape: say so, do not guess
            verdict, evidence = NOT_RUN, f"could not read the records ({type(exc).__name__}: {exc})"
        out.append({"source": source, "claim": claim, "scale": scale, "verdict": verdict, "evidence": evidence})
    return out
