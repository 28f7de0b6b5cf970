"""Notebook 05's readings of its records: the headline, warm vs cold calls, a decode step vs its
attention calls, and bf16 vs fp32. Pure functions of records; they measure nothing."""

from __future__ import annotations

from typing import Optional

from ..bench.decode import dtype_table, patched_is_upstream, time_shares
from ..bench.records import find_row
from ..bench.targets import met_count

__all__ = ["headline", "headline_key", "floor_reading", "warm_vs_cold", "step_vs_call", "dtype_reading", "fast_table",
           "fast_chose", "patched_steps_identical", "amdahl_line", "memory_summary", "growth_table", "whole_dtypes",
           "dtype_recommendation", "dtype_findings", "sizing_line"]


def warm_vs_cold(warm: dict, cold: dict) -> list[dict]:
    """Per mode and position, one call with K/V warm (one cache, re-read) vs cold (rotated over many)."""
    rows = []
    for c in cold["rows"]:
        w = find_row(warm["rows"], mode=c["mode"], position=c["position"])
        if w:
            rows.append({"mode": c["mode"], "position": c["position"], "warm ms": w["median_ms"],
                         "cold ms": c["median_ms"], "cold / warm": c["median_ms"] / w["median_ms"],
                         "cold x floor": c.get("x_floor"), "n": min(w["n"], c["n"])})
    return rows


def _ratio_or_none(num, den):
    """``num / den`` where the denominator is a resolved saving (> 0), else None: no ratio of noise."""
    return num / den if num is not None and den is not None and den > 0 else None


def step_vs_call(dec: dict, warm: dict, cold: dict, position: int = 256) -> dict:
    """What one decode step saves per layer, beside what one isolated attention call saves (reference ->
    exact), warm and cold: the step's saving is judged against the call that reads K/V as the step does.
    Where ``exact`` is upstream's own call (no exact window on the device: ``exact_granularity`` None) or a
    saving is not above zero, the ratios are None and ``note`` says why."""
    up, pa = (find_row(dec["rows"], variant=v, position=position) for v in ("upstream", "patched"))
    per_layer = (up["median_ms"] - pa["median_ms"]) / dec["params"]["layers"]
    saved = {name: find_row(rec["rows"], mode="reference", position=position)["median_ms"]
             - find_row(rec["rows"], mode="exact", position=position)["median_ms"]
             for name, rec in (("warm", warm), ("cold", cold))}
    inside = (up.get("attention_in_step_ms"), pa.get("attention_in_step_ms"))
    in_step = inside[0] - inside[1] if None not in inside else None
    same_call = "exact_granularity" in warm.get("params", {}) and warm["params"]["exact_granularity"] is None
    note = ("exact is upstream's own call on this device (no exact window): there is no saving to reconcile"
            if same_call else
            "inside a step each layer streams its weights through the caches between two attention calls, leaving "
            "K/V colder than an isolated call: the kernel's in-step saving is the one to compare")
    return {"position": position, "dtype": dec["params"]["dtype"],
            "decode step saving per layer ms": per_layer,
            "isolated call saving ms, K/V warm": saved["warm"], "isolated call saving ms, K/V cold": saved["cold"],
            "attention kernel saving inside the step ms (profiled)": in_step,
            "step saving / cold call saving": None if same_call else _ratio_or_none(per_layer, saved["cold"]),
            "step saving / in-step kernel saving": None if same_call else _ratio_or_none(per_layer, in_step),
            "note": note}


def dtype_reading(costs: dict, att32: dict, att16: dict, position: int = 4096) -> dict:
    """bf16 vs fp32 read from measurements: per mode at ``position``, and per operation (``dtype_costs``)."""
    pairs = {m: (find_row(att16["rows"], mode=m, position=position), find_row(att32["rows"], mode=m, position=position))
             for m in ("reference", "exact", "fast", "slice_fix")}
    modes = {m: a["median_ms"] / b["median_ms"] for m, (a, b) in pairs.items() if a and b}
    conv = next((r["median_ms"] for r in costs["rows"] if r["op"].startswith("bf16 -> fp32")), None)
    op = costs["ratios"]
    flags = costs.get("flags", {})
    reading = (f"bf16 costs {op['SDPA over the slice']:.1f}x fp32 in SDPA over the slice, "
               f"{op['masked SDPA over the capacity (upstream)']:.1f}x in upstream's masked call and "
               f"{op['bare GEMM q @ k^T']:.1f}x in a bare GEMM; converting the live K to fp32 takes "
               f"{conv:.3g} ms ({costs['params']['length']} keys)")
    if "fast" in modes and "slice_fix" in modes:
        reading += (f". fast (fp32 GEMMs after one conversion) costs {modes['fast']:.1f}x in bf16 what it costs "
                    f"in fp32, the slice fix {modes['slice_fix']:.1f}x")
    if flags:
        reading += ". CPU features: " + ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in flags.items())
    return {"bf16 / fp32 time per mode": modes, "bf16 / fp32 time per operation": op,
            "bf16 -> fp32 conversion of the live K, ms": conv, "cpu flags": flags, "reading": reading}


def floor_reading(cold: dict, position: int = 4096) -> dict:
    """fast at ``position`` in a cold sweep: its time over the DRAM floor and over the bare GEMMs' time."""
    fa = find_row(cold["rows"], mode="fast", position=position)
    gm = find_row(cold["rows"], mode="gemm_floor", position=position)
    return {"position": position, "x_dram_floor": fa["x_floor"],
            "x_gemm_floor": fa["median_ms"] / gm["median_ms"] if gm else float("nan"),
            "gemm_x_dram_floor": gm["x_floor"] if gm else float("nan")}


def headline_key(items: dict) -> list[str]:
    """The headline's key findings: exact's call saving, the bf16 step, the whole decode, targets met."""
    want = ("attention fp32 at p=", "decode step bf16", "whole decode (", "targets met")
    return [next(k for k in items if k.startswith(w) and "fast" not in k) for w in want]


def headline(att: dict, dec: dict, whole: dict, targets: list, position: int = 256) -> dict:
    """The profiling notebook's findings, read from its records: ratios at ``position``, the whole-decode
    ratio and identity, the LMs' decode-attention share of wall time, and how many targets were met."""
    def at(rec, key, value):
        row = find_row(rec["rows"], **{key: value, "position": position})
        return row["median_ms"] if row else float("nan")

    a, d16, d32 = att["float32"], dec["bfloat16"], dec["float32"]
    share = {v: time_shares(whole, v)["lm_attention"] for v in ("upstream", "patched")}
    p = whole["params"]
    reps = sum(r["variant"] == "upstream" for r in whole["rows"])
    return {
        f"attention fp32 at p={position}: exact / reference": at(a, "mode", "exact") / at(a, "mode", "reference"),
        f"attention fp32 at p={position}: fast / reference": at(a, "mode", "fast") / at(a, "mode", "reference"),
        f"decode step bf16 at p={position}: patched / upstream":
            at(d16, "variant", "patched") / at(d16, "variant", "upstream"),
        f"decode step fp32 at p={position}: patched / upstream":
            at(d32, "variant", "patched") / at(d32, "variant", "upstream"),
        f"whole decode ({p['preset']}, {p['dtype']}, {p['steps']} steps, n={reps}): patched / upstream wall":
            whole["ratio"],
        "whole decode output bit-identical": whole["identical"],
        "LM decode attention share of wall time (upstream, patched)":
            f"{share['upstream']:.2f}, {share['patched']:.2f}",
        "targets met": met_count(targets),
    }


def fast_table(att: dict, positions) -> list[dict]:
    """Per dtype and position: ``fast`` beside the public slice fix, the DRAM floor (and whether it binds:
    None where the last-level cache size is unknown) and both errors vs float64, from the attention sweeps."""
    rows = []
    for dt, rec in att.items():
        for p in positions:
            f, s, r = (find_row(rec["rows"], mode=m, position=p) for m in ("fast", "slice_fix", "reference"))
            if not (f and s and r):
                continue
            rows.append({"dtype": dt, "position": p, "fast ms": f["median_ms"], "slice fix ms": s["median_ms"],
                         "fast / slice fix": f["median_ms"] / s["median_ms"], "fast x floor": f["x_floor"],
                         "floor binds (K/V > LLC)": f["floor_meaningful"], "fast err": f["max_err_f64"],
                         "reference err": r["max_err_f64"], "n": f["n"]})
    return rows


def fast_chose(att: dict) -> dict:
    """What ``fast`` chose per dtype, as the sweeps recorded it."""
    return {dt: [c["winner"] for c in rec.get("fast_choice", [])] for dt, rec in att.items()}


def patched_steps_identical(dec: dict) -> bool:
    """Whether the patched decode step was bit-identical to upstream at every position of every sweep (the
    slice fix's rows, never identical by design, are not part of the claim)."""
    return all(r["bit_identical"] for rec in dec.values() for r in rec["rows"] if r["variant"] == "patched")


def amdahl_line(whole: dict) -> str:
    """The whole decode in one sentence: ratio, identity, and Amdahl's bound from the LMs' attention share."""
    share, wall = time_shares(whole)["lm_attention"], whole["median_wall_s"]
    same = " (no exact window on this device: the patched decode is upstream's computation)" \
        if patched_is_upstream(whole) else ""
    return (f"patched / upstream wall: {whole['ratio']:.2f}, output bit-identical: {whole['identical']}{same}. "
            f"Amdahl: upstream {wall['upstream']:.1f} s, of which LM decode attention {share:.0%}; if that "
            f"attention cost nothing: {(1 - share) * wall['upstream']:.1f} s ({1 - share:.2f}x). Patched reaches "
            f"{wall['patched']:.1f} s ({whole['ratio']:.2f}x).")


def memory_summary(kv: dict, alloc: dict, rss: dict) -> dict:
    """05's memory findings, labelled with where each was measured (peak RSS is a host process running the
    model on CPU, whatever device the run uses)."""
    on = alloc["env"].get("device", "cpu")
    return {f"KV MB, full model, {kv['params']['prefill'] + kv['params']['steps']}-token request (upstream, patched)":
            (kv["upstream_bytes"] / 1e6, kv["patched_bytes"] / 1e6),
            "patched KV right-sized on this device": kv.get("right_sized", True),
            f"bytes allocated by one decode layer step on {on} (upstream, patched)":
            tuple(alloc["variants"][v]["allocated_bytes"] for v in ("upstream", "patched")),
            "peak RSS difference patched - upstream MB, CPU processes (spread between processes MB)":
            (rss["summary"]["peak_difference_bytes"] / 1e6, rss["summary"]["peak_spread_bytes"] / 1e6),
            "KV MB the patched caches do not hold, CPU processes": rss["summary"]["cache_bytes_saved"] / 1e6}


def growth_table(growth: dict) -> list[dict]:
    """One row per request length of :func:`fastattn.bench.cache_growth` records."""
    out = []
    for n, g in growth.items():
        s = g["summary"]
        out.append({"request steps": n, "moves": s["moves"], "total in step() ms": s["step_total_s"] * 1e3,
                    "largest step ms": s["max_step_ms"], "bound held every step": s["bound_held_every_step"],
                    "final capacity": s["final_capacity"], "right-sized here": s.get("right_sized", True),
                    "upstream zero-fill per request ms": s["upstream_fill_ms"]})
    return out


def whole_dtypes(device, dtype: str) -> tuple:
    """The dtypes 05 decodes the whole model in: voxcpm's own on the device first (the default every ratio is
    against), then float32 and ``dtype``; float16 too on CUDA (CPUs have no fast fp16 GEMM)."""
    import torch

    from ..devices import runtime_dtype
    extra = ("float32", dtype) + (("float16",) if torch.device(device).type == "cuda" else ())
    return tuple(dict.fromkeys((runtime_dtype(device),) + extra))


def dtype_recommendation(rec: dict, flags: Optional[dict] = None) -> dict:
    """Which dtype (and patch) this machine should run, from a ``dtype_decode`` record, with its price.

    The default is voxcpm's own (the record's first dtype, upstream). Another configuration is recommended only
    where its step is faster with the whole 95% interval below 1; a change of dtype changes the output's
    rounding, so it is an opt-in, never a default, and ``line`` says so. ``flags``: the CPU's features
    (:func:`fastattn.devices.cpu_flags`), named where they explain the result.
    """
    from ..devices import native_bf16
    rows = dtype_table(rec)
    default = rows[0]
    best = min(rows, key=lambda r: r["step s"])
    ci = (best["95% low"], best["95% high"]) if best["95% low"] is not None else None
    decided = best is not default and ci is not None and ci[1] < 1
    pick = best if decided else default
    mem = {r["dtype"]: r["peak GB"] for r in rows if r["variant"] == "upstream"}
    weights = {r["dtype"]: r["weights GB"] for r in rows if r["variant"] == "upstream"}
    native = native_bf16(flags) if flags else None
    out = {"dtype": pick["dtype"], "patched": pick["variant"] == "patched", "ratio": pick[default_key(rows)],
           "ci": ci if decided else None, "decided": decided, "default": default["dtype"], "native_bf16": native,
           "peak_gb": mem, "weights_gb": weights, "changes_results": pick["dtype"] != default["dtype"],
           "others": {x["dtype"]: x[default_key(rows)] for x in rows if x["variant"] == "upstream"}}
    out["line"] = _recommendation_line(out, best, rows)
    return out


def _ci_text(row: dict) -> str:
    return "n/a" if row["95% low"] is None else f"{row['95% low']:.2f}-{row['95% high']:.2f}"


def default_key(rows: list) -> str:
    """The ratio column of :func:`fastattn.bench.dtype_table`'s rows (``x <default dtype> upstream``)."""
    return next(k for k in rows[0] if k.startswith("x "))


def _recommendation_line(r: dict, best: dict, rows: list) -> str:
    why = {True: "this CPU has native bf16", False: "this CPU has no native bf16 (no avx512_bf16, amx_bf16 or "
           "Arm bf16): torch's bf16 kernels convert to fp32 and back", None: ""}[r["native_bf16"]]
    why = f" ({why})" if why else ""
    cfg = f"{r['dtype']}{' with the patch' if r['patched'] else ''}"
    if not r["decided"]:
        alt = f"{best['dtype']}{' patched' if best['variant'] == 'patched' else ''}"
        return (f"Keep voxcpm's default ({r['default']}){why}: no other configuration's decode step is faster with its "
                f"whole 95% interval below 1 (the fastest, {alt}, {best[default_key(rows)]:.2f}x, "
                f"interval {_ci_text(best)}).")
    price = ""
    if r["changes_results"]:
        price = (f" Price: weights {r['weights_gb'][r['default']]:.1f} -> {r['weights_gb'][r['dtype']]:.1f} GB"
                 + (f", peak {r['peak_gb'][r['default']]:.1f} -> {r['peak_gb'][r['dtype']]:.1f} GB"
                    if r["peak_gb"].get(r["dtype"]) and r["peak_gb"].get(r["default"]) else "")
                 + f"; {r['dtype']} rounds differently from {r['default']}, so the audio changes: an opt-in "
                 f"(VOXCPM_CPU_DTYPE={r['dtype']} with the proposed upstream override), never a silent default.")
    others = ", ".join(f"{d} {x:.2f}x" for d, x in r["others"].items() if d != r["default"])
    return (f"Run {cfg}{why}: its decode step takes {r['ratio']:.2f}x of voxcpm's default ({r['default']}, "
            f"upstream), 95% interval {r['ci'][0]:.2f}-{r['ci'][1]:.2f} (upstream in {others}).{price}")


def dtype_findings(r: dict) -> dict:
    """05's findings from :func:`dtype_recommendation`: the dtype to run, its ratio and interval, its memory."""
    cfg = r["dtype"] + (" + patch" if r["patched"] else "")
    ci = f" [{r['ci'][0]:.2f}, {r['ci'][1]:.2f}]" if r["ci"] else ""
    gb = lambda d: ", ".join(f"{k} {v:.1f}" for k, v in d.items() if v)  # noqa: E731
    return {"fastest configuration here (opt-in where its dtype is not voxcpm's default)": cfg,
            f"its decode step / voxcpm's default ({r['default']}, upstream), 95% interval": f"{r['ratio']:.2f}{ci}",
            "upstream decode step per dtype / default": ", ".join(f"{k} {v:.2f}x" for k, v in r["others"].items()),
            "weights GB per dtype": gb(r["weights_gb"]), "peak GB per dtype, decoding": gb(r["peak_gb"]) or "n/a",
            "native bf16 on this CPU": r["native_bf16"]}


def sizing_line(rec: dict) -> str:
    """What the time budget did to a ``dtype_decode`` record's steps, per dtype (or that it set none)."""
    if not rec["sizing"]:
        return f"whole decodes: {rec['params']['steps']} steps per generate in every dtype (no time budget given)"
    parts = [f"{d}: {s['steps']} steps (warm-up step {s['warm_step_s']:.2f} s, {s['budget_s']:.0f} s for it)"
             for d, s in rec["sizing"].items()]
    scaled = [d for d, s in rec["sizing"].items() if s["steps"] < rec["params"]["steps"]]
    why = (f"; scaled down from {rec['params']['steps']} to fit the runner's {rec['params']['budget_s']:.0f} s "
           f"(n of every median below says so)" if scaled else "")
    return "whole decodes sized to the time left: " + "; ".join(parts) + why
