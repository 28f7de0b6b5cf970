"""The statistics every figure uses: one quiet-sample rule, one paired-ratio rule, one "decided" rule.

Interleaved samples pair by round; a ratio is of medians over the quiet rounds, with a 95% bootstrap interval."""

from __future__ import annotations

import math
import statistics
from typing import Optional, Sequence

import numpy as np

CONFIDENCE = 0.95
RESAMPLES = 2000
#: fewer quiet samples than this and a figure rests on all of them (and says how many were disturbed)
MIN_QUIET = 3
YES, NO, UNDECIDED = "yes", "no", "undecided"


def quiet(samples: Sequence, flags: Optional[Sequence[bool]]) -> list:
    """The samples not flagged disturbed; all of them where fewer than :data:`MIN_QUIET` are quiet."""
    kept = [x for x, f in zip(samples, flags or [False] * len(samples)) if not f]
    return kept if len(kept) >= MIN_QUIET else list(samples)


def _bootstrap(data: tuple, statistic, *, paired: bool) -> Optional[tuple]:
    """``statistic(*samples, axis)``, vectorized: numpy's median equals :func:`statistics.median`, bit for bit."""
    from scipy.stats import bootstrap
    if min(len(d) for d in data) < 3 or (paired and len({len(d) for d in data}) != 1):
        return None  # fewer than 3 samples: no interval worth the name
    res = bootstrap(tuple(np.asarray(d, dtype=float) for d in data), statistic, paired=paired, vectorized=True,
                    n_resamples=RESAMPLES, confidence_level=CONFIDENCE, method="percentile",
                    random_state=np.random.default_rng(0))  # seeded: the same records give the same interval
    lo, hi = float(res.confidence_interval.low), float(res.confidence_interval.high)
    return None if math.isnan(lo) or math.isnan(hi) else (lo, hi)


def ratio_ci(num: Sequence[float], den: Sequence[float], *, paired: Optional[bool] = None) -> Optional[tuple]:
    """95% bootstrap interval of ``median(num) / median(den)``, paired (default: equal lengths); None below 3."""
    paired = len(num) == len(den) if paired is None else paired
    return _bootstrap((num, den), lambda a, b, axis: np.median(a, axis) / np.median(b, axis), paired=paired)


def scaled_ci(samples: Sequence[float], scale: float) -> Optional[tuple]:
    """95% bootstrap interval of ``median(samples) / scale`` (a time over a fixed floor)."""
    return _bootstrap((samples,), lambda a, axis: np.median(a, axis) / scale, paired=False)


def quiet_pairs(num: dict, den: dict) -> tuple:
    """Two timed rows' samples less every round either was disturbed in (unpaired rows: their own disturbed ones)."""
    a, b = num["samples_ms"], den["samples_ms"]
    fa, fb = num.get("disturbed_flags") or [False] * len(a), den.get("disturbed_flags") or [False] * len(b)
    if len(a) == len(b):  # paired by round: a round either was disturbed in leaves both
        fa = fb = [x or y for x, y in zip(fa, fb)]
    return [x for x, f in zip(a, fa) if not f], [x for x, f in zip(b, fb) if not f]


def quiet_ratio(num: dict, den: dict) -> tuple:
    """``(ratio, ci, n, dropped)`` of two timed rows' medians over their quiet rounds (all, fewer than 3 quiet)."""
    if "samples_ms" not in num or "samples_ms" not in den:
        return num["median_ms"] / den["median_ms"], None, min(num.get("n", 0), den.get("n", 0)), 0
    a, b = quiet_pairs(num, den)
    if min(len(a), len(b)) < MIN_QUIET:
        a, b = num["samples_ms"], den["samples_ms"]
    dropped = len(num["samples_ms"]) - len(a)
    return statistics.median(a) / statistics.median(b), ratio_ci(a, b), min(len(a), len(b)), dropped


def verdict(ci: Optional[tuple], lo: float = -math.inf, hi: float = math.inf) -> str:
    """The one rule: a 95% interval wholly in ``[lo, hi]`` is YES, wholly outside NO, else (or none) UNDECIDED."""
    if not ci:
        return UNDECIDED
    return YES if lo <= ci[0] and ci[1] <= hi else NO if ci[1] < lo or ci[0] > hi else UNDECIDED


def judge(measured: float, ci: Optional[tuple], bound: float, n: Optional[int] = None) -> str:
    """A figure against the goal ``<= bound`` by :func:`verdict`, else by its value (``0 < n < 3``: undecided)."""
    if ci:
        return verdict(ci, hi=bound)
    return UNDECIDED if n is not None and 0 < n < 3 else YES if measured <= bound else NO


def judge_all(figures: list, bound: float) -> str:
    """:func:`judge` at every ``(measured, ci, n)``: :data:`NO` if any misses, else :data:`UNDECIDED` if any is."""
    verdicts = {judge(m, ci, bound, n) for m, ci, n in figures}
    return NO if NO in verdicts else UNDECIDED if UNDECIDED in verdicts else YES


def pct(x: float) -> str:
    """A signed percentage, with a decimal below 1% so that a small nonzero change never reads ``+0%``."""
    return f"{x:+.1%}" if 0 < abs(x) < 0.01 else f"{x:+.0%}"


def fmt_ci(ci: Optional[tuple]) -> str:
    """``[low, high]`` at 3 significant digits, or ``n/a`` where there is no interval."""
    return "n/a" if not ci else f"[{ci[0]:.3g}, {ci[1]:.3g}]"
