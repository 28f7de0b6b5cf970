"""Does a per-chunk cost grow along a stream? Resistant slopes, a block bootstrap, a verdict vs :data:`TOLERANCE`."""

from __future__ import annotations

import random
import statistics
from typing import Optional, Sequence

from .stats import YES, pct, verdict

#: relative change over the whole stream below which a stream is flat: a quiet 2-core box drifts by some 10% over
#: a short stream (its interval wider still), and #293's symptom is a 3-6x growth
TOLERANCE = 0.25
RESAMPLES = 1000
#: the share of a stream's chunks that must be quiet for a verdict
MIN_QUIET = 0.5


def resistant_slope(x: Sequence[float], y: Sequence[float]) -> Optional[float]:
    """Tukey's resistant-line slope: (median y of the last third - of the first third) / (same for x)."""
    pts = sorted(zip(x, y))
    k = len(pts) // 3
    if k < 2:
        return None
    first, last = pts[:k], pts[-k:]
    dx = statistics.median(p[0] for p in last) - statistics.median(p[0] for p in first)
    return None if dx <= 0 else (statistics.median(p[1] for p in last) - statistics.median(p[1] for p in first)) / dx


def stretches(indices: Sequence[int], gap: int = 3) -> list:
    """Runs of chunk indices as ``[(first, last), ...]`` (indices within ``gap`` of each other join)."""
    out = []
    for i in sorted(indices):
        if out and i - out[-1][1] <= gap:
            out[-1][1] = i
        else:
            out.append([i, i])
    return [tuple(r) for r in out]


def pooled_slope(series: list) -> Optional[float]:
    """The repeats' own resistant slopes, weighted by quiet chunk count (a repeat at another level adds no slope)."""
    fits = [(resistant_slope([p[0] for p in s], [p[1] for p in s]), len(s)) for s in series]
    fits = [(m, n) for m, n in fits if m is not None]
    return sum(m * n for m, n in fits) / sum(n for _, n in fits) if fits else None


def _bootstrap(series: list, block: int) -> list:
    """Slopes of resampled streams: the same blocks of chunk indices drawn for every repeat."""
    idx = sorted({i for s in series for i, _ in s})
    if len(idx) < 6:
        return []
    starts = list(range(0, max(1, len(idx) - block + 1)))
    rng = random.Random(0)
    by = [dict(s) for s in series]
    slopes = []
    for _ in range(RESAMPLES):
        pick = []
        while len(pick) < len(idx):
            b = rng.choice(starts)
            pick.extend(idx[b:b + block])
        pick = pick[:len(idx)]
        s = pooled_slope([[(i, d[i]) for i in pick if i in d] for d in by])
        if s is not None:
            slopes.append(s)
    return slopes


def trend(repeats: Sequence[Sequence[tuple]]) -> dict:
    """The trend over ``repeats`` of ``(chunk, ms, disturbed)`` (chunk 0 and disturbed ones out), with its verdict:
    grows, shrinks, flat or inconclusive; ``change`` is relative to ``level_ms``."""
    series = [[(c, ms) for c, ms, bad in r if c > 0 and not bad] for r in repeats]
    total, quiet = sum(1 for r in repeats for c, _, _ in r if c > 0), sum(len(s) for s in series)
    out = {"repeats": len(repeats), "disturbed": total - quiet,
           "disturbed_chunks": stretches({c for r in repeats for c, _, bad in r if bad}),
           "quiet_share": quiet / total if total else 0.0, "slope_ms_per_100": None, "ci": None, "change": None,
           "change_ci": None, "level_ms": None, "per_repeat_change": []}
    pooled = [p for s in series for p in s]
    slope = pooled_slope(series)
    if slope is None:
        return {**out, "verdict": "inconclusive", "why": "too few quiet chunks to fit a slope"}
    span = max(p[0] for p in pooled) - min(p[0] for p in pooled)
    level = statistics.median(p[1] for p in pooled)
    boot = sorted(_bootstrap(series, max(5, span // 20)))
    lo, hi = (boot[int(0.025 * (len(boot) - 1))], boot[int(0.975 * (len(boot) - 1))]) if boot else (slope, slope)
    rel = lambda s: s * span / level if level else 0.0  # noqa: E731
    per = [rel(s) for s in (resistant_slope([p[0] for p in r], [p[1] for p in r]) for r in series) if s is not None]
    out.update(slope_ms_per_100=slope * 100, ci=[lo * 100, hi * 100], change=rel(slope),
               change_ci=[rel(lo), rel(hi)], level_ms=level, per_repeat_change=per)
    return {**out, **_verdict(out)}


def _verdict(t: dict) -> dict:
    busy = ", ".join(f"{a}-{b}" for a, b in t["disturbed_chunks"][:6])
    if t["quiet_share"] < MIN_QUIET:
        return {"verdict": "inconclusive", "why": f"the machine was busy: {t['disturbed']} chunks disturbed "
                                                  f"(chunks {busy})"}
    if t["repeats"] < 2:
        return {"verdict": "inconclusive", "why": "one repeat: a trend needs at least two"}
    (lo, hi), per = t["change_ci"], t["per_repeat_change"]
    every = len(per) == t["repeats"]
    if lo > 0 and t["change"] > TOLERANCE and every and min(per) > TOLERANCE / 2:
        return {"verdict": "grows", "why": "the interval is above zero and every repeat grows"}
    if hi < 0 and t["change"] < -TOLERANCE and every and max(per) < -TOLERANCE / 2:
        return {"verdict": "shrinks", "why": "the interval is below zero and every repeat shrinks"}
    if verdict((lo, hi), -TOLERANCE, TOLERANCE) == YES:  # the one interval rule (stats.verdict)
        return {"verdict": "flat", "why": f"the change over the stream lies within ±{TOLERANCE:.0%}"}
    return {"verdict": "inconclusive", "why": f"the interval of the change, [{pct(lo)}, {pct(hi)}], spans the "
                                              f"±{TOLERANCE:.0%} tolerance"}


def describe(t: dict) -> str:
    """A trend as one line: verdict, change over the stream with its interval, and the disturbed chunks."""
    if t.get("change") is None:
        return t["verdict"] + (f" ({t['why']})" if t.get("why") else "")
    lo, hi = t["change_ci"]
    busy = f"; {t['disturbed']} disturbed chunk{'s' if t['disturbed'] != 1 else ''} left out" if t["disturbed"] else ""
    return (f"{t['verdict']} ({pct(t['change'])} over the stream, 95% CI [{pct(lo)}, {pct(hi)}], "
            f"{t['repeats']} repeat{'s' if t['repeats'] != 1 else ''}{busy}; {t['why']})")
