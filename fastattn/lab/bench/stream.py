"""The symptom users report (#293): every chunk of a ``generate_streaming`` run timed, with a trend verdict."""

from __future__ import annotations

import statistics
import time
from contextlib import nullcontext
from typing import Sequence

import torch

from fastattn.clock import rotated, sync
from fastattn.devices import resolve_device
from fastattn.models import build_voxcpm2, silence_progress
from fastattn.patch import patch_voxcpm

from .decode import Timers, instrumented, timer_overhead_us
from .noise import delta, disturbed_series, host_counters
from .records import env_record, record
from .timing import progress_bar
from .trend import describe, trend

VARIANTS = ("upstream", "exact", "fast")
#: what a chunk's time is split into (ms): the two LM steps, the local DiT (the CFM solve), the local feature encoder,
#: the streaming VAE decode, and the rest of the chunk (projections, stop head, the generator's own work)
COMPONENTS = ("base_lm", "residual_lm", "dit", "encoder", "vae", "other")
_TIMED = dict(zip(COMPONENTS, ("base_lm", "residual_lm", "local_dit", "local_encoder", "vae")))  # :class:`.Timers`
SENTENCE = "The quick brown fox jumps over the lazy dog near the quiet river bank. "


def text_for(chunks: int) -> str:
    """A text long enough that voxcpm's length cap (about 6 tokens of audio per text token) allows ``chunks``."""
    return SENTENCE * max(1, -(-(chunks // 5 + 10) // len(SENTENCE)))


def time_chunks(gen, device, after=None, on_chunk=None) -> tuple:
    """``(chunks, rows)``: per chunk its wall ``ms`` (device synchronised), :func:`.noise.delta`'s counters, what
    ``after()`` returns, and ``disturbed``. Counters, ``after`` and ``on_chunk(chunk)`` run outside the timing."""
    out, rows = [], []
    sync(device)
    h0 = host_counters()
    t0 = time.perf_counter()
    for chunk in gen:
        sync(device)
        t1 = time.perf_counter()
        h1 = host_counters()
        out.append(chunk)
        rows.append({"ms": (t1 - t0) * 1e3, **delta(h0, h1), **(after() if after else {})})
        if on_chunk:
            on_chunk(chunk)
        h0 = host_counters()
        t0 = time.perf_counter()
    for r, f in zip(rows, disturbed_series([r["ms"] / 1e3 for r in rows], rows)):
        r["disturbed"] = f
    return out, rows


def sixths(values: Sequence[float]) -> list:
    """Medians of each sixth of a sequence (the first chunk, which includes the prefill, left out)."""
    v = list(values)[1:]
    n = len(v)
    return [statistics.median(v[i * n // 6:(i + 1) * n // 6]) for i in range(6) if v[i * n // 6:(i + 1) * n // 6]]


def variant_trend(rows: list, variant: str, component: str = "") -> dict:
    """:func:`.trend.trend` of one variant's per-chunk ms (or one of :data:`COMPONENTS`) over its repeats."""
    reps = sorted({r["repeat"] for r in rows if r["variant"] == variant})
    ms = (lambda r: r["components"][component]) if component else (lambda r: r["ms"])  # noqa: E731
    return trend([[(r["chunk"], ms(r), r["disturbed"]) for r in rows if r["variant"] == variant and r["repeat"] == k]
                  for k in reps])


_JUDGED: dict = {}  # a record's identity -> its trends: judged once per process


def stream_trends(rec: dict) -> dict:
    """``{variant: trend}`` of a ``stream_profile`` record, judged again from its rows by today's rule (a stored
    ``verdict`` string is what the code of its day said; rows without ``disturbed`` count as quiet). A record that
    carries its trends but no rows keeps them (none: ``{}``)."""
    if not rec.get("rows"):
        return rec.get("trend", {})
    key = _identity(rec)
    if key not in _JUDGED:
        rows = [r if "disturbed" in r else {**r, "disturbed": False} for r in rec["rows"]]
        _JUDGED[key] = _trends(rows, rec["params"]["modes"], rec["params"].get("components"))
    return _JUDGED[key]


def _identity(rec: dict) -> tuple:
    """One record, however often it is read from disk."""
    return (rec.get("env", {}).get("time_utc"), repr(sorted(rec["params"].items())), len(rec["rows"]),
            sum(r["ms"] for r in rec["rows"]))


def stream_verdicts(rec: dict) -> dict:
    """``{variant: one line}``: :func:`stream_trends` in words."""
    return {v: describe(t) for v, t in stream_trends(rec).items()}


def _trends(rows: list, modes, components: bool) -> dict:
    keep = ("slope_ms_per_100", "ci", "verdict", "why", "change", "change_ci", "level_ms")
    trends = {v: variant_trend(rows, v) for v in modes}
    for v in modes if components else ():
        trends[v].update({c: {k: x for k, x in variant_trend(rows, v, c).items() if k in keep} for c in COMPONENTS})
    return trends


def stream_profile(preset: str, chunks: int, *, dtype="bfloat16", device="cpu",
                   modes: Sequence[str] = VARIANTS, seed: int = 0, inference_timesteps: int = 2,
                   progress: bool = True, repeats: int = 2, model=None, retries: int = 1,
                   components: bool = False) -> dict:
    """Every chunk of a ``generate_streaming`` run timed per variant, order rotated each repeat, ``retries`` more for
    a variant a busy machine left inconclusive; rows: :func:`time_chunks`'s with ``variant, repeat, chunk``."""
    if not modes or any(m not in VARIANTS for m in modes):
        raise ValueError(f"modes must be a non-empty selection of {VARIANTS}, got {list(modes)}")
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 7:
        raise ValueError(f"chunks must be an int >= 7 (six sixths and a first chunk), got {chunks!r}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1 (2 or more for a trend verdict), got {repeats!r}")
    device = resolve_device(device)
    model = model or build_voxcpm2(preset, seed=seed, device=str(device), dtype=dtype)
    silence_progress()
    text = text_for(chunks)
    rows, streams, done = [], {}, {v: 0 for v in modes}

    def run(variant):  # one stream, its chunks' rows with ``position`` and optionally ``components``
        timers = Timers(device) if components else None

        def after():
            out = {"position": model.base_lm.kv_cache.current_length - 1}
            if timers:
                t = timers.totals_s()
                out["components"] = {c: t.get(name, 0.0) * 1e3 for c, name in _TIMED.items()}
            return out
        with (patch_voxcpm(model, mode=variant) if variant != "upstream" else nullcontext(),
              instrumented(model, timers, attention=False, vae=True) if timers else nullcontext()):
            torch.manual_seed(seed)
            gen = model.generate_streaming(text, min_len=chunks, max_len=chunks,
                                           inference_timesteps=inference_timesteps)
            out, chunk_rows = time_chunks(gen, device, after)
        for r in chunk_rows if components else ():
            r["components"]["other"] = r["ms"] - sum(r["components"].values())
        streams.setdefault(variant, out)
        rows.extend({"variant": variant, "repeat": done[variant], "chunk": i, **r} for i, r in enumerate(chunk_rows))
        done[variant] += 1

    for r in progress_bar(range(repeats), progress, "stream profile"):
        for variant in rotated(modes, r):
            run(variant)
    for _ in range(retries):  # a busy stretch: measure again rather than judge the noise
        for variant in [v for v in modes if variant_trend(rows, v)["why"].startswith("the machine was busy")]:
            run(variant)
    ref = streams.get("upstream")
    identical = {v: (ref is not None and len(s) == len(ref) and all(torch.equal(a, b) for a, b in zip(s, ref)))
                 for v, s in streams.items()}
    quiet = {v: [_chunk_median([x for x in rows if x["variant"] == v and x["chunk"] == i]) for i in range(chunks)]
             for v in modes}
    trends = _trends(rows, modes, components)
    params = {"preset": preset, "chunks": chunks, "dtype": dtype, "modes": list(modes), "seed": seed,
              "components": components, "inference_timesteps": inference_timesteps, "repeats": repeats,
              "retries": retries, "repeats_run": dict(done), "text_chars": len(text),
              "weights": getattr(model, "fastattn_info", {}).get("weights", "random")}
    rec = record("stream_profile", env=env_record(device, dtype), params=params, rows=rows, identical=identical,
                 sixths={v: sixths(quiet[v]) for v in modes}, trend=trends,
                 verdict={v: describe(t) for v, t in trends.items()},
                 timer_overhead_us=timer_overhead_us() if components else None,
                 disturbed={v: sum(x["disturbed"] for x in rows if x["variant"] == v) for v in modes})
    _JUDGED[_identity(rec)] = trends  # judged just now, by today's rule
    return rec


def _chunk_median(samples: list) -> float:
    """Median ms of a chunk's quiet samples (all of them where none is quiet; the trend never uses this)."""
    quiet = [x["ms"] for x in samples if not x["disturbed"]]
    return statistics.median(quiet or [x["ms"] for x in samples])


def stream_table(rec: dict) -> list:
    """One row per variant of a ``stream_profile`` record."""
    out = []
    for v, t in stream_trends(rec).items():
        six = rec["sixths"][v]
        out.append({"variant": v, "repeats": t["repeats"], "first sixth ms": six[0] if six else None,
                    "last sixth ms": six[-1] if six else None, "trend": describe(t),
                    "disturbed chunks": ", ".join(f"{a}-{b}" for a, b in t["disturbed_chunks"]) or "none",
                    "stream equals upstream's": rec["identical"][v]})
    return out


def component_table(rec: dict) -> list:
    """One row per variant and component of a ``stream_profile(components=True)`` record."""
    out = []
    for v, t in stream_trends(rec).items():
        for c in COMPONENTS:
            if ct := t.get(c):
                ci = ct["ci"]
                out.append({"variant": v, "component": c, "median ms": ct["level_ms"],
                            "slope ms / 100 chunks": ct["slope_ms_per_100"],
                            "95% CI": f"[{ci[0]:+.2f}, {ci[1]:+.2f}]" if ci else "n/a", "verdict": ct["verdict"]})
    return out
