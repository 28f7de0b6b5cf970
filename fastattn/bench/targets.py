"""The workbook's targets, judged from records, and notebook 05's headline."""

from __future__ import annotations

import statistics


def _row(rows, **match):
    return next((r for r in rows if all(r.get(k) == v for k, v in match.items())), None)


def check_targets(records: dict) -> list[dict]:
    """The workbook's targets, judged from records: ``[{target, measured, goal, passed}]``.

    ``records`` maps names to records: ``attention_fp32`` (attention sweep,
    capacity 8192), ``decode_bf16`` / ``decode_fp32`` (decode-step sweeps),
    ``kv`` (kv_memory), ``whole`` (whole_decode). Missing records are skipped.
    """
    out = []

    def add(target, measured, goal, passed, note=""):
        out.append({"target": target, "measured": measured, "goal": goal, "passed": bool(passed), "note": note})

    att = records.get("attention_fp32")
    if att:
        ref, ex, fa = (_row(att["rows"], mode=m, position=256) for m in ("reference", "exact", "fast"))
        if ref and ex and fa:
            add("attention p=256, cap 8192, fp32: exact / reference", ex["median_ms"] / ref["median_ms"], "<= 0.10",
                ex["median_ms"] / ref["median_ms"] <= 0.10)
            add("attention p=256, cap 8192, fp32: fast / reference", fa["median_ms"] / ref["median_ms"], "<= 0.05",
                fa["median_ms"] / ref["median_ms"] <= 0.05)
        far = [r for r in att["rows"] if r["mode"] == "fast" and r["position"] >= 1024]
        if far:
            worst = max(r["x_floor"] for r in far)
            cached = [r["position"] for r in far if not r["floor_meaningful"]]
            add("fast attention at p >= 1024: time / bandwidth floor (worst)", worst, "<= 3", worst <= 3,
                f"live K/V fit in the last-level cache at positions {cached}: the DRAM floor does not bind there"
                if cached else "")
    for key, goal in (("attention_fp32", 0.75), ("attention_bf16", 0.20)):
        rec = records.get(key)
        dtname = key.split("_")[1].replace("fp32", "float32").replace("bf16", "bfloat16")
        for p in (2048, 4096) if rec else ():
            fa, sl = _row(rec["rows"], mode="fast", position=p), _row(rec["rows"], mode="slice_fix", position=p)
            if fa and sl:
                r = fa["median_ms"] / sl["median_ms"]
                add(f"attention p={p}, {dtname}: fast / slice fix (seed 000)", r, f"<= {goal}",
                    r <= goal, "fast chose " + ", ".join(c["winner"] for c in rec.get("fast_choice", [])))
        errs = [(_row(rec["rows"], mode="fast", position=p), _row(rec["rows"], mode="reference", position=p))
                for p in sorted({r["position"] for r in rec["rows"]})] if rec else []
        errs = [(f["max_err_f64"], r["max_err_f64"]) for f, r in errs if f and r and "max_err_f64" in f]
        if errs:
            worst = max(f / r if r else (0.0 if f == 0 else float("inf")) for f, r in errs)
            add(f"attention {dtname}: fast's error vs float64 / reference's (worst position)",
                worst, "<= 2", worst <= 2)
    att = records.get("attention_fp32")
    fa = _row(att["rows"], mode="fast", position=4096) if att else None
    if fa:
        add("attention p=4096, fp32: fast / DRAM floor (live K+V once)", fa["x_floor"], "<= 2.5", fa["x_floor"] <= 2.5,
            "" if fa["floor_meaningful"] else "live K/V fit in the last-level cache: the DRAM floor does not bind")
    growth = records.get("growth")
    if growth:
        gs, gp = growth["summary"], growth["params"]
        what = f"{gp['prefill']} + {gp['steps']}-step request, {gp['preset']} base LM, {gp['dtype']}"
        add(f"cache growth ({what}): total time in step(), s", gs["step_total_s"], "<= 0.2", gs["step_total_s"] <= 0.2,
            f"upstream zero-fills {gp['max_length']} slots per request instead: {gs['upstream_fill_ms']:.1f} ms")
        add(f"cache growth ({what}): storage moves", gs["moves"], "<= 6", gs["moves"] <= 6)
        add("cache capacity <= max(2 x live length, granularity) at every step", gs["bound_held_every_step"], "True",
            gs["bound_held_every_step"])
    for key, goal in (("decode_bf16", 0.4), ("decode_fp32", 0.85)):
        rec = records.get(key)
        if rec:
            up = _row(rec["rows"], variant="upstream", position=256)
            pa = _row(rec["rows"], variant="patched", position=256)
            if up and pa:
                r = pa["median_ms"] / up["median_ms"]
                what = f"{rec['params']['dtype']}, hidden {rec['params']['hidden']}"
                add(f"decode step p=256 ({what}): patched / upstream", r, f"<= {goal}", r <= goal)
    kv = records.get("kv")
    if kv:
        add(f"KV of a {kv['params']['prefill'] + kv['params']['steps']}-token request: patched / upstream",
            kv["ratio"], "<= 0.10", kv["ratio"] <= 0.10)
    whole = records.get("whole")
    if whole:
        up = [r for r in whole["rows"] if r["variant"] == "upstream"]
        wall = statistics.median(r["wall_s"] for r in up)
        att = statistics.median(r["lm_attention_s"] for r in up)
        dit = statistics.median(r["local_dit_s"] for r in up)
        bound = (wall - att) / wall
        note = (f"Amdahl: upstream's LM decode attention is {att / wall:.0%} of its wall time and the local DiT "
                f"{dit / wall:.0%}; removing all attention time alone would leave about {bound:.2f}. The target "
                "needs attention to be over half of a step, which it is not on this device" if bound > 0.5 else "")
        wp = whole["params"]
        add(f"whole decode ({wp['preset']}, {wp['dtype']}, {wp['steps']} steps): patched / upstream wall",
            whole["ratio"], "<= 0.50", whole["ratio"] <= 0.5, note)
        add("whole decode output bit-identical", whole["identical"], "True", whole["identical"])
    return out


