"""The headline numbers, each computed once from records here; every report prints what these return."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import NamedTuple, Optional

from fastattn.models import MAX_LENGTH

from ..machine import cpu_features, machine_label, native_bf16
from .records import Run, find_row, load_record, save_order
from .stats import YES, fmt_ci, judge, quiet_ratio, ratio_ci, scaled_ci


class Figure(NamedTuple):
    value: float
    ci: Optional[tuple] = None
    n: Optional[int] = None
    dropped: int = 0

    def text(self, unit: str = "x") -> str:
        """``0.361x (95% CI [0.316, 0.373], n=15)``, with the disturbed rounds left out where there are."""
        left = f", {self.dropped} disturbed rounds left out" if self.dropped else ""
        return f"{self.value:.3g}{unit}" + ("" if self.ci is None else f" (95% CI {fmt_ci(self.ci)}, n={self.n}{left})")


def _rows_ratio(rec: dict, key: str, num: str, den: str, position: int) -> Optional[Figure]:
    """Two timed rows of one interleaved timing at ``position``: :func:`.stats.quiet_ratio`; None without both."""
    a, b = (find_row(rec["rows"], **{key: v, "position": position}) for v in (num, den))
    return Figure(*quiet_ratio(a, b)) if a and b else None


def call_ratio(att: dict, num: str, den: str, position: int = 256) -> Optional[Figure]:
    """One attention call (an ``attention`` sweep's rows): mode ``num`` over mode ``den`` at ``position``."""
    return _rows_ratio(att, "mode", num, den, position)


def step_ratio(dec: dict, position: int = 256, num: str = "patched", den: str = "upstream") -> Optional[Figure]:
    """One decode step (a ``decode_step`` sweep's rows): variant ``num`` over ``den`` at ``position``."""
    return _rows_ratio(dec, "variant", num, den, position)


def attention_share(dec: dict, position: int = 256) -> Optional[dict]:
    """Upstream's in-step attention / layer time (``share``: the most the patch can remove) beside the step ratio."""
    up = find_row(dec["rows"], variant="upstream", position=position)
    fig = step_ratio(dec, position)
    if not up or up.get("attention_in_step_ms") is None or fig is None:
        return None
    return {"attention_ms": up["attention_in_step_ms"], "layer_ms": up["per_layer_ms"],
            "share": up["attention_in_step_ms"] / up["per_layer_ms"], "ratio": fig.value, "position": position}


def attention_share_line(dec: dict, position: Optional[int] = None) -> str:
    """:func:`attention_share` in a sentence (default position: 256 where swept, else the last)."""
    ps = dec["params"]["positions"]
    position = position if position is not None else 256 if 256 in ps else ps[-1]
    a = attention_share(dec, position)
    if a is None:
        return "this decode-step record did not time the attention inside the step"
    return (f"at p={position}, upstream's {dec['params']['dtype']} attention call takes {a['attention_ms']:.3g} ms of "
            f"a {a['layer_ms']:.3g} ms layer ({a['share']:.0%}); the patched step takes {a['ratio']:.2f}x upstream's "
            f"({1 - a['ratio']:.0%} less)")


def whole_ratio(whole: dict) -> Figure:
    """A ``whole_decode`` record's patched / upstream wall time, paired by repeat."""
    up, pa = ([r["wall_s"] for r in whole["rows"] if r["variant"] == v] for v in ("upstream", "patched"))
    return Figure(statistics.median(pa) / statistics.median(up), ratio_ci(pa, up), min(len(up), len(pa)))


def floor_x(att: dict, position: int) -> Optional[Figure]:
    """fast's time over the DRAM floor at ``position`` (``x_floor``), with its interval."""
    row = find_row(att["rows"], mode="fast", position=position)
    if not row:
        return None
    ci = scaled_ci(row["samples_ms"], row["floor_ms"]) if "samples_ms" in row else None
    return Figure(row["x_floor"], ci, row.get("n"))


def time_shares(whole: dict, variant: str = "upstream") -> dict:
    """Median share of ``variant``'s wall time per component of a ``whole_decode`` record."""
    rows = [r for r in whole["rows"] if r["variant"] == variant]
    wall = statistics.median(r["wall_s"] for r in rows)
    keys = [k[:-2] for k in rows[0] if k.endswith("_s") and k != "wall_s"]
    return {k: statistics.median(r[f"{k}_s"] for r in rows) / wall for k in keys}


def attention_free_ratio(whole: dict) -> float:
    """Patched / upstream wall were the LMs' decode attention free: an estimate, not a bound (the patch does more)."""
    return 1 - time_shares(whole)["lm_attention"]


def kv_mb(kv: dict) -> tuple:
    """A ``kv_memory`` record's (upstream, patched) MB, both LMs."""
    return kv["upstream_bytes"] / 1e6, kv["patched_bytes"] / 1e6


def patched_is_upstream(whole: dict) -> bool:
    """Whether a ``whole_decode`` record's patched decode was upstream's computation (False if it does not say)."""
    return "patched_granularity" in whole and whole["patched_granularity"] is None


def step_floor(split: dict, phase: str = "step") -> Figure:
    """A ``step_split`` phase's measured time over its floor (its components' floors summed): 1 is the machine."""
    p = split["phases"][phase]
    ci = p["wall_ci"] and (p["wall_ci"][0] / p["floor_s"], p["wall_ci"][1] / p["floor_s"])
    return Figure(p["wall_s"] / p["floor_s"], ci, p["n"], p["dropped"])


def split_line(split: dict) -> str:
    """A decode step against the machine in one sentence: its share of its floor, largest component, biggest lever."""
    s, lv, par = split["phases"]["step"], split["lever"], split["params"]
    top = max((r for r in split["rows"] if r["phase"] == "step"), key=lambda r: r["time_s"])
    return (f"a decode step ({par['preset']}, {par['dtype']}, patched) runs at {s['efficiency']:.2f} of its floor: "
            f"{s['wall_s'] * 1e3:.0f} ms against {s['floor_s'] * 1e3:.0f} ms ({s['n']} steps); {top['component']} "
            f"takes {top['time_s'] / s['wall_s']:.0%} of it; the biggest lever is {lv['component']}, "
            f"{lv['headroom_s'] * 1e3:.0f} ms a step above its floor ({lv['bound']}-bound)")


def compile_line(rec: dict) -> str:
    """A ``compiled_decode`` record in one sentence per variant: compiled / eager with its interval, the compile,
    the output's difference."""
    p = rec["params"]
    n = lambda o: o.get("rounds_used", len(o["wall_s"]["eager"]))  # noqa: E731 (the rounds no sample was disturbed in)
    parts = [f"{v}: compiled / eager {Figure(o['ratio'], o['ratio_ci'], n(o)).text()}, compile "
             f"plus first decode {o['compile_and_first_s']:.0f} s, max |compiled - eager| {o['max_abs_diff']:.2g} "
             f"(output rms {o['output_rms']:.2g})" + (f", failed: {o['failed']}" if o["failed"] else "")
             for v, o in rec["variants"].items()]
    return (f"whole decode ({p['preset']}, {p['dtype']}, {p['steps']} steps) compiled with inductor on "
            f"{rec['env']['device']}: " + "; ".join(parts))


def vae_ratio(rec: dict) -> Figure:
    """A ``vae_stream`` record's patched / upstream stream time, over the rounds neither was disturbed in."""
    return Figure(*quiet_ratio(find_row(rec["rows"], variant="patched"), find_row(rec["rows"], variant="upstream")))


def vae_line(rec: dict) -> str:
    """A ``vae_stream`` record in one sentence: the patch's once-a-stream VAE weights against upstream's."""
    p = rec["params"]
    return (f"the AudioVAE's streaming decode ({p['preset']}, {p['chunks']} chunks of {p['frames_per_chunk']} frames, "
            f"{p['weight_norm_convs']} weight-normed convs) with each weight computed once a stream: "
            f"{vae_ratio(rec).text()} of upstream's time, audio "
            + ("bit-identical" if rec["identical"] else "NOT bit-identical (a bug: the fix is meant to be exact)"))


def attention_record(run: Run, dtype: str, cold: bool = False, capacity: Optional[int] = None) -> Optional[dict]:
    """05's attention sweep (not 01's, reference only); ``cold``: K/V rotated over caches; ``capacity``: its slots."""
    return next((r for r in run.all("attention", dtype=dtype) if (r["params"].get("caches", 1) > 1) == cold
                 and capacity in (None, r["params"].get("capacity")) and "fast" in r["params"].get("modes", ("fast",))),
                None)


def _on(find, figure):
    """``fn(run)``: ``figure`` of the record ``find(run)`` finds; None without one."""
    return lambda run: None if (rec := find(run)) is None else figure(rec)


def _att(dtype: str, cold: bool = False):
    return lambda run: attention_record(run, dtype, cold, capacity=MAX_LENGTH)  # headlines: full-cache sweeps only


_SHORT = {"float32": "fp32", "bfloat16": "bf16"}
#: name -> fn(run): the figures every report quotes, from a run's or a committed folder's records
HEADLINES = {
    **{f"{num} / reference, one call, p=256, {_SHORT[dt]}":
       _on(_att(dt), lambda a, num=num: call_ratio(a, num, "reference")) for dt in _SHORT for num in ("exact", "fast")},
    **{f"fast / slice fix, one call, p=4096, {_SHORT[dt]}":
       _on(_att(dt), lambda a: call_ratio(a, "fast", "slice_fix", 4096)) for dt in _SHORT},
    **{f"fast x DRAM floor, one call, p=4096, {_SHORT[dt]}, K/V rotated over caches":
       _on(_att(dt, cold=True), lambda a: floor_x(a, 4096)) for dt in _SHORT},
    **{f"patched / upstream, decode step, p=256, {_SHORT[dt]}":
       _on(lambda run, dt=dt: run.get("decode_step", dtype=dt), step_ratio) for dt in ("bfloat16", "float32")},
    "patched / upstream, whole decode": _on(lambda run: run.get("whole_decode"), whole_ratio),
}


def headlines(run: Run) -> dict:
    """``{name: Figure}`` of :data:`HEADLINES` that the run's records hold (absent ones are left out)."""
    return {k: v for k, v in ((k, fn(run)) for k, fn in HEADLINES.items()) if v is not None}


def quiet_steps(whole: dict, variant: str) -> tuple:
    """(quiet step seconds, disturbed count) of a ``whole_decode`` variant; all steps where none was quiet."""
    pairs = [(s, f) for r in whole["rows"] if r["variant"] == variant
             for s, f in zip(r["step_seconds"], r["step_disturbed"])]
    quiet = [s for s, f in pairs if not f]
    return quiet or [s for s, _ in pairs], len(pairs) - len(quiet)


def dtype_table(rec: dict) -> list:
    """One row per dtype and variant of a ``dtype_decode`` record; ratios (each decode's too) are to the first
    dtype's upstream step pooled over its decodes."""
    base_dtype = rec["params"]["dtypes"][0]
    base = quiet_steps(rec["dtypes"][base_dtype]["decode"], "upstream")[0]
    out = []
    for dtype, o in rec["dtypes"].items():
        rows = o["decode"]["rows"]
        for variant in ("upstream", "patched"):
            s, n_disturbed = quiet_steps(o["decode"], variant)
            ci = ratio_ci(s, base, paired=False) or (None, None)
            per = [statistics.median(quiet_steps({"rows": [r for r in rows if r["repeat"] == k]}, variant)[0])
                   / statistics.median(base) for k in sorted({r["repeat"] for r in rows if r["variant"] == variant})]
            out.append({"dtype": dtype, "variant": variant, "step s": statistics.median(s), "n": len(s),
                        "disturbed": n_disturbed, "per decode": per,
                        f"x {base_dtype} upstream": statistics.median(s) / statistics.median(base),
                        "95% low": ci[0], "95% high": ci[1],
                        "steps": o["decode"]["params"]["steps"],
                        "peak GB": o["peak_bytes"] / 1e9 if o["peak_bytes"] else None,
                        "weights GB": o["weights_bytes"] / 1e9,
                        "patched equals upstream": o["decode"]["identical"] if variant == "patched" else None})
    return out


def dtype_recommendation(rec: dict, flags: Optional[dict] = None) -> dict:
    """Which dtype (and patch) to run, from a ``dtype_decode`` record: voxcpm's default (the first dtype) unless
    another's whole 95% interval is below 1. A dtype change alters the output, so ``line`` calls it an opt-in."""
    rows = dtype_table(rec)
    default, best, key = rows[0], min(rows, key=lambda r: r["step s"]), default_key(rows[0])
    ups = [r for r in rows if r["variant"] == "upstream"]
    ci = (best["95% low"], best["95% high"]) if best["95% low"] is not None else None
    decided = best is not default and ci is not None and judge(best[key], ci, 1.0) == YES
    pick = best if decided else default
    out = {"dtype": pick["dtype"], "patched": pick["variant"] == "patched", "ratio": pick[key],
           "ci": ci if decided else None, "decided": decided, "default": default["dtype"],
           "native_bf16": native_bf16(flags) if flags else None, "cpu_features": cpu_features(flags) if flags else None,
           "ratio_text": dtype_ratio_text(pick), "changes_results": pick["dtype"] != default["dtype"],
           "peak_gb": {r["dtype"]: r["peak GB"] for r in ups}, "weights_gb": {r["dtype"]: r["weights GB"] for r in ups},
           "others": {r["dtype"]: r[key] for r in ups}, "others_text": {r["dtype"]: dtype_ratio_text(r) for r in ups},
           "device": str(rec.get("env", {}).get("device", "cpu"))}
    out["line"] = _recommendation_line(out, best)
    return out


def dtype_ratio_text(row: dict) -> str:
    """A :func:`dtype_table` row's ratio as every text prints it: n counts decodes, the interval pools their steps."""
    ci = "n/a" if row["95% low"] is None else f"[{row['95% low']:.2f}, {row['95% high']:.2f}]"
    return (f"{row[default_key(row)]:.2f}x ({len(row['per decode'])} decodes: "
            f"{', '.join(f'{r:.2f}x' for r in row['per decode'])}; 95% CI over their {row['n']} steps {ci})")


def default_key(row: dict) -> str:
    """The ratio column of a :func:`dtype_table` row (``x <default dtype> upstream``)."""
    return next(k for k in row if k.startswith("x "))


def _recommendation_line(r: dict, best: dict) -> str:
    why = {True: f"this CPU's bf16 instructions: {r.get('cpu_features')}", None: "",
           False: "this CPU has no bf16 instructions (no avx512_bf16, amx_bf16 or Arm bf16): torch's bf16 kernels "
                  "convert to fp32 and back"}[r["native_bf16"]]
    why = f" ({why})" if why else ""
    cfg = f"{r['dtype']}{' with the patch' if r['patched'] else ''}"
    if not r["decided"]:
        alt = f"{best['dtype']}{' patched' if best['variant'] == 'patched' else ''}"
        return (f"Keep voxcpm's default ({r['default']}){why}: no other configuration's decode step is faster with its "
                f"whole 95% interval below 1 (the fastest, {alt}, {dtype_ratio_text(best)}).")
    price = ""
    if r["changes_results"]:
        price = (f" Price: weights {r['weights_gb'][r['default']]:.1f} -> {r['weights_gb'][r['dtype']]:.1f} GB"
                 + (f", peak {r['peak_gb'][r['default']]:.1f} -> {r['peak_gb'][r['dtype']]:.1f} GB"
                    if r["peak_gb"].get(r["dtype"]) and r["peak_gb"].get(r["default"]) else "")
                 + f"; {r['dtype']} rounds differently from {r['default']}, so the audio changes: an opt-in "
                 f"(VOXCPM_CPU_DTYPE={r['dtype']} with the proposed upstream override), never a silent default.")
    return (f"Run {cfg}{why}: its decode step takes {r['ratio_text']} of voxcpm's default ({r['default']}, "
            f"upstream); {others_line(r)}.{price}")


def others_line(r: dict) -> str:
    """:func:`dtype_recommendation`'s other dtypes, upstream, each as :func:`dtype_ratio_text` prints it."""
    return "; ".join(f"upstream in {d} takes {t}" for d, t in r["others_text"].items() if d != r["default"])


def newest(folder: Path, pattern: str) -> list:
    """The newest record per stem in ``folder``, by ``save_record``'s ``-N`` suffix (a checkout keeps no file times)."""
    best = {save_order(p)[0]: p for p in sorted(folder.glob(pattern), key=save_order)}  # the last save of a stem wins
    return [load_record(p) for _, p in sorted(best.items())]


def matrix_rows(folder: Path) -> list:
    """The exactness contract per torch (newest record per version): kernel, windows, decodes, kit tests, slice."""
    out = []
    for rec in newest(folder, "exactness-*.json"):
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
                    "slice": by[("slice fix under fullgraph", None)], "machine": machine_label(rec["env"]),
                    "params": rec["params"]})
    return sorted(out, key=lambda r: tuple(int(x) for x in r["torch"].split(".")))


def slice_backend(rows: list) -> tuple:
    """(``backend="..."`` of the matrix rows' slice checks, the note an eager-only trace needs, else "")."""
    # records made before the row carried its backend all came from backend="eager"
    how = ", ".join(sorted({f'backend="{r["slice"].get("backend", "eager")}"' for r in rows}))
    return how, " (a Dynamo trace; inductor and CUDA not run)" if how == 'backend="eager"' else ""


def slice_evidence(folder: Path) -> tuple:
    """(English, Chinese): on which torch versions the slice to ``position + 1`` compiled under ``fullgraph``."""
    rows = matrix_rows(folder)
    if not rows:
        return "", ""
    no = [r["torch"] for r in rows if r["slice"].get("compiles") is False]
    yes = [r["torch"] for r in rows if r["slice"].get("compiles")]
    how, trace = slice_backend(rows)
    en = f"Measured on CPU under `torch.compile(..., {how}, fullgraph=True)`{trace}: torch {', '.join(no) or 'none'}"
    en += " refuse it"
    zh = f"在 CPU 上以 `torch.compile(..., {how}, fullgraph=True)` 实测：torch {'、'.join(no) or '无'} 拒绝"
    if yes:
        en += (f"; torch {', '.join(yes)} traces it, with a length the host does not know (which a CUDA graph "
               "cannot hold, by a reading of torch's sources)")
        zh += f"；torch {'、'.join(yes)} 能追踪，但长度在主机侧未知（按 torch 源码，CUDA graph 无法容纳）"
    return en + ".", zh + "。"
