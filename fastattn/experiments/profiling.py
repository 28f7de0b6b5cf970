"""Notebook 05's readings of its records: the headline, warm vs cold calls, a decode step vs its
attention calls, and bf16 vs fp32. Pure functions of records; they measure nothing."""

from __future__ import annotations

from ..bench.decode import time_shares
from ..bench.records import find_row

__all__ = ["headline", "headline_key", "floor_reading", "warm_vs_cold", "step_vs_call", "dtype_reading"]


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


def step_vs_call(dec: dict, warm: dict, cold: dict, position: int = 256) -> dict:
    """What one decode step saves per layer, beside what one isolated attention call saves (reference ->
    exact), warm and cold: the step's saving is judged against the call that reads K/V as the step does."""
    up, pa = (find_row(dec["rows"], variant=v, position=position) for v in ("upstream", "patched"))
    per_layer = (up["median_ms"] - pa["median_ms"]) / dec["params"]["layers"]
    saved = {name: find_row(rec["rows"], mode="reference", position=position)["median_ms"]
             - find_row(rec["rows"], mode="exact", position=position)["median_ms"]
             for name, rec in (("warm", warm), ("cold", cold))}
    inside = (up.get("attention_in_step_ms"), pa.get("attention_in_step_ms"))
    in_step = inside[0] - inside[1] if None not in inside else None
    return {"position": position, "dtype": dec["params"]["dtype"],
            "decode step saving per layer ms": per_layer,
            "isolated call saving ms, K/V warm": saved["warm"], "isolated call saving ms, K/V cold": saved["cold"],
            "attention kernel saving inside the step ms (profiled)": in_step,
            "step saving / cold call saving": per_layer / saved["cold"],
            "step saving / in-step kernel saving": per_layer / in_step if in_step else None,
            "note": "inside a step each layer streams its weights through the caches between two attention "
                    "calls, leaving K/V colder than an isolated call: the kernel's in-step saving is the one to "
                    "compare"}


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
        "targets met": f"{sum(t['passed'] for t in targets)}/{len(targets)}",
    }
