"""The workbook's targets, stated before any result (:data:`GOALS`), judged from records.

Every timing ratio a target judges carries its bootstrap 95% interval (paired over the interleaved rounds,
:mod:`.stats`) and its sample count: ``{target, measured, goal, passed, ci_low, ci_high, n, note}``.
``passed`` judges the median ratio; ``decided`` says whether the whole interval lies on the same side of
the goal (a target met or missed within the box's noise reads ``decided: False``). A target that does not
apply to the device's configuration (the KV and growth targets where no window is exact, as on CUDA) is a row
with ``passed: None`` and a note that says why: shown, never counted (:func:`met_count`).
"""

from __future__ import annotations

import statistics

from .records import find_row
from .stats import ratio_ci, scaled_ci

#: id -> (what is judged, bound): every target of the workbook, fixed before it measures anything
GOALS = {
    "exact_p256": ("one attention call at p=256, cap 8192, fp32: exact / reference time", 0.10),
    "fast_p256": ("one attention call at p=256, cap 8192, fp32: fast / reference time", 0.05),
    "fast_floor_far": ("fast at p >= 1024: time / DRAM floor (worst position)", 3.0),
    "fast_slice_fp32": ("fast / slice fix (seed 000) at p=2048 and 4096, fp32", 0.75),
    "fast_slice_bf16": ("fast / slice fix (seed 000) at p=2048 and 4096, bf16", 0.20),
    "fast_error": ("fast's max error vs float64 / reference's, every swept position", 2.0),
    "fast_floor_4096": ("fast at p=4096, fp32, K/V cache-cold: time / DRAM floor", 2.5),
    "growth_time": ("cache growth over a 100 + 8000-step request (full base LM, bf16): total s in step()", 0.2),
    "growth_moves": ("cache growth over that request: storage moves", 6),
    "decode_bf16": ("one decode step at p=256 (hidden 2048, bf16): patched / upstream time", 0.40),
    "decode_fp32": ("one decode step at p=256 (hidden 2048, fp32): patched / upstream time", 0.85),
    "kv_bytes": ("KV bytes of a 300-token request, both LMs, measured caches: patched / upstream", 0.10),
    "whole": ("whole decode (full preset, bf16): patched / upstream wall time", 0.50),
    "dtype_opt_in": ("on a CPU without native bf16: fp32 with the fix / voxcpm's default (bf16, upstream), "
                     "decode step", 0.35),
}


#: id -> what must simply hold (a bool measured, no bound)
MUST_HOLD = {
    "capacity_bound": "cache capacity <= max(2 x live length, granularity) at every step",
    "whole_identical": "whole decode output bit-identical to upstream",
}


def target_goals() -> list[dict]:
    """The targets as a table, to show before the measurements: ``[{target, goal}]``."""
    return [{"target": what, "goal": f"<= {bound:g}"} for what, bound in GOALS.values()] + \
        [{"target": what, "goal": "True"} for what in MUST_HOLD.values()]


def quiet_pairs(num: dict, den: dict) -> tuple:
    """The paired samples of two rows timed in the same rounds, less every round either was disturbed in
    (``disturbed_flags``, :func:`fastattn.bench.timing.stats_ms`): a ratio never rests on a busy moment."""
    a, b = num["samples_ms"], den["samples_ms"]
    fa, fb = num.get("disturbed_flags") or [False] * len(a), den.get("disturbed_flags") or [False] * len(b)
    if len(a) != len(b):
        return [x for x, f in zip(a, fa) if not f], [x for x, f in zip(b, fb) if not f]
    keep = [i for i in range(len(a)) if not (fa[i] or fb[i])]
    return [a[i] for i in keep], [b[i] for i in keep]


def quiet_ratio(num: dict, den: dict) -> tuple:
    """Median ratio of two timed rows over their quiet rounds, its paired bootstrap interval (None without
    samples) and n (the quiet rounds; where fewer than 3 are quiet, all rounds, and the row says so)."""
    if "samples_ms" not in num or "samples_ms" not in den:
        return num["median_ms"] / den["median_ms"], None, min(num.get("n", 0), den.get("n", 0)), 0
    a, b = quiet_pairs(num, den)
    if min(len(a), len(b)) < 3:
        a, b = num["samples_ms"], den["samples_ms"]
    dropped = len(num["samples_ms"]) - len(a)
    return statistics.median(a) / statistics.median(b), ratio_ci(a, b), min(len(a), len(b)), dropped


def check_targets(records: dict) -> list[dict]:
    """The workbook's targets (:data:`GOALS`), judged from records.

    ``records`` maps names to records: ``attention_fp32`` / ``attention_bf16`` (attention sweeps, capacity
    8192), ``attention_fp32_cold`` (the same sweep with K/V rotated over caches larger than the last-level
    cache: where the DRAM floor binds), ``decode_bf16`` / ``decode_fp32`` (decode-step sweeps), ``kv``
    (kv_memory), ``growth`` (cache_growth), ``whole`` (whole_decode), ``dtypes`` (dtype_decode). Missing records
    are skipped.
    """
    out = []
    add_goal = lambda gid: f"<= {GOALS[gid][1]:g}" if gid in GOALS else "True"  # noqa: E731

    def add(gid, target, measured, note="", ci=None, n=None, at=None):
        """One judged row; ``passed`` from GOALS' bound (or the bool itself for MUST_HOLD), ``id`` = gid[@at]."""
        bound = GOALS[gid][1] if gid in GOALS else None
        passed = bool(measured) if bound is None else measured <= bound
        decided = None if not ci or bound is None else (ci[1] <= bound) if passed else (ci[0] > bound)
        out.append({"id": gid if at is None else f"{gid}@{at}", "target": target, "measured": measured,
                    "goal": f"<= {bound:g}" if bound is not None else "True", "passed": bool(passed),
                    "ci_low": ci[0] if ci else None, "ci_high": ci[1] if ci else None, "n": n, "decided": decided,
                    "note": note})

    def not_applicable(gid, target, why):
        """A target this device's configuration cannot be judged on: shown, never counted as met or missed."""
        out.append({"id": gid, "target": target, "measured": None, "goal": add_goal(gid), "passed": None,
                    "ci_low": None, "ci_high": None, "n": None, "decided": None, "note": "not applicable here: " + why})

    def add_ratio(gid, target, num, den, note="", at=None):
        r, ci, n, dropped = quiet_ratio(num, den)
        busy = f"{dropped} disturbed rounds left out" if dropped else ""
        add(gid, target, r, "; ".join(x for x in (note, busy) if x), ci, n, at)

    _attention_targets(records, add, add_ratio)
    _floor_targets(records, add)
    _cache_targets(records, add, not_applicable)
    for key, gid in (("decode_bf16", "decode_bf16"), ("decode_fp32", "decode_fp32")):
        rec = records.get(key) or {"rows": []}
        up, pa = (find_row(rec["rows"], variant=v, position=256) for v in ("upstream", "patched"))
        if up and pa:
            add_ratio(gid, f"decode step p=256 ({rec['params']['dtype']}, hidden {rec['params']['hidden']}): "
                      "patched / upstream", pa, up)
    _whole_targets(records.get("whole"), add)
    _dtype_target(records.get("dtypes"), add, not_applicable)
    return out


def _dtype_target(rec, add, not_applicable):
    """fp32 with the fix against voxcpm's default, judged only on a CPU without native bf16 (elsewhere bf16 is the
    fast one and the bound does not apply)."""
    if not rec:
        return
    from ..devices import native_bf16
    from .decode import dtype_table
    target = GOALS["dtype_opt_in"][0]
    if str(rec.get("env", {}).get("device", "cpu")) != "cpu" or native_bf16(rec.get("flags") or {}) is not False:
        not_applicable("dtype_opt_in", target, "this CPU has native bf16 (or this is not a CPU run)")
        return
    row = next((r for r in dtype_table(rec) if r["dtype"] == "float32" and r["variant"] == "patched"), None)
    if row:
        key = next(k for k in row if k.startswith("x "))
        add("dtype_opt_in", target, row[key], f"{row['n']} quiet steps, {row['disturbed']} disturbed left out",
            (row["95% low"], row["95% high"]) if row["95% low"] is not None else None, row["n"])


def _attention_targets(records, add, add_ratio):
    att = records.get("attention_fp32")
    if att:
        ref, ex, fa = (find_row(att["rows"], mode=m, position=256) for m in ("reference", "exact", "fast"))
        if ref and ex and fa:
            add_ratio("exact_p256", "attention p=256, cap 8192, fp32: exact / reference", ex, ref)
            add_ratio("fast_p256", "attention p=256, cap 8192, fp32: fast / reference", fa, ref)
    for key, gid in (("attention_fp32", "fast_slice_fp32"), ("attention_bf16", "fast_slice_bf16")):
        rec = records.get(key)
        if not rec:
            continue
        dtname = rec.get("params", {}).get("dtype") or {"attention_fp32": "float32", "attention_bf16": "bfloat16"}[key]
        for p in (2048, 4096):
            fa, sl = find_row(rec["rows"], mode="fast", position=p), find_row(rec["rows"], mode="slice_fix", position=p)
            if fa and sl:
                add_ratio(gid, f"attention p={p}, {dtname}: fast / slice fix (seed 000)", fa, sl,
                          "fast chose " + ", ".join(c["winner"] for c in rec.get("fast_choice", [])), at=p)
        errs = [(find_row(rec["rows"], mode="fast", position=p), find_row(rec["rows"], mode="reference", position=p))
                for p in sorted({r["position"] for r in rec["rows"]})]
        errs = [(f["max_err_f64"], r["max_err_f64"]) for f, r in errs if f and r and "max_err_f64" in f]
        if errs:
            worst = max(f / r if r else (0.0 if f == 0 else float("inf")) for f, r in errs)
            add("fast_error", f"attention {dtname}: fast's error vs float64 / reference's (worst position)",
                worst, "deterministic: the same random data in every run", at=dtname)


def _floor_ratio(row: dict) -> tuple:
    ci = scaled_ci(row["samples_ms"], row["floor_ms"]) if "samples_ms" in row else None
    return row["x_floor"], ci, row.get("n")


def _floor_targets(records, add):
    """fast against the DRAM floor, judged where the floor binds: the cache-cold sweep when there is one."""
    cold = records.get("attention_fp32_cold")
    att = cold or records.get("attention_fp32")
    if not att:
        return
    where = (f"K/V rotated over {att['params'].get('caches', 1)} caches" if cold else
             "K/V warm: no cache-cold sweep in this run")
    far = [r for r in att["rows"] if r["mode"] == "fast" and r["position"] >= 1024]
    if far:
        worst = max(far, key=lambda r: r["x_floor"])
        x, ci, n = _floor_ratio(worst)
        cached = [r["position"] for r in far if r["floor_meaningful"] is False]
        where += "; this device's last-level cache size is unknown" if any(
            r["floor_meaningful"] is None for r in far) else ""
        add("fast_floor_far", f"fast attention at p >= 1024, fp32: time / DRAM floor (worst: p={worst['position']})",
            x, where + (f"; live K/V fit in the last-level cache at {cached}: the "
                                                           "DRAM floor does not bind there" if cached else ""), ci, n)
    fa = find_row(att["rows"], mode="fast", position=4096)
    if fa:
        x, ci, n = _floor_ratio(fa)
        gemm = find_row(att["rows"], mode="gemm_floor", position=4096)
        note = where + (f"; the two bare GEMMs alone (torch's BLAS, no softmax) take {gemm['median_ms']:.3g} ms = "
                        f"{gemm['x_floor']:.2g}x the floor: fast is {fa['median_ms'] / gemm['median_ms']:.2g}x them"
                        if gemm else "")
        add("fast_floor_4096", "attention p=4096, fp32: fast / DRAM floor (live K+V once)", x, note, ci, n)


def _cache_targets(records, add, not_applicable):
    growth = records.get("growth")
    if growth:
        gs, gp = growth["summary"], growth["params"]
        what = f"{gp['prefill']} + {gp['steps']}-step request, {gp['preset']} base LM, {gp['dtype']}"
        if gs.get("right_sized", True):
            add("growth_time", f"cache growth ({what}): total time in step(), s", gs["step_total_s"],
                f"one pass, not repeated; upstream zero-fills {gp['max_length']} slots per request instead: "
                f"{gs['upstream_fill_ms']:.1f} ms")
            add("growth_moves", f"cache growth ({what}): storage moves", gs["moves"])
            add("capacity_bound", MUST_HOLD["capacity_bound"], gs["bound_held_every_step"])
        else:
            why = f"no exact window here: the patched cache holds all {gp['max_length']} slots and never grows"
            for gid in ("growth_time", "growth_moves", "capacity_bound"):
                not_applicable(gid, GOALS[gid][0] if gid in GOALS else MUST_HOLD[gid], why)
    kv = records.get("kv")
    if kv and kv.get("right_sized", True):
        add("kv_bytes", f"KV of a {kv['params']['prefill'] + kv['params']['steps']}-token request: patched / upstream",
            kv["ratio"], kv.get("note", ""))
    elif kv:
        not_applicable("kv_bytes", GOALS["kv_bytes"][0], kv.get("note", "no exact window here"))


def met_count(targets: list) -> str:
    """``"met/judged"`` over the targets that apply here (a not-applicable row counts in neither)."""
    judged = [t for t in targets if t["passed"] is not None]
    return f"{sum(bool(t['passed']) for t in judged)}/{len(judged)}"


def _whole_targets(whole, add):
    if not whole:
        return
    from .decode import time_shares
    up = [r for r in whole["rows"] if r["variant"] == "upstream"]
    pa = [r for r in whole["rows"] if r["variant"] == "patched"]
    share = time_shares(whole)
    bound = 1 - share["lm_attention"]
    note = (f"Amdahl: upstream's LM decode attention is {share['lm_attention']:.0%} of its wall time and the local "
            f"DiT {share['local_dit']:.0%}; removing all attention time alone would leave about {bound:.2f}. The "
            "target needs attention to be over half of a step, which it is not on this device" if bound > 0.5 else "")
    wp = whole["params"]
    add("whole", f"whole decode ({wp['preset']}, {wp['dtype']}, {wp['steps']} steps): patched / upstream wall",
        whole["ratio"], note, ratio_ci([r["wall_s"] for r in pa], [r["wall_s"] for r in up]), min(len(up), len(pa)))
    add("whole_identical", "whole decode output bit-identical", whole["identical"])
