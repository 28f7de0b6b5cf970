"""Sizing the default workbook to this machine: a probe, one plan, 05's own deadline; ``-p`` values never change."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Optional

from fastattn.devices import resolve_device
from fastattn.models import build_voxcpm2, silence_progress

from .bench.stream import text_for, time_chunks
from .machine import cpu_flags
from .paths import data_dir, notebooks

__all__ = ["BUDGET_S", "SCALABLE", "probe", "calibration", "plan", "profile_estimate", "notebook_budget",
           "plan_lines"]

BUDGET_S = 600.0
#: the share of the budget the plan fills: the estimates are estimates (05 then sizes its last part to the time left)
FILL = 0.9
#: the sized parameters: notebook, default, minimum (a trend needs six sixths of 10 chunks and two repeats; a
#: dtype ratio two steps a run; a sweep's interval 5 repeats)
SCALABLE = {"chunks": ("01_root_cause", 480, 60), "steps": ("05_profiling", 12, 3), "repeats": ("05_profiling", 9, 5)}
#: streams in 01 (two variants, two repeats) and whole decodes in 05 (two dtypes x two variants x two repeats)
STREAMS, DECODES = 4, 8
DTYPES = ("bfloat16", "float32")


#: what a CPU's bf16 runs on, which decides how its time compares with another's: AMX tiles, bf16 instructions
#: (AVX-512 BF16, Arm BF16) or fp32 conversion; each class is calibrated on a machine of its own
KERNEL_CLASSES = ("bf16-amx", "bf16-native", "bf16-emulated")
#: the probe's kernels: a ``small``-preset chunk in each dtype (the LMs' GEMMs) and a ``tiny`` one in float32 (a
#: step of few FLOPs: dispatch, Python, the allocator)
PROBES = {"bfloat16": ("small", "bfloat16"), "float32": ("small", "float32"), "host": ("tiny", "float32")}
#: the probe each notebook's fixed work follows, from its cells' durations in the calibration runs: 01's fixed
#: cells stream the small model in bf16 (real audio, the consumer beside it); 03's are attention calls, mostly
#: float32; 02's imports and single calls, 04's tiny-model decodes and compiles, and 05's fresh processes (peak RSS)
#: and cache walks are host work (05's sweeps, scaled apart, follow float32)
FOLLOWS = {"01_root_cause": "bfloat16", "02_backend_selection": "host", "03_causality_checks": "float32",
           "04_patch_application": "host", "05_profiling": "host"}


def kernel_class(device="cpu", flags: Optional[dict] = None) -> str:
    """This machine's kernel class (:data:`KERNEL_CLASSES`), or the device type for an accelerator."""
    if str(device) != "cpu":
        return str(device).split(":")[0]
    flags = cpu_flags() if flags is None else flags
    if flags.get("amx_bf16"):
        return "bf16-amx"
    return "bf16-native" if flags.get("avx512_bf16") or flags.get("bf16") else "bf16-emulated"


def probe(device="cpu", *, chunks: int = 10) -> dict:
    """Per :data:`PROBES` kernel, median ms of a streamed chunk (first two left out) and build s; the kernel class."""
    device = resolve_device(device)
    rows = []
    for name, (preset, dtype) in PROBES.items():
        t0 = time.perf_counter()
        model = build_voxcpm2(preset, device=str(device), dtype=dtype)
        build_s = time.perf_counter() - t0
        silence_progress()
        gen = model.generate_streaming(text_for(chunks), min_len=chunks, max_len=chunks, inference_timesteps=2)
        times = [r["ms"] for r in time_chunks(gen, device)[1]]
        rows.append({"kernels": name, "preset": preset, "dtype": dtype, "chunk_ms": statistics.median(times[2:]),
                     "n": len(times) - 2, "build_s": build_s})
        del model
    return {"kind": "budget_probe", "device": str(device), "kernel_class": kernel_class(device), "rows": rows}


def probe_ms(probe_rec: dict) -> dict:
    """``{kernels: chunk ms}`` of a probe (a row without ``kernels`` is its dtype's small-preset chunk)."""
    return {r.get("kernels", r["dtype"]): r["chunk_ms"] for r in probe_rec["rows"]}


def unplannable(device) -> Optional[str]:
    """Why no time plan can be made for ``device`` (calibrations are CPU runs), or None."""
    if str(device).split(":")[0] == "cpu":
        return None
    return (f"no time plan on {device}: the calibrations are CPU runs and do not model GPU compile time; the "
            "notebooks run at their defaults (a profile, --profile, sets sizes for a GPU)")


def calibration(kernels: Optional[str] = None, path: Optional[Path] = None) -> dict:
    """The calibration of class ``kernels`` (None: this machine's), else the nearest one's (``for_class``)."""
    want = kernels or kernel_class()
    if path is None:
        order = [want] + [k for k in KERNEL_CLASSES[::-1 if want == "bf16-emulated" else 1] if k != want]
        path = next(p for p in (data_dir() / "budget" / f"{k}.json" for k in order) if p.exists())
    cal = json.loads(Path(path).read_text())
    return dict(cal, kernel_class=cal.get("kernel_class", Path(path).stem), for_class=want)


def _speed(probe_rec: dict, cal: dict) -> dict:
    """This machine's time over the calibration's, per probed kernel (> 1: slower)."""
    here, ref = probe_ms(probe_rec), probe_ms(cal["probe"])
    out = {d: here[d] / ref[d] for d in here if d in ref}
    out.setdefault("host", out.get("float32", 1.0))
    return out


def _whole_seconds(steps: int, step_s: dict, build_s: float, repeats: int) -> float:
    """05's whole decodes (s): per dtype a build, a warm-up, two variants x ``repeats`` of ``steps``."""
    return sum(DECODES / len(step_s) * repeats / 2 * (steps + 1) * s + 2 * s + build_s for s in step_s.values())


def _estimates(probe_rec: dict, cal: dict) -> dict:
    """This machine's estimates: fixed s per notebook (by :data:`FOLLOWS`), chunk ms, full step and build s."""
    speed, chunk = _speed(probe_rec, cal), probe_ms(probe_rec)
    of = lambda nb: speed.get(FOLLOWS.get(nb, "float32"), speed.get("float32", 1.0))  # noqa: E731
    return {"speed": speed, "fixed_s": {nb: s * of(nb) for nb, s in cal["fixed_s"].items()},
            "sweep_s": cal["sweep_s"] * speed.get("float32", 1.0),
            "chunk_ms": chunk["bfloat16"] if "bfloat16" in chunk else next(iter(chunk.values())),
            "full_step_s": {d: chunk[d] / 1e3 * cal["full_over_small"][d] for d in DTYPES if d in chunk},
            "full_build_s": cal["full_build_s"] * speed.get("float32", 1.0),
            "calibration": cal.get("kernel_class"), "for_class": cal.get("for_class")}


def plan(probe_rec: dict, notebooks, *, given: Optional[dict] = None, budget_s: float = BUDGET_S,
         stream_preset: str = "small", whole_repeats: int = 2) -> dict:
    """The parameters that fit ``budget_s`` for ``notebooks`` (stems); ``given`` ones are kept.
    Returns {budget_s, params, scaled: [{param, default, value, why}], estimate_s: {stem: s}, total_s, sizes, ...}."""
    given = dict(given or {})
    cal = calibration(probe_rec.get("kernel_class"))
    est = _estimates(probe_rec, cal)
    if stream_preset == "full":  # 01 streams the full model: its chunk is a full decode step, not the probe's
        est["chunk_ms"] *= cal["full_over_small"]["bfloat16"]
    stems = [Path(n).stem for n in notebooks]
    per_nb = {s: est["fixed_s"].get(s, 0.0) for s in stems}
    sizes = {name: given.get(name, d) for name, (nb, d, _) in SCALABLE.items() if nb in stems}
    cost = {"chunks": lambda v: STREAMS * v * est["chunk_ms"] / 1e3,  # seconds of a sized measurement at size v
            "repeats": lambda v: est["sweep_s"] * v / SCALABLE["repeats"][1],  # 05's sweeps, linear in their repeats
            "steps": lambda v: _whole_seconds(v, est["full_step_s"], est["full_build_s"], whole_repeats)}
    free = {n for n in sizes if n not in given}
    room = FILL * budget_s - sum(per_nb.values()) - sum(cost[n](sizes[n]) for n in sizes if n not in free)
    factor, pinned = _fit(free, sizes, cost, room)
    speed = ", ".join(f"{d} {s:.2f}x" for d, s in est["speed"].items())
    what = {"chunks": "01's stream", "steps": "05's whole decodes", "repeats": "05's sweeps"}
    scaled = []
    for n in sorted(free):  # the largest size that fits its share (the float error never drops one that fits)
        lo, share = SCALABLE[n][2], factor * cost[n](sizes[n]) * (1 + 1e-9)
        value = lo if n in pinned else max((v for v in range(lo, sizes[n] + 1) if cost[n](v) <= share), default=lo)
        if value != sizes[n]:
            why = (f"{what[n]} at the default would not fit {budget_s:.0f} s here (this machine's speed against the "
                   f"calibration: {speed}); scaled by {factor:.2f}, not below the minimum {lo}")
            scaled.append({"param": n, "default": sizes[n], "value": value, "why": why})
        sizes[n] = value
    for n, v in sizes.items():
        per_nb[SCALABLE[n][0]] += cost[n](v)
    return {"budget_s": budget_s, "params": {s["param"]: s["value"] for s in scaled}, "scaled": scaled,
            "estimate_s": per_nb, "total_s": sum(per_nb.values()), "speed": est["speed"], "sizes": sizes,
            "whole_s": cost["steps"](sizes["steps"]) if "steps" in sizes else 0.0,
            "calibration": est["calibration"], "for_class": est["for_class"],
            "at_minimum": bool(free) and all(sizes[n] == SCALABLE[n][2] for n in free)}


def profile_estimate(probe_rec: dict, notebooks, sizes: dict) -> dict:
    """``{stem: seconds}`` of the notebooks at a profile's sizes (``{stem: {param: value}}``; nothing scaled)."""
    given = {k: v for stem, ps in sizes.items() for k, v in ps.items() if k in SCALABLE and SCALABLE[k][0] == stem}
    preset = sizes.get("01_root_cause", {}).get("preset", "small")
    return plan(probe_rec, notebooks, given=given, budget_s=1e9, stream_preset=preset,
                whole_repeats=sizes.get("05_profiling", {}).get("whole_repeats", 2))["estimate_s"]


def _fit(free: set, sizes: dict, cost: dict, room: float) -> tuple:
    """Water-filling: (share of default cost each free measurement gets to fit ``room``, those pinned at minimum)."""
    pinned: set = set()
    while True:
        left = free - pinned
        r = room - sum(cost[n](SCALABLE[n][2]) for n in pinned)
        want = sum(cost[n](sizes[n]) for n in left)
        factor = min(1.0, max(r, 0.0) / want) if want else 1.0
        low = {n for n in left if cost[n](SCALABLE[n][2]) > factor * cost[n](sizes[n])}
        if not low:
            return factor, pinned
        pinned |= low


def plan_lines(p: dict) -> list:
    """The plan as the runner prints it, one line per notebook and per scaled parameter."""
    sizes, cal, want = p["sizes"], p.get("calibration"), p.get("for_class")
    source = (f"the {cal} calibration (this machine's kernel class), scaled by this machine's probe" if cal == want
              or not want else f"no calibration for this machine's kernel class ({want}); the {cal} one scaled by "
              "this machine's probe, so expect a wider error (05 sizes its whole decodes to the time left)")
    out = [f"plan: about {p['total_s']:.0f} s of notebooks against a {p['budget_s']:.0f} s budget",
           f"  estimates: {source}"]
    what = {"chunks": "streams {} chunks", "repeats": "sweeps of {} repeats", "steps": "whole decodes of {} steps"}
    for stem, s in p["estimate_s"].items():
        said = ", ".join(w.format(sizes[n]) for n, w in what.items() if n in sizes and SCALABLE[n][0] == stem)
        out.append(f"  {stem}{': ' + said if said else ''}, about {s:.0f} s")
    out += [f"  scaled {s['param']} {s['default']} -> {s['value']}: {s['why']}" for s in p["scaled"]]
    if p.get("at_minimum") and p["total_s"] > p["budget_s"]:
        out.append(f"  even at their minimum sizes the notebooks need about {p['total_s']:.0f} s, more than the "
                   f"{p['budget_s']:.0f} s budget: the run goes on at the minimums (a smaller one decides nothing) "
                   "and takes longer; --budget 0 runs the defaults, -p sets any size")
    return out


def notebook_budget(p: dict, elapsed_s: float, stem: str = "05_profiling") -> float:
    """Seconds ``stem`` may take after ``elapsed_s``: the fill left, at least its fixed work + 1/3 its sized."""
    fixed = p["estimate_s"].get(stem, 0.0) - p.get("whole_s", 0.0)
    return max(fixed + p.get("whole_s", 0.0) / 3, FILL * p["budget_s"] - elapsed_s)


def main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="python -m fastattn budget", description="Probe this machine and print the "
                                 "workbook's plan (scripts/calibrate_budget.py writes the calibration it reads).")
    ap.add_argument("--budget", type=float, default=BUDGET_S, help="seconds of notebooks (default %(default)s)")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    print("\n".join(plan_lines(plan(probe(args.device), [p.stem for p in notebooks()], budget_s=args.budget))))
    return 0
