"""Whether the machine was busy while a sample ran, from unprivileged host counters (see docs/design.md)."""

from __future__ import annotations

import os
import resource
from typing import Optional, Sequence

#: a sample below this fraction of its series' quiet CPU/wall was descheduled
CPU_DROP = 0.6
#: a sample above this multiple of its series' quiet switch rate (per second) was preempted
SWITCH_JUMP = 4.0
#: involuntary switches a sample may take whatever its length: a quiet box preempts a process now and then
#: (tests/lab/test_noise.py feeds a quiet stream's pattern and requires no flag)
MIN_SWITCHES = 3
#: cores other processes may use on average during a window before its samples count as disturbed
OTHERS_MAX = 0.3
#: shortest window (s) over which the machine's jiffy counters are read
MIN_WINDOW_S = 0.25

_HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def machine_busy_s() -> Optional[float]:
    """CPU seconds the machine has been busy since boot (``/proc/stat`` less idle and iowait); None without it."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    guest = sum(fields[8:10]) if len(fields) > 9 else 0  # already counted in user and nice
    return (sum(fields) - idle - guest) / _HZ


def host_counters() -> tuple:
    """``(process CPU seconds, involuntary context switches, machine busy seconds or None)`` so far."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime, r.ru_nivcsw, machine_busy_s()


def delta(before: tuple, after: tuple) -> dict:
    """One sample's counters from two :func:`host_counters` readings: ``{"cpu_s", "switches", "machine_s"}``."""
    machine = None if before[2] is None or after[2] is None else after[2] - before[2]
    return {"cpu_s": after[0] - before[0], "switches": after[1] - before[1], "machine_s": machine}


def others_busy(wall: Sequence[float], cpu: Sequence[float], machine: Sequence[Optional[float]]) -> list:
    """Per sample: did other processes use over :data:`OTHERS_MAX` cores in its window (consecutive samples pooled to
    >= :data:`MIN_WINDOW_S`)? All False without machine counters."""
    flags = [False] * len(wall)
    if any(m is None for m in machine):
        return flags
    start, acc = 0, [0.0, 0.0, 0.0]
    for i, (w, c, m) in enumerate(zip(wall, cpu, machine)):
        acc = [acc[0] + w, acc[1] + c, acc[2] + m]
        if acc[0] >= MIN_WINDOW_S or i == len(wall) - 1:
            busy = acc[0] >= MIN_WINDOW_S / 2 and (acc[2] - acc[1]) / acc[0] > OTHERS_MAX
            for j in range(start, i + 1):
                flags[j] = busy
            start, acc = i + 1, [0.0, 0.0, 0.0]
    return flags


def quantile(values: Sequence[float], f: float) -> float:
    """The ``f`` quantile of ``values`` (nearest rank)."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(f * (len(s) - 1))))]


def disturbed(wall: Sequence[float], cpu: Sequence[float], switches: Sequence[int], *,
              others: Optional[Sequence[bool]] = None) -> list:
    """One bool per sample: disturbed against its series' quiet level, or marked in ``others`` (:func:`others_busy`).
    Samples under 2 ms are judged by switches only; unequal lengths raise ValueError."""
    if not (len(wall) == len(cpu) == len(switches)):
        raise ValueError(f"wall, cpu and switches must have one value per sample, got {len(wall)}, {len(cpu)}, "
                         f"{len(switches)}")
    if not wall:
        return []
    ratio = [c / w if w > 0 else 0.0 for c, w in zip(cpu, wall)]
    rate = [s / w if w > 0 else 0.0 for s, w in zip(switches, wall)]
    quiet_ratio, quiet_rate = quantile(ratio, 0.75), quantile(rate, 0.5)
    flags = []
    others = others or [False] * len(wall)
    for w, r, n, o in zip(wall, ratio, switches, others):
        low_cpu = w >= 2e-3 and r < CPU_DROP * quiet_ratio
        preempted = n > max(SWITCH_JUMP * quiet_rate * w, MIN_SWITCHES)
        flags.append(bool(low_cpu or preempted or o))
    return flags


def disturbed_series(wall: Sequence[float], deltas: Sequence[dict]) -> list:
    """:func:`disturbed` of samples that follow each other in time, from each one's :func:`delta` counters."""
    cpu = [d["cpu_s"] for d in deltas]
    others = others_busy(wall, cpu, [d["machine_s"] for d in deltas])
    return disturbed(wall, cpu, [d["switches"] for d in deltas], others=others)
