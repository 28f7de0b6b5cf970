"""Timing that is honest on a shared, noisy box: variants interleaved call by call (in a fresh seeded
random order each repeat), after warm-up; medians with p10/p90; CUDA events on CUDA."""

from __future__ import annotations

import random
import statistics
import time
from typing import Sequence

import torch


def _progress(it, enabled: bool, desc: str):
    if not enabled:
        return it
    from tqdm.auto import tqdm
    return tqdm(it, desc=desc, leave=False)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_interleaved(fns: dict, *, repeats: int = 7, warmup: int = 2, device="cpu", seed: int = 0) -> dict:
    """Time each callable ``repeats`` times, interleaved, after ``warmup`` rounds.

    Each repeat runs every variant once, in an order shuffled afresh (seeded): a call pays for what the call
    before it left in the caches, so a fixed or merely rotated order (which keeps every variant behind the
    same neighbour) would charge one variant for another's traffic every time; shuffled, each variant follows
    each other one about equally often. Returns ``{name: [seconds, ...]}`` (sample ``i`` of every variant from
    repeat ``i``). On CUDA each sample uses CUDA events around the call and one synchronisation.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got {repeats}, {warmup}")
    device = torch.device(device)
    names = list(fns)
    for _ in range(warmup):
        for n in names:
            fns[n]()
    _sync(device)
    out = {n: [] for n in names}
    rng = random.Random(seed)
    for _ in range(repeats):
        order = rng.sample(names, len(names))
        for n in order:
            if device.type == "cuda":
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fns[n]()
                b.record()
                b.synchronize()
                out[n].append(a.elapsed_time(b) / 1e3)
            else:
                t0 = time.perf_counter()
                fns[n]()
                out[n].append(time.perf_counter() - t0)
    return out


def _stats_ms(samples: Sequence[float]) -> dict:
    """Median, p10/p90, min and n in ms, and the samples themselves (bootstrap intervals need them)."""
    s = sorted(x * 1e3 for x in samples)
    q = lambda f: s[min(len(s) - 1, max(0, round(f * (len(s) - 1))))]
    return {"median_ms": statistics.median(s), "p10_ms": q(0.1), "p90_ms": q(0.9), "min_ms": s[0], "n": len(s),
            "samples_ms": [x * 1e3 for x in samples]}  # in timing order: round i of every variant pairs up
