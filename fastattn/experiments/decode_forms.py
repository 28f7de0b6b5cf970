"""Which static-shape decode form a compiled decode should carry: read from a ``decode_forms`` record
(:func:`fastattn.bench.form_sweep`) and, for the model, a ``kit_decode`` record (the opt-in kit decoding under
upstream's ``optimize()``). Pure functions of records; they measure nothing.

A form is eligible where it compiled, stayed within twice upstream's error against float64 and kept its
graph bound. The winner is the eligible form with the lowest compiled step time summed over the positions;
its margin over the runner-up is the ratio of medians at each position with a paired 95% bootstrap interval.
The choice is *decided* only where every position's interval lies above 1: one noisy burst cannot decide it.
"""

from __future__ import annotations

import math
import statistics
from typing import Optional

from ..bench.stats import fmt_ci, ratio_ci
from ..bench.targets import quiet_ratio

__all__ = ["form_verdict", "form_lines", "kit_lines", "choice_lines"]


def _eligible(rec: dict) -> tuple:
    ok, excluded = [], {}
    for c in rec.get("checks", []):
        if not c["available"]:
            excluded[c["form"]] = f"unavailable: {c['reason']}"
        elif not c["accepted"]:
            excluded[c["form"]] = f"error {c['max_err']:.3g} above twice upstream's {c['reference_err']:.3g}"
        elif c.get("within_bound") is False:
            excluded[c["form"]] = f"{c['graphs']} graphs, above its bound of {c['graph_bound']}"
        else:
            ok.append(c["form"])
    return ok, excluded


def _row(rec: dict, form: str, p: int, compiled: bool) -> Optional[dict]:
    return next((r for r in rec["rows"] if (r["form"], r["position"], r["compiled"]) == (form, p, compiled)), None)


def _median(row: Optional[dict]) -> float:
    """A row's median over its quiet samples (all of them where fewer than 3 are quiet); inf for no row."""
    if row is None:
        return math.inf
    flags = row.get("disturbed_flags") or [False] * len(row["samples_ms"])
    quiet = [x for x, f in zip(row["samples_ms"], flags) if not f]
    return statistics.median(quiet if len(quiet) >= 3 else row["samples_ms"])


def form_verdict(rec: dict) -> dict:
    """The winner among eligible forms, timed compiled where any compiled row exists (else eager).

    Returns ``winner``, ``runner_up``, ``compiled`` (whether compiled timings decided), ``excluded`` ({form:
    why}), ``per_position`` ({p: {"winner", "ratio", "ci"}}: runner-up over winner), ``margin`` (geometric mean
    of the per-position ratios), ``decided`` (at every position the winner is fastest and the interval is above
    1), ``decided_at`` (the positions where that holds), ``other_winners`` ({p: form} where another form is
    fastest) and ``line``, a sentence."""
    ok, excluded = _eligible(rec)
    compiled = any(r["compiled"] for r in rec["rows"])
    positions = rec["params"]["positions"]
    total = {f: sum(_median(_row(rec, f, p, compiled)) for p in positions) for f in ok}
    timed = sorted((t, f) for f, t in total.items() if math.isfinite(t))
    out = {"winner": None, "runner_up": None, "compiled": compiled, "excluded": excluded, "per_position": {},
           "margin": None, "decided": False, "decided_at": [], "other_winners": {},
           "device": rec["env"].get("device"), "dtype": rec["params"]["dtype"]}
    if not timed:
        return dict(out, line="no eligible form was timed: " + "; ".join(f"{f} {why}" for f, why in excluded.items()))
    winner = timed[0][1]
    out["winner"] = winner
    if len(timed) == 1:
        return dict(out, line=f"{winner} is the only eligible form")
    runner = timed[1][1]
    ratios = []
    for p in positions:
        r, ci, _, _ = quiet_ratio(_row(rec, runner, p, compiled), _row(rec, winner, p, compiled))  # paired rounds
        fastest = min(ok, key=lambda f: _median(_row(rec, f, p, compiled)))
        out["per_position"][p] = {"winner": fastest, "ratio": r, "ci": ci}
        ratios.append(r)
    margin = math.exp(sum(map(math.log, ratios)) / len(ratios))
    pp = out["per_position"]
    decided_at = [p for p, v in pp.items() if v["ci"] is not None and v["ci"][0] > 1 and v["winner"] == winner]
    others = {p: v["winner"] for p, v in pp.items() if v["winner"] != winner}
    decided = len(decided_at) == len(positions)
    how = "compiled" if compiled else "eager"
    line = (f"{winner} wins ({how}, {out['dtype']}): {runner} takes {margin:.2f}x its time (geometric mean over "
            f"positions {', '.join(map(str, positions))}; per position " +
            ", ".join(f"{p}: {v['ratio']:.2f}x {fmt_ci(v['ci'])}" for p, v in pp.items()) + ")")
    if not decided:
        line += (f"; decided at {', '.join(map(str, decided_at)) or 'no position'}"
                 + ("; faster elsewhere: " + ", ".join(f"{f} at {p}" for p, f in others.items()) if others else ""))
    return dict(out, runner_up=runner, margin=margin, decided=decided, decided_at=decided_at, other_winners=others,
                line=line)


def form_lines(rec: dict) -> list:
    """Markdown lines for a report: the verdict, then each form's check (error, graphs, CUDA graphs)."""
    v = form_verdict(rec)
    lines = [f"- **{'Decided' if v['decided'] else 'Not decided'}**: {v['line']}"]
    for c in rec.get("checks", []):
        if not c["available"]:
            lines.append(f"- {c['form']}: unavailable ({c['reason']})")
            continue
        rec_graphs = c.get("cudagraph_recordings")
        lines.append(f"- {c['form']}: error {c['max_err']:.3g} vs upstream's {c['reference_err']:.3g} "
                     f"({'within' if c['accepted'] else 'above'} twice), {c['graphs']} dynamo graph(s) over "
                     f"{c['steps']} steps (bound {c['graph_bound']})"
                     + (f", {rec_graphs} CUDA graph(s) recorded" if rec_graphs is not None else "")
                     + ("" if c["deterministic"] else ", NOT deterministic"))
    return lines


def kit_lines(rec: dict) -> list:
    """Markdown lines from a ``kit_decode`` record (:func:`fastattn.gpucheck.kit_decode`): each mode's whole
    decode (median of the alternated repeats, and live's ratio to masked with its 95% interval), the stream's
    graphs, and whether the mode off stayed bit-identical."""
    rows = {r["mode"]: r for r in rec["rows"]}
    lines = []
    for mode, r in rows.items():
        lines.append(f"- decode_attention={mode!r} ({r['phase']}): whole decode {r['wall_s']:.3f} s (median of "
                     f"{len(r['wall_samples_s'])}); over a {r['chunks']}-chunk stream {r['unique_graphs']} dynamo "
                     f"graph(s), {r['cudagraph_skips']} cudagraph skip(s), "
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
    """Lines of a graph-class choice (:func:`fastattn.fast.graph_choice`): each form's status, then the winner."""
    lines = []
    for c in choice["candidates"]:
        if not c["available"]:
            lines.append(f"{c['form']:<16} unavailable: {c['reason']}")
            continue
        times = ", ".join(f"p={p}: {ms:.3f} ms" for p, ms in (c.get("per_position_ms") or {}).items())
        lines.append(f"{c['form']:<16} error {c['max_err']:.3g} (upstream {c['reference_err']:.3g}, "
                     f"{'accepted' if c['accepted'] else 'REJECTED'}), {c['graphs']} graph(s) over {c['steps']} "
                     f"steps (bound {c['graph_bound']}), "
                     f"{'deterministic' if c['deterministic'] else 'NOT deterministic'}"
                     + (f"; {times}" if times else ""))
    lines.append(f"winner here ({choice['device']}, {choice['dtype']}, compiled): {choice['winner']}")
    return lines
