"""Evidence a busy machine cannot fake: disturbed samples flagged from host counters, trend verdicts from a robust
slope over repeats on quiet chunks only, and a real neighbour taking both cores for part of a stream."""

import os
import random
import subprocess
import sys
import time

import pytest

from fastattn.lab import bench
from fastattn.lab.bench.noise import disturbed, others_busy
from fastattn.lab.bench.stats import quiet_pairs
from fastattn.lab.bench.stream import sixths
from fastattn.lab.bench.timing import stats_ms
from fastattn.lab.bench.trend import describe, resistant_slope, stretches, trend

pytestmark = pytest.mark.usefixtures("seeded_fast_choice")  # fast's probe, cheap (conftest)


def test_descheduled_and_preempted_samples_are_flagged_against_their_own_series():
    wall = [0.2] * 10
    cpu = [0.39] * 10          # CPU/wall 1.95 with 2 threads, quiet
    switches = [7] * 10        # about 7 per 200 ms chunk, quiet
    cpu[3], switches[7] = 0.1, 200  # one descheduled, one preempted over and over
    assert disturbed(wall, cpu, switches) == [i in (3, 7) for i in range(10)]
    assert disturbed(wall, cpu, switches, others=[i == 5 for i in range(10)])[5]
    with pytest.raises(ValueError, match="one value per sample"):
        disturbed([0.1], [0.1, 0.2], [1])


def test_a_quiet_box_preempting_now_and_then_flags_nothing():
    rng = random.Random(0)
    wall = [0.007] * 300
    cpu = [0.0148] * 300
    switches = [rng.choice((0, 0, 0, 1, 1, 2)) for _ in wall]
    assert not any(disturbed(wall, cpu, switches))


def test_other_processes_cpu_is_read_over_pooled_windows():
    wall, own = [0.01] * 100, [0.02] * 100
    machine = [0.02] * 50 + [0.04] * 50  # from sample 50 on, others run 2 cores beside us
    flags = others_busy(wall, own, machine)
    assert not any(flags[:50]) and all(flags[50:])
    assert others_busy(wall, own, [None] * 100) == [False] * 100  # no /proc/stat: no claim


def test_statistics_and_ratios_rest_on_quiet_samples():
    samples = [0.010] * 8 + [0.100, 0.100]
    host = {"cpu_s": [0.02] * 8 + [0.02, 0.02], "switches": [1] * 8 + [50, 50], "others_busy": [False] * 10}
    st = stats_ms(samples, host)
    assert st["disturbed"] == 2 and st["n"] == 8 and st["median_ms"] == pytest.approx(10.0)
    num = {"samples_ms": [1, 1, 9, 1], "disturbed_flags": [False, False, True, False]}
    den = {"samples_ms": [2, 2, 2, 9], "disturbed_flags": [False, False, False, True]}
    assert quiet_pairs(num, den) == ([1, 1], [2, 2])  # a round either variant lost is dropped from both


def test_sweep_rows_say_how_many_samples_were_disturbed():
    rec = bench.attention_sweep([100], capacity=1024, hq=2, hkv=1, head_dim=16, repeats=4, warmup=1,
                                bw={"gb_per_s": 10.0, "llc_bytes": None}, progress=False)
    for r in rec["rows"]:
        assert r["disturbed"] == sum(r["disturbed_flags"]) and len(r["disturbed_flags"]) == 4
        assert r["n"] == (4 - r["disturbed"] if 4 - r["disturbed"] >= 3 else 4)


def test_trend_verdicts():
    rng = random.Random(1)
    flat = [[(i, 100 + rng.gauss(0, 5), False) for i in range(300)] for _ in range(2)]
    grow = [[(i, 100 + 0.5 * i + rng.gauss(0, 5), False) for i in range(300)] for _ in range(2)]
    assert trend(flat)["verdict"] == "flat" and trend(grow)["verdict"] == "grows"
    assert trend(flat[:1])["verdict"] == "inconclusive" and "two" in trend(flat[:1])["why"]
    one_grows = [grow[0], flat[1]]  # growth must be present in every repeat
    assert trend(one_grows)["verdict"] != "grows"
    burst = [[(i, 400 if i >= 150 else 100, i >= 150) for i in range(300)], flat[1]]  # flagged: left out
    assert trend(burst)["verdict"] == "flat" and trend(burst)["disturbed_chunks"] == [(150, 299)]
    busy = [[(i, 100, i >= 60) for i in range(300)] for _ in range(2)]
    t = trend(busy)
    assert t["verdict"] == "inconclusive" and t["why"].startswith("the machine was busy") and "60-299" in t["why"]
    assert describe(t).startswith("inconclusive")
    assert resistant_slope([0, 1, 2, 3, 4, 5], [0, 2, 4, 6, 8, 10]) == pytest.approx(2.0)
    assert stretches([1, 2, 3, 10, 11]) == [(1, 3), (10, 11)]


def _busy(n: int) -> list:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def _neighbours_during(model, first: int, last: int, n: int = 0):
    """Make ``model.generate_streaming`` start ``n`` busy processes (two per core by default) at chunk ``first`` of
    its first stream and kill them after chunk ``last``; returns the processes (kill them in any case)."""
    procs, calls, gen = [], [], model.generate_streaming
    n = n or 2 * (os.cpu_count() or 2)  # two per core: the cores are taken on a machine of any size

    def wrapped(*a, **kw):
        calls.append(1)
        for i, chunk in enumerate(gen(*a, **kw)):
            if len(calls) == 1 and i == first:
                procs.extend(_busy(n))
                time.sleep(0.2)  # let them take the cores
            if len(calls) == 1 and i == last:
                for p in procs:
                    p.kill()
            yield chunk
    model.generate_streaming = wrapped
    return procs


def _stream_beside_neighbours(first: int, last: int, *, chunks: int, repeats: int) -> tuple:
    """A warm tiny-model stream of ``chunks`` chunks with neighbours busy during chunks ``first``-``last`` of its
    first repeat: (its record, the stream_profile keywords for a quiet rerun on the same model)."""
    from fastattn.models import build_voxcpm2
    model = build_voxcpm2("tiny", dtype="float32")
    kw = {"modes": ("upstream",), "model": model, "progress": False, "retries": 0}
    bench.stream_profile("tiny", 10, repeats=1, **kw)  # warm
    procs = _neighbours_during(model, first, last)
    try:
        rec = bench.stream_profile("tiny", chunks, repeats=repeats, **kw)
    finally:
        for p in procs:
            p.kill()
        del model.generate_streaming
    return rec, kw


@pytest.mark.slow
def test_a_neighbour_taking_both_cores_is_flagged_where_it_ran():
    """Two busy processes per core during chunks 40-79 of a 120-chunk stream: the record names
    disturbed chunks inside that window. What the verdict makes of them is checked on planted series
    (test_trend_verdicts) and, as a timing outcome, by the benchmark below."""
    rec, _ = _stream_beside_neighbours(40, 79, chunks=120, repeats=1)
    bad = rec["trend"]["upstream"]["disturbed_chunks"]
    assert rec["disturbed"]["upstream"] > 0 and any(a <= 79 and b >= 40 for a, b in bad), bad


@pytest.mark.timing
def test_a_neighbour_taking_both_cores_cannot_make_a_stream_decay():
    """Four processes busy during the second half of a stream's first repeat (what turned a flat stream into
    "decays (+311%)" on a 2-core EPYC): the verdict comes out flat or inconclusive, never "grows", and the record
    names the disturbed chunks. A quiet rerun never says it grows either."""
    rec, kw = _stream_beside_neighbours(150, 299, chunks=300, repeats=2)
    six = sixths([r["ms"] for r in rec["rows"] if r["repeat"] == 0])
    naive = f"one run's last sixth / first sixth: {six[-1] / six[0]:.2f}"  # what decided the verdict before
    assert rec["trend"]["upstream"]["verdict"] in ("flat", "inconclusive"), (rec["verdict"], naive)
    bad = rec["trend"]["upstream"]["disturbed_chunks"]
    assert rec["disturbed"]["upstream"] > 0 and any(a <= 200 <= b for a, b in bad), bad
    quiet = bench.stream_profile("tiny", 300, repeats=3, **kw)
    if quiet["trend"]["upstream"]["quiet_share"] < 0.9:  # then "the machine was busy" is the right answer
        pytest.skip(f"another process took the cores during the quiet rerun: {quiet['verdict']}")
    # Never "grows" on a quiet rerun either. "flat" is not asserted: a tiny model's 2-5 ms chunks right after four
    # processes were killed can leave an interval that spans the tolerance ("inconclusive"), a timing outcome a
    # test must not depend on (it failed so once in a clean-clone run).
    assert quiet["trend"]["upstream"]["verdict"] in ("flat", "inconclusive"), quiet["verdict"]
