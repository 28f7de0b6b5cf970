"""Timing that is honest on a shared, noisy box: variants interleaved call by call, disturbed samples flagged."""

from __future__ import annotations

import statistics
import time
from typing import Optional, Sequence

from fastattn.clock import interleaved

from .noise import delta, disturbed, host_counters, others_busy, quantile
from .stats import quiet


def progress_bar(it, enabled: bool, desc: str):
    if not enabled:
        return it
    from tqdm.auto import tqdm
    return tqdm(it, desc=desc, leave=False)


def time_interleaved(fns: dict, *, repeats: int = 7, warmup: int = 2, device="cpu", seed: int = 0,
                     host: Optional[dict] = None) -> dict:
    """:func:`fastattn.clock.interleaved` (``{name: [seconds, ...]}``, paired rounds, shuffled order). ``host``
    receives ``{name: {"cpu_s", "switches", "machine_s", "others_busy"}}``, a list each, for :func:`stats_ms`."""
    counters = {n: {"cpu_s": [], "switches": [], "machine_s": []} for n in fns}
    rounds = []  # (wall, own CPU, machine busy) of each round: the rounds follow each other in time

    def on_call(name):
        h0 = host_counters()
        return lambda: [counters[name][k].append(v) for k, v in delta(h0, host_counters()).items()]

    def on_round():
        r0, w0 = host_counters(), time.perf_counter()

        def end():
            d = delta(r0, host_counters())
            rounds.append((time.perf_counter() - w0, d["cpu_s"], d["machine_s"]))
        return end

    out = interleaved(fns, repeats=repeats, warmup=warmup, device=device, seed=seed, on_call=on_call,
                      on_round=on_round)
    if host is not None:
        busy = others_busy(*zip(*rounds)) if rounds else []  # a round others took the cores in marks all its samples
        for n in fns:
            counters[n]["others_busy"] = list(busy)
        host.update(counters)
    return out


def stats_ms(samples: Sequence[float], host: Optional[dict] = None) -> dict:
    """A timed row: ``median_ms``, ``p10_ms``, ``p90_ms``, ``min_ms``, ``n``, ``samples_ms``, ``disturbed``,
    ``disturbed_flags``. With ``host`` (from :func:`time_interleaved`) the statistics rest on the quiet samples
    (while at least 3 are), and the flags let paired intervals drop a round either variant lost."""
    flags = [False] * len(samples)
    if host is not None:
        flags = disturbed(list(samples), host["cpu_s"], host["switches"], others=host.get("others_busy"))
    s = [x * 1e3 for x in quiet(samples, flags)]
    return {"median_ms": statistics.median(s), "p10_ms": quantile(s, 0.1), "p90_ms": quantile(s, 0.9),
            "min_ms": min(s), "n": len(s),
            "samples_ms": [x * 1e3 for x in samples],  # in timing order: round i of every variant pairs up
            "disturbed": sum(flags), "disturbed_flags": flags}
