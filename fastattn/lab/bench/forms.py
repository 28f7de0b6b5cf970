"""The compiled decode forms (:mod:`fastattn.static`) timed as a decode runs them, and the verdict on them."""

from __future__ import annotations

import math
import statistics
from typing import Optional

import torch

from fastattn.devices import dtype_name, dtype_of, resolve_device
from fastattn.static import (
    FORMS,
    check_form,
    compile_form,
    form_caller,
    form_winner,
    fresh_calls,
    geomean,
    layer_stack,
    stack_data,
)

from .records import env_record, find_row, record
from .stats import YES, fmt_ci, quiet, quiet_ratio, ratio_ci, verdict
from .timing import progress_bar, stats_ms, time_interleaved


@torch.no_grad()
def stack_sweep(variants: dict, positions, *, device, dtype, capacity: int, hq: int, hkv: int, head_dim: int,
                bucket: int, repeats: int, warmup: int, seed: int, mode, progress: bool = False) -> list:
    """Timed rows (ms per stack of ``layers`` calls; on CUDA one replay) per variant {name: (form, compiled, static,
    layers)} and position, plus ``per_layer_ms`` and ``host_ms_per_call`` (no sync: harness overhead on CUDA)."""
    data = {s: stack_data(device, dtype, hq, hkv, head_dim, capacity, seed, max(v[3] for v in variants.values()))
            for s in {v[2] for v in variants.values()}}
    hosts = {n: [] for n in variants}
    calls = {}
    for n, (form, comp, static, layers) in variants.items():
        q, caches = data[static]
        fn = compile_form(FORMS[form], mode, layers) if comp else layer_stack(FORMS[form].fn, n)
        calls[n] = form_caller(form, fn, q, caches[:layers], bucket, static=static, host=hosts[n])
    rows = []
    for p in progress_bar(positions, progress, f"forms {dtype_name(dtype)}"):
        for h in hosts.values():
            h.clear()
        counters = {}
        times = time_interleaved(fresh_calls(calls, p, capacity, warmup + repeats, bucket), repeats=repeats,
                                 warmup=warmup, device=device, seed=seed + p, host=counters)
        for n, (form, comp, static, layers) in variants.items():
            st = stats_ms(times[n], counters.get(n))
            rows.append({"variant": n, "form": form, "compiled": comp, "static": static, "layers": layers,
                         "position": p, **st, "per_layer_ms": st["median_ms"] / layers,
                         "host_ms_per_call": statistics.median(hosts[n][warmup:]) * 1e3})
    return rows


def form_sweep(positions, *, device="cpu", dtype="bfloat16", capacity: int = 8192, hq: int = 16, hkv: int = 2,
               head_dim: int = 128, bucket: int = 256, repeats: int = 7, warmup: int = 2, steps: int = 600,
               compiled=(False, True), forms=None, seed: int = 0, progress: bool = True, layers: int = 28) -> dict:
    """The ``decode_forms`` record: every form eager and compiled as stacks of ``layers`` (:func:`stack_sweep`);
    ``checks``: each form's :func:`fastattn.static.check_form` (a form failing it is timed eager only)."""
    device, dt = resolve_device(device), dtype_of(dtype)
    names = list(forms or FORMS)
    bad = [n for n in names if n not in FORMS]
    if bad or not all(0 <= p < capacity for p in positions):
        raise ValueError(f"forms must be among {sorted(FORMS)} and positions in [0, capacity={capacity}); got "
                         f"forms {bad}, positions {list(positions)}")
    mode = "reduce-overhead" if device.type == "cuda" else None
    checks = [check_form(n, device, dt, hq=hq, hkv=hkv, head_dim=head_dim, capacity=capacity, bucket=bucket,
                         steps=steps, compile_mode=mode, seed=seed) for n in names]
    usable = [c["form"] for c in checks if c["available"]]
    variants = {f"{n} {'compiled' if c else 'eager'}": (n, c, c, layers) for c in compiled
                for n in (usable if c else names)}
    rows = stack_sweep(variants, positions, device=device, dtype=dt, capacity=capacity, hq=hq, hkv=hkv,
                       head_dim=head_dim, bucket=bucket, repeats=repeats, warmup=warmup, seed=seed, mode=mode,
                       progress=progress)
    params = {"positions": list(positions), "capacity": capacity, "dtype": dtype_name(dt), "hq": hq, "hkv": hkv,
              "head_dim": head_dim, "bucket": bucket, "repeats": repeats, "warmup": warmup, "steps": steps,
              "compile_mode": mode, "forms": names, "layers": layers, "static_inputs": True,
              "key_counts": "fresh per call, walking from each position within its bucket"}
    return record("decode_forms", env=env_record(device, dt), params=params, rows=rows, checks=checks)


# --------------------------------------------------------------------------- the verdict, from records
def _eligible(rec: dict) -> tuple:
    ok, excluded = [], {}
    for c in rec.get("checks", []):
        if not c["available"]:
            whose = "torch's limit, not the form's: " if c.get("limit") == "torch" else ""
            excluded[c["form"]] = f"unavailable ({whose}{c['reason']})"
        elif not c["accepted"]:
            excluded[c["form"]] = f"error {c['max_err']:.3g} above its bound {_bound(c):.3g}"
        elif c.get("within_bound") is False:
            excluded[c["form"]] = f"{c['graphs']} graphs, above its bound of {c['graph_bound']}"
        else:
            ok.append(c["form"])
    return ok, excluded


def _bound(c: dict) -> float:
    return c.get("bound") or 2 * c["reference_err"]  # records before the ulp floor: twice upstream's


def _median(row: Optional[dict]) -> float:
    return math.inf if row is None else statistics.median(quiet(row["samples_ms"], row.get("disturbed_flags")))


def form_verdict(rec: dict) -> dict:
    """The winner among eligible forms on quiet medians (compiled rows where any): ``winner``, ``runner_up``,
    ``excluded``, ``per_position`` (runner-up / winner), ``margin`` (geomean), ``decided`` (all above 1), ``line``."""
    ok, excluded = _eligible(rec)
    compiled = any(r["compiled"] for r in rec["rows"])
    positions = rec["params"]["positions"]
    rows = {f: {p: find_row(rec["rows"], form=f, position=p, compiled=compiled) for p in positions} for f in ok}
    medians = {f: {p: _median(r) for p, r in per.items()} for f, per in rows.items()}
    winner = form_winner(medians)
    out = {"winner": winner, "runner_up": None, "compiled": compiled, "excluded": excluded, "per_position": {},
           "margin": None, "decided": False, "decided_at": [], "other_winners": {},
           "device": rec["env"].get("device"), "dtype": rec["params"]["dtype"]}
    runner = form_winner({f: m for f, m in medians.items() if f != winner})
    if winner is None:
        return dict(out, line="no eligible form was timed: " + "; ".join(f"{f} {why}" for f, why in excluded.items()))
    if runner is None:
        return dict(out, line=f"{winner} is the only eligible form")
    ratios = {p: quiet_ratio(rows[runner][p], rows[winner][p])[:2] for p in positions}  # paired rounds
    pp = {p: {"winner": min(ok, key=lambda f: medians[f][p]), "ratio": r, "ci": ci} for p, (r, ci) in ratios.items()}
    margin = geomean(v["ratio"] for v in pp.values())
    decided_at = [p for p, v in pp.items() if verdict(v["ci"], lo=1) == YES and v["winner"] == winner]
    others = {p: v["winner"] for p, v in pp.items() if v["winner"] != winner}
    decided = len(decided_at) == len(positions)
    line = (f"{winner} wins ({'compiled' if compiled else 'eager'}, {out['dtype']}): {runner} takes {margin:.2f}x its "
            f"time (geometric mean over positions {', '.join(map(str, positions))}; per position " +
            ", ".join(f"{p}: {v['ratio']:.2f}x {fmt_ci(v['ci'])}" for p, v in pp.items()) + ")")
    if not decided:
        line += (f"; decided at {', '.join(map(str, decided_at)) or 'no position'}"
                 + ("; faster elsewhere: " + ", ".join(f"{f} at {p}" for p, f in others.items()) if others else ""))
    return dict(out, runner_up=runner, per_position=pp, margin=margin, decided=decided, decided_at=decided_at,
                other_winners=others, line=line)


def form_lines(rec: dict) -> list:
    """Markdown lines: the verdict, then each form's check."""
    v = form_verdict(rec)
    return [f"- **{'Decided' if v['decided'] else 'Not decided'}**: {v['line']}"] + check_lines(rec.get("checks", []))


def check_lines(checks: list) -> list:
    """A line per :func:`fastattn.static.check_form` row: why it is out, or its error and graph counts."""
    excluded, lines = _eligible({"checks": checks})[1], []
    for c in checks:
        if not c["available"]:
            lines.append(f"- {c['form']}: {excluded[c['form']]}")
            continue
        rec_graphs, times = c.get("cudagraph_recordings"), c.get("per_position_ms") or {}
        lines.append(f"- {c['form']}: error {c['max_err']:.3g} vs upstream's {c['reference_err']:.3g} "
                     f"({'within' if c['accepted'] else 'above'} its bound {_bound(c):.3g}), {c['graphs']} dynamo "
                     f"graph(s) over {c['steps']} steps (bound {c['graph_bound']})"
                     + (f", {rec_graphs} CUDA graph(s) recorded" if rec_graphs is not None else "")
                     + ("" if c["deterministic"] else ", NOT deterministic")
                     + "".join(f"; p={p}: {ms:.3f} ms" for p, ms in times.items()))
    return lines


def kit_lines(rec: dict) -> list:
    """Markdown lines from a ``kit_decode`` record: each mode's decode time and graphs, live / masked, bit-identity."""
    rows = {r["mode"]: r for r in rec["rows"]}
    lines = []
    for mode, r in rows.items():
        why = "; ".join(r.get("cudagraph_skip_reasons") or [])
        lines.append(f"- decode_attention={mode!r} ({r['phase']}): whole decode {r['wall_s']:.3f} s (median of "
                     f"{len(r['wall_samples_s'])}); compile, warm-up and a {r['chunks']}-chunk stream: "
                     f"{r['unique_graphs']} dynamo graph(s), {r['cudagraph_skips']} cudagraph skip(s)"
                     + (f" ({why})" if why else "") + ", "
                     f"{'unknown' if r['cudagraph_recordings'] is None else r['cudagraph_recordings']} CUDA graph(s) "
                     "recorded")
    if {"masked", "live"} <= set(rows):
        a, b = rows["live"]["wall_samples_s"], rows["masked"]["wall_samples_s"]
        lines.append(f"- live / masked whole decode: {statistics.median(a) / statistics.median(b):.3f}x "
                     f"{fmt_ci(ratio_ci(a, b))}")
    lines.append(f"- mode off bit-identical to upstream: {rec.get('identical_off')}; mode on differs by at most "
                 f"{rec.get('max_abs_diff_on', float('nan')):.3g} (a free-running decode within rounding)")
    return lines


def choice_lines(choice: dict) -> list:
    """Lines of a :func:`fastattn.fast.graph_choice`: each form's check, then the winner."""
    graphs = "CUDA graphs" if choice.get("compile_mode") == "reduce-overhead" and choice["device"].startswith(
        "cuda") else "no CUDA graphs"
    return check_lines(choice["candidates"]) + [
        f"winner here ({choice['device']}, {choice['dtype']}, compiled, {graphs}): {choice['winner']}"]
