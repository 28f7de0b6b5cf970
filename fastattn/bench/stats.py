"""Confidence intervals for the ratios the targets judge: a bootstrap over the timed samples (scipy).

Samples of two variants timed by :func:`time_interleaved` are paired: sample ``i`` of each comes from
the same round, so a slow moment of the box hits both. The interval resamples rounds (``paired``), and
the statistic is the ratio of the medians, the figure every table shows.
"""

from __future__ import annotations

import math
import statistics
from typing import Optional, Sequence

CONFIDENCE = 0.95
RESAMPLES = 2000


def _bootstrap(data: tuple, statistic, *, paired: bool, seed: int) -> Optional[tuple]:
    import numpy as np
    from scipy.stats import bootstrap
    if min(len(d) for d in data) < 3 or (paired and len({len(d) for d in data}) != 1):
        return None  # fewer than 3 samples: no interval worth the name
    res = bootstrap(tuple(np.asarray(d, dtype=float) for d in data), statistic, paired=paired, vectorized=False,
                    n_resamples=RESAMPLES, confidence_level=CONFIDENCE, method="percentile",
                    random_state=np.random.default_rng(seed))
    lo, hi = float(res.confidence_interval.low), float(res.confidence_interval.high)
    return None if math.isnan(lo) or math.isnan(hi) else (lo, hi)


def ratio_ci(num: Sequence[float], den: Sequence[float], *, seed: int = 0,
             paired: Optional[bool] = None) -> Optional[tuple]:
    """95% bootstrap interval of ``median(num) / median(den)``; ``paired`` (default: when both have the same
    length, as interleaved rounds do) resamples rounds, else each side apart. ``None`` below 3 samples."""
    paired = len(num) == len(den) if paired is None else paired
    return _bootstrap((num, den), lambda a, b: statistics.median(a) / statistics.median(b), paired=paired, seed=seed)


def scaled_ci(samples: Sequence[float], scale: float, *, seed: int = 0) -> Optional[tuple]:
    """95% bootstrap interval of ``median(samples) / scale`` (a time over a fixed floor)."""
    return _bootstrap((samples,), lambda a: statistics.median(a) / scale, paired=False, seed=seed)


def fmt_ci(ci: Optional[tuple]) -> str:
    """``[low, high]`` at 3 significant digits, or ``n/a`` where there is no interval."""
    return "n/a" if not ci else f"[{ci[0]:.3g}, {ci[1]:.3g}]"
