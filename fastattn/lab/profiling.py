"""Notebook 05's readings of its records (headline, warm vs cold, step vs call, bf16 vs fp32, its findings), which
the run report reads too; they measure nothing."""

from __future__ import annotations

from typing import Optional

from .bench.decode import whole_dtypes  # noqa: F401 (05 calls it through this module)
from .bench.metrics import (
    attention_free_ratio,
    attention_record,
    call_ratio,
    dtype_recommendation,
    kv_mb,
    patched_is_upstream,
    split_line,
    step_ratio,
    time_shares,
    whole_ratio,
)
from .bench.records import Run, find_row
from .bench.stats import fmt_ci
from .bench.targets import TARGETS_MET, met_count, run_targets

__all__ = ["findings", "headline", "headline_key", "floor_reading", "warm_vs_cold", "step_vs_call", "dtype_reading",
           "fast_table", "fast_chose", "patched_steps_identical", "amdahl_line", "memory_summary", "growth_table",
           "whole_dtypes", "dtype_recommendation", "dtype_findings", "sizing_line"]


def warm_vs_cold(warm: dict, cold: dict) -> list[dict]:
    """Per mode and position, one call with K/V warm (one cache, re-read) vs rotated over many caches (colder)."""
    return [{"mode": c["mode"], "position": c["position"], "warm ms": w["median_ms"], "rotated ms": c["median_ms"],
             "rotated / warm": c["median_ms"] / w["median_ms"], "rotated x floor": c.get("x_floor"),
             "n": min(w["n"], c["n"])}
            for c in cold["rows"] if (w := find_row(warm["rows"], mode=c["mode"], position=c["position"]))]


def step_vs_call(dec: dict, warm: dict, cold: dict, position: int = 256) -> dict:
    """A decode step's saving per layer beside an isolated call's (reference -> exact), warm and cold (``note``)."""
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
    ratio = lambda saving: None if same_call or saving is None or saving <= 0 else per_layer / saving  # noqa: E731
    return {"position": position, "dtype": dec["params"]["dtype"],
            "decode step saving per layer ms": per_layer,
            "isolated call saving ms, K/V warm": saved["warm"], "isolated call saving ms, K/V rotated": saved["cold"],
            "attention kernel saving inside the step ms (profiled)": in_step,
            "step saving / rotated call saving": ratio(saved["cold"]),
            "step saving / in-step kernel saving": ratio(in_step),
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
    fa, gm = (find_row(cold["rows"], mode=m, position=position) for m in ("fast", "gemm_floor"))
    x_gemm = call_ratio(cold, "fast", "gemm_floor", position)
    return {"position": position, "x_dram_floor": fa["x_floor"],
            "x_gemm_floor": x_gemm.value if x_gemm else float("nan"),
            "gemm_x_dram_floor": gm["x_floor"] if gm else float("nan")}


def findings(run: Run, targets: Optional[list] = None) -> dict:
    """05's findings from its records (a run folder or a notebook's own), as 05 prints and a report derives them;
    ``targets``: :func:`.bench.targets.run_targets` of ``run`` if held. ValueError naming the records a run lacks."""
    att = {dt: attention_record(run, dt) for dt in ("float32", "bfloat16")}
    cold = attention_record(run, "float32", cold=True)
    dec = {dt: run.get("decode_step", dtype=dt) for dt in ("bfloat16", "float32")}
    whole, costs, rss, dd = (run.get(k) for k in ("whole_decode", "dtype_costs", "peak_rss", "dtype_decode"))
    have = {"attention float32": att["float32"], "attention bfloat16": att["bfloat16"], "attention rotated": cold,
            "decode_step bfloat16": dec["bfloat16"], "decode_step float32": dec["float32"], "whole_decode": whole,
            "dtype_costs": costs, "peak_rss": rss, "dtype_decode": dd}
    missing = [k for k, rec in have.items() if rec is None]
    if missing:
        raise ValueError(f"05's findings rest on its records; {run.folder} lacks: {', '.join(missing)}")
    cold_ps = cold["params"]["positions"]
    p0 = 256 if 256 in cold_ps else cold_ps[0]
    h = headline(att, dec, whole, run_targets(run) if targets is None else targets, position=p0)
    fl = floor_reading(cold, 4096 if 4096 in cold_ps else cold_ps[-1])
    h[f"fast at p={fl['position']}, fp32, K/V rotated over caches: x DRAM floor"] = fl["x_dram_floor"]
    h[f"fast at p={fl['position']}, fp32, K/V rotated over caches: x the bare GEMMs' time"] = fl["x_gemm_floor"]
    h["decode step fp32 saving per layer / rotated call saving"] = step_vs_call(
        dec["float32"], att["float32"], cold, p0)["step saving / rotated call saving"]
    h["peak RSS patched - upstream (MB)"] = rss["summary"]["peak_difference_bytes"] / 1e6
    h["bf16 / fp32 cost of SDPA over the slice"] = costs["ratios"]["SDPA over the slice"]
    h.update(dtype_findings(dtype_recommendation(dd, dd.get("flags"))))
    if (split := run.get("step_split")) is not None:  # runs before it was measured lack it
        h["a decode step against the machine"] = split_line(split)
    return h


def headline_key(items: dict) -> list[str]:
    want = ("attention fp32 at p=", "decode step bf16", "whole decode (", "targets met")
    return [next(k for k in items if k.startswith(w) and "fast" not in k) for w in want]


def headline(att: dict, dec: dict, whole: dict, targets: list, position: int = 256) -> dict:
    """05's headline: call and step ratios at ``position``, the whole decode, the LM attention share, targets met."""
    val = lambda fig: fig.value if fig else float("nan")  # noqa: E731
    a, d16, d32 = att["float32"], dec["bfloat16"], dec["float32"]
    share = {v: time_shares(whole, v)["lm_attention"] for v in ("upstream", "patched")}
    p, ratio = whole["params"], whole_ratio(whole)
    return {
        f"attention fp32 at p={position}: exact / reference": val(call_ratio(a, "exact", "reference", position)),
        f"attention fp32 at p={position}: fast / reference": val(call_ratio(a, "fast", "reference", position)),
        f"decode step bf16 at p={position}: patched / upstream": val(step_ratio(d16, position)),
        f"decode step fp32 at p={position}: patched / upstream": val(step_ratio(d32, position)),
        f"whole decode ({p['preset']}, {p['dtype']}, {p['steps']} steps, n={ratio.n}): patched / upstream wall":
            ratio.value,
        "whole decode output bit-identical": whole["identical"],
        "LM decode attention share of wall time (upstream, patched)":
            f"{share['upstream']:.2f}, {share['patched']:.2f}",
        TARGETS_MET: met_count(targets),
    }


def fast_table(att: dict, positions) -> list[dict]:
    """Per dtype and position: ``fast`` beside the slice fix, x the DRAM floor (binds: None if LLC unknown), errors."""
    rows = []
    for dt, rec in att.items():
        for p in positions:
            f, s, r = (find_row(rec["rows"], mode=m, position=p) for m in ("fast", "slice_fix", "reference"))
            if f and s and r:
                rows.append({"dtype": dt, "position": p, "fast ms": f["median_ms"], "slice fix ms": s["median_ms"],
                             "fast / slice fix": call_ratio(rec, "fast", "slice_fix", p).value,
                             "fast x floor": f["x_floor"], "floor binds (K/V > LLC)": f["floor_meaningful"],
                             "fast err": f["max_err_f64"], "reference err": r["max_err_f64"], "n": f["n"]})
    return rows


def fast_chose(att: dict) -> dict:
    return {dt: [c["winner"] for c in rec.get("fast_choice", [])] for dt, rec in att.items()}


def patched_steps_identical(dec: dict) -> bool:
    return all(r["bit_identical"] for rec in dec.values() for r in rec["rows"] if r["variant"] == "patched")


def amdahl_line(whole: dict) -> str:
    """The whole decode in one sentence: ratio, identity, and the attention-free estimate from the LMs' share."""
    share, bound, wall = time_shares(whole)["lm_attention"], attention_free_ratio(whole), whole["median_wall_s"]
    ratio = whole_ratio(whole).value
    same = " (no exact window on this device: the patched decode is upstream's computation)" \
        if patched_is_upstream(whole) else ""
    return (f"patched / upstream wall: {ratio:.2f}, output bit-identical: {whole['identical']}{same}. "
            f"Upstream {wall['upstream']:.1f} s, of which LM decode attention {share:.0%}; if that "
            f"attention cost nothing: {bound * wall['upstream']:.1f} s ({bound:.2f}x). Patched reaches "
            f"{wall['patched']:.1f} s ({ratio:.2f}x)" + (", below that estimate: the fix removed more than the timed "
                                                         "attention" if ratio < bound else "") + ".")


def memory_summary(kv: dict, alloc: dict, rss: dict) -> dict:
    """05's memory findings, each labelled with where it was measured (peak RSS: CPU processes, on any device)."""
    on = alloc["env"].get("device", "cpu")
    return {f"KV MB, full model, {kv['params']['prefill'] + kv['params']['steps']}-token request (upstream, patched)":
            kv_mb(kv),
            "patched KV right-sized on this device": kv.get("right_sized", True),
            f"bytes allocated by one decode layer step on {on} (upstream, patched)":
            tuple(alloc["variants"][v]["allocated_bytes"] for v in ("upstream", "patched")),
            "peak RSS difference patched - upstream MB, CPU processes (spread between processes MB)":
            (rss["summary"]["peak_difference_bytes"] / 1e6, rss["summary"]["peak_spread_bytes"] / 1e6),
            "KV MB the patched caches do not hold, CPU processes": rss["summary"]["cache_bytes_saved"] / 1e6}


def growth_table(growth: dict) -> list[dict]:
    """One row per request length of :func:`fastattn.lab.bench.cache_growth` records."""
    return [{"request steps": n, "moves": s["moves"], "total in step() ms": s["step_total_s"] * 1e3,
             "largest step ms": s["max_step_ms"], "bound held every step": s["bound_held_every_step"],
             "final capacity": s["final_capacity"], "right-sized here": s.get("right_sized", True),
             "upstream zero-fill per request ms": s["upstream_fill_ms"]}
            for n, s in ((n, g["summary"]) for n, g in growth.items())]


def dtype_findings(r: dict) -> dict:
    """05's findings from :func:`dtype_recommendation`: the dtype to run, its ratio and interval, its memory."""
    cfg = r["dtype"] + (" + patch" if r["patched"] else "")
    gb = lambda d: ", ".join(f"{k} {v:.1f}" for k, v in d.items() if v)  # noqa: E731
    return {"fastest configuration here (opt-in where its dtype is not voxcpm's default)": cfg,
            f"its decode step / voxcpm's default ({r['default']}, upstream), 95% interval": r["ratio_text"],
            "upstream decode step per dtype / default": ", ".join(f"{k} {v:.2f}x" for k, v in r["others"].items()),
            "weights GB per dtype": gb(r["weights_gb"]), "peak GB per dtype, decoding": gb(r["peak_gb"]) or "n/a",
            "bf16 instructions on this CPU": r.get("cpu_features") or (
                f"n/a: a {r['device']} run" if not r["device"].startswith("cpu") else "not recorded")}


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


def split_table(rec: dict) -> list[dict]:
    """A ``step_split`` record as a table: per phase and component its bytes, FLOPs, rate, floor, time, efficiency."""
    return [{"phase": r["phase"], "component": r["component"], "weights read MB": r["bytes"] / 1e6,
             "GFLOP": r["flops"] / 1e9, "GB/s at its shapes": r["gb_per_s"], "floor ms": r["floor_s"] * 1e3,
             "bound": r["bound"], "time ms": r["time_s"] * 1e3, "95% CI ms": fmt_ci(r["time_ci"] and tuple(
                 x * 1e3 for x in r["time_ci"])), "floor / time": r["efficiency"]} for r in rec["rows"]]
