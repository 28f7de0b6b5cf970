"""Memory: KV bytes per request, per-step allocations, cache fill and growth cost, peak RSS."""

from __future__ import annotations

import statistics
import subprocess
import sys
from typing import Optional

import torch

from fastattn.cache import RightSizedKVCache
from fastattn.devices import dtype_name, quiet_native_stderr, resolve_device
from fastattn.devices import dtype_of as _dtype
from fastattn.forward import cache_granularity
from fastattn.models import voxcpm2_config
from fastattn.patch import cache_nbytes, original_functions, swapped, variant_functions

from .lm import lm_and_caches, lm_config, start_request
from .records import env_record, record
from .rss_probe import reset_peak
from .stream import time_chunks
from .timing import stats_ms, time_interleaved


def _base_lm(preset: str, device, dt, max_length: int, bucket, prefill: int) -> tuple:
    """The base LM's cache arguments, the granularity ``setup_cache`` picks, random K/V of ``prefill`` slots a layer."""
    cfg = lm_config(preset, None)
    geo = (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.kv_channels, 1, device, dt)
    g = cache_granularity(cfg, torch.device(device), dt, max_length, bucket)
    return geo, g, [(torch.randn(1, geo[1], prefill, geo[2], dtype=dt, device=device),) * 2 for _ in range(geo[0])]


def kv_memory(preset: str = "full", *, prefill: int = 100, steps: int = 200, dtype="bfloat16",
              max_length: int = 8192, bucket: Optional[int] = None, device="cpu") -> dict:
    """KV bytes of one request, both LMs, read from upstream's and the patched caches; rows per LM and variant.
    ``right_sized`` is False where the patched cache holds all ``max_length`` slots (no exact window, as on CUDA)."""
    from voxcpm.modules.minicpm4.cache import StaticKVCache

    device, dt = resolve_device(device), _dtype(dtype)
    geo, g, kv = _base_lm(preset, device, dt, max_length, bucket, prefill)
    rows = []
    for name, layers in (("base_lm", geo[0]), ("residual_lm", voxcpm2_config(preset)["residual_lm_num_layers"])):
        up = StaticKVCache(layers, *geo[1:], max_length=max_length)
        pa = RightSizedKVCache(layers, *geo[1:], max_length=max_length, bucket=g)
        pa.fill_caches(kv[:layers])  # the residual LM has no more layers than the base LM, the same heads
        for _ in range(min(steps, max_length - prefill)):
            pa.step()
        rows += [{"lm": name, "variant": "upstream", "layers": layers, "slots": up.kv_cache.shape[4],
                  "bytes": cache_nbytes(up)},
                 {"lm": name, "variant": "patched", "layers": layers, "slots": pa.capacity, "bytes": pa.nbytes}]
        sized = pa.windowed  # the same granularity for both LMs
        del up, pa
    total = {v: sum(r["bytes"] for r in rows if r["variant"] == v) for v in ("upstream", "patched")}
    layers = sum(r["layers"] for r in rows if r["variant"] == "upstream")
    why = f"no exact window on {device.type}" if bucket is None else f"bucket={bucket} asked"
    note = (f"in {g}-slot windows, measured from the cache objects after a {prefill}-token fill and {steps} steps"
            if sized else f"{why}: the patched cache holds all {max_length} slots, as upstream's")
    return record("kv_memory", env=env_record(device, dtype),
                  params={"preset": preset, "prefill": prefill, "steps": steps, "dtype": dtype_name(dt),
                          "max_length": max_length, "bucket": g, "layers": layers},
                  rows=rows, per_token_bytes=total["upstream"] // max_length, upstream_bytes=total["upstream"],
                  patched_bytes=total["patched"], ratio=total["patched"] / total["upstream"], right_sized=sized,
                  note=note)


def step_allocations(*, preset: str = "small", layers: int = 1, dtype="float32", position: int = 256,
                     device="cpu", max_length: int = 8192) -> dict:
    """Bytes allocated by one decode step (profiler ``profile_memory``), upstream vs patched."""
    from torch.profiler import ProfilerActivity, profile

    device, dt = resolve_device(device), _dtype(dtype)
    lm, cfg, D, caches, g, x = lm_and_caches(preset, layers, dt, device, max_length, None, 0)
    start_request(caches, cfg, D, position, g, device, dt)
    pos = torch.tensor([position], device=device)
    out = {}
    for name, fns in (("upstream", original_functions()), ("patched", variant_functions("exact"))):
        lm.kv_cache = caches[name]
        with swapped(fns), torch.inference_mode():
            lm.forward_step(x, pos)  # warm
            if device.type == "cuda":
                counted = _cuda_allocations(lambda: lm.forward_step(x, pos), device)
            else:
                with quiet_native_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                    lm.forward_step(x, pos)
                allocs = [e for e in prof.events() if e.cpu_memory_usage > 0]
                counted = {"allocated_bytes": sum(e.cpu_memory_usage for e in allocs), "allocations": len(allocs),
                           "largest": sorted(((e.name, e.cpu_memory_usage) for e in allocs), key=lambda t: -t[1])[:5]}
        out[name] = {**counted, "cache_bytes": cache_nbytes(caches[name])}
    return record("step_allocations", env=env_record(device, dt),
                  params={"preset": preset, "layers": layers, "dtype": dtype, "position": position},
                  rows=[{"variant": n, **{k: v for k, v in d.items() if k != "largest"}} for n, d in out.items()],
                  variants=out)


def _cuda_allocations(fn, device) -> dict:
    """Peak bytes and count of CUDA allocations ``fn`` made (allocator counters: the CPU profiler sees none)."""
    torch.cuda.synchronize(device)
    reset_peak(device)
    before = torch.cuda.memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    after = torch.cuda.memory_stats(device)
    return {"allocated_bytes": after["allocated_bytes.all.peak"] - before["allocated_bytes.all.current"],
            "allocations": after["allocation.all.allocated"] - before["allocation.all.allocated"], "largest": [],
            "counted_by": "torch.cuda.memory_stats"}


def fill_cost(preset: str = "full", *, prefill: int = 100, dtype="bfloat16", device="cpu", max_length: int = 8192,
              repeats: int = 5, warmup: int = 1) -> dict:
    """ms of ``fill_caches``, interleaved: upstream zeroes all ``max_length`` slots, patched only what it uses."""
    from voxcpm.modules.minicpm4.cache import StaticKVCache

    device, dt = resolve_device(device), _dtype(dtype)
    geo, g, kv = _base_lm(preset, device, dt, max_length, None, prefill)  # what the patch picks on this device
    caches = {"upstream": StaticKVCache(*geo, max_length=max_length),
              "patched": RightSizedKVCache(*geo, max_length=max_length, bucket=g)}
    host: dict = {}
    times = time_interleaved({n: (lambda c=c: c.fill_caches(kv)) for n, c in caches.items()}, repeats=repeats,
                             warmup=warmup, device=device, host=host)
    rows = [{"variant": n, **stats_ms(times[n], host[n]), "cache_bytes": cache_nbytes(c)} for n, c in caches.items()]
    return record("fill_cost", env=env_record(device, dt), rows=rows,
                  params={"preset": preset, "layers": geo[0], "prefill": prefill, "dtype": dtype_name(dt),
                          "max_length": max_length, "granularity": g})


def cache_growth(preset: str = "full", *, prefill: int = 100, steps: int = 8000, dtype="bfloat16", device="cpu",
                 max_length: int = 8192, bucket: Optional[int] = None) -> dict:
    """Every ``step()`` of a long request's :class:`RightSizedKVCache` timed, beside upstream's zero-fill.
    Rows: the steps that moved the storage; ``right_sized`` is False where there is no exact window (it never grows)."""
    device, dt = resolve_device(device), _dtype(dtype)
    geo, g, kv = _base_lm(preset, device, dt, max_length, bucket, prefill)  # what the patch picks on this device
    cache = RightSizedKVCache(*geo, max_length=max_length, bucket=g)
    cache.fill_caches(kv)

    def steps_of():  # one chunk per step(): its position and whether the storage moved
        for _ in range(min(steps, max_length - prefill)):
            gen = cache.generation
            yield cache.step(), cache.generation != gen

    bound = []  # checked outside the timed stretch, after every step
    done, rows = time_chunks(steps_of(), device, after=lambda: {"capacity": cache.capacity}, on_chunk=lambda _: (
        bound.append(cache.capacity <= min(max(2 * cache.current_length, g), max_length))))
    moves = [{"position": p, "ms": r["ms"], "capacity": r["capacity"]} for (p, moved), r in zip(done, rows) if moved]
    ms = [r["ms"] for r in rows]
    total, worst, bound_ok = sum(ms) / 1e3, max(ms, default=0.0) / 1e3, all(bound)
    fill = fill_cost(preset, prefill=prefill, dtype=dtype, device=device, max_length=max_length, repeats=5)
    return record("cache_growth", env=env_record(device, dt), rows=moves,
                  params={"preset": preset, "layers": geo[0], "prefill": prefill, "steps": steps, "granularity": g,
                          "dtype": dtype_name(dt), "max_length": max_length},
                  summary={"step_total_s": total, "moves": len(moves), "max_step_ms": worst * 1e3,
                           "bound_held_every_step": bool(bound_ok), "final_capacity": cache.capacity,
                           "upstream_fill_ms": next(r for r in fill["rows"] if r["variant"] == "upstream")["median_ms"],
                           "right_sized": cache.windowed})


def peak_rss(preset: str = "small", *, dtype="bfloat16", steps: int = 20, runs: int = 3) -> dict:
    """Peak RSS of one short request, upstream vs patched, each in a fresh process (Linux). Rows: the :mod:`.rss_probe`
    bytes per process; ``resolved``: the median peaks differ by more than the widest spread within a variant."""
    rows = []
    for run in range(runs):  # a run's two processes side by side: a peak RSS is the process's own
        cmd = [sys.executable, "-m", "fastattn.lab.bench.rss_probe", preset, dtype]
        procs = {v: subprocess.Popen([*cmd, v, str(steps)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for v in ("upstream", "patched")}
        for variant, proc in procs.items():
            out, err = proc.communicate(timeout=1200)
            if proc.returncode != 0:
                raise RuntimeError(f"peak_rss {variant} failed: {err[-2000:]}")
            built, resting, trimmed, peak, cache = map(int, out.split()[-5:])
            rows.append({"variant": variant, "run": run, "built_bytes": built, "resting_bytes": resting,
                         "allocator_retained_bytes": resting - trimmed, "trimmed_bytes": trimmed,
                         "peak_bytes": peak, "request_bytes": peak - trimmed, "cache_bytes": cache})
    med = {v: {k: statistics.median(r[k] for r in rows if r["variant"] == v) for k in rows[0] if k.endswith("_bytes")}
           for v in ("upstream", "patched")}
    peaks = {v: [r["peak_bytes"] for r in rows if r["variant"] == v] for v in med}
    spread = max(max(p) - min(p) for p in peaks.values())
    diff = med["patched"]["peak_bytes"] - med["upstream"]["peak_bytes"]
    summary = {"cache_bytes_saved": med["upstream"]["cache_bytes"] - med["patched"]["cache_bytes"],
               "peak_difference_bytes": diff, "peak_spread_bytes": spread, "resolved": abs(diff) > spread,
               "runs": runs}
    return record("peak_rss", env=env_record("cpu", dtype), rows=rows, variants=med, summary=summary,
                  params={"preset": preset, "dtype": dtype, "steps": steps, "runs": runs})
