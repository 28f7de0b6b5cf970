"""The one timing loop: variants interleaved in a fresh seeded order each round, CUDA events on CUDA."""

from __future__ import annotations

import random
import statistics
import time
from typing import Callable, Optional

import torch


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def stamp(cuda: bool):
    """A point in time without a sync: a recorded CUDA event on CUDA, else the host clock."""
    if cuda:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def elapsed_s(a, b) -> float:
    r"""Seconds between two :func:`stamp`\ s (CUDA events: after a synchronize)."""
    return a.elapsed_time(b) / 1e3 if isinstance(a, torch.cuda.Event) else b - a


def _timed(fn: Callable, events: Optional[tuple]) -> float:
    if events:
        a, b = events
        a.record()
        fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def interleaved(fns: dict, *, repeats: int = 7, warmup: int = 2, device="cpu", seed: int = 0,
                on_call: Optional[Callable] = None, on_round: Optional[Callable] = None) -> dict:
    """``{name: [seconds per repeat]}``: each callable once per round after ``warmup``, in a fresh seeded order (a call
    pays for what the one before left in caches); sample ``i`` is round ``i``. ``on_call(name)`` and ``on_round()``
    return a callback run after that call or round."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got {repeats}, {warmup}")
    device, names = torch.device(device), list(fns)
    for _ in range(warmup):
        for n in names:
            fns[n]()
    sync(device)
    out, rng = {n: [] for n in names}, random.Random(seed)
    events = tuple(torch.cuda.Event(enable_timing=True) for _ in range(2)) if device.type == "cuda" else None
    for _ in range(repeats):
        end_round = on_round() if on_round else None
        for n in rng.sample(names, len(names)):
            end_call = on_call(n) if on_call else None
            out[n].append(_timed(fns[n], events))
            if end_call:
                end_call()
        if end_round:
            end_round()
    return out


def rotated(names, r: int) -> list:
    """Round ``r``'s order for runs too long to shuffle call by call (whole decodes, streams): rotated by one each
    round, so each variant leads in turn (A B, B A for two)."""
    names = list(names)
    return names[r % len(names):] + names[:r % len(names)]


def medians(fns: dict, **kw) -> dict:
    return {n: statistics.median(t) for n, t in interleaved(fns, **kw).items()}
