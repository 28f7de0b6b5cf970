"""Measuring instruments: attention sweep, decode-step sweep, whole decode, memory, bandwidth floor.

Every function returns a *record*: ``{"kind", "env", "params", "rows", ...}`` that
plots and target checks read and :func:`save_record` writes as JSON (+ CSV of
the rows) under a name that is never reused. Timing is honest on a shared, noisy
box: variants are interleaved call by call (rotating their order each repeat),
after warm-up, several repeats, and reported as median with p10/p90 spread; on
CUDA every sample is bracketed by CUDA events and one synchronisation. No test
asserts a time; :func:`check_targets` compares records with the workbook's
targets and says pass or fail with the measured figure.
"""

from __future__ import annotations

import csv
import functools
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from .attention import MODES, attention_step
from .models import DTYPES

__all__ = ["env_record", "time_interleaved", "attention_sweep", "decode_step_sweep", "whole_decode",
           "resolve_device", "kv_memory", "step_allocations", "peak_rss", "bandwidth", "floor_ms", "llc_bytes",
           "save_record", "load_record", "check_targets", "DTYPES"]



def _progress(it, enabled: bool, desc: str):
    if not enabled:
        return it
    from tqdm.auto import tqdm
    return tqdm(it, desc=desc, leave=False)


def _dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {dtype!r}")
    return DTYPES[dtype]


def resolve_device(device) -> torch.device:
    """``"auto"`` -> CUDA when present, else CPU; ``"cuda"`` without CUDA is a ValueError."""
    device = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                          "cpu" if device == "auto" else device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but CUDA is not available on this machine")
    return device


def env_record(device="cpu", dtype=None) -> dict:
    """What a record needs to be compared across boxes."""
    from importlib.metadata import version
    from .doctor import cpu_name, git_commit
    device = torch.device(device)
    return {
        "time_utc": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "torch": torch.__version__, "voxcpm": version("voxcpm"), "fastattn": version("fastattn"),
        "git_commit": git_commit(), "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name(),
        "dtype": None if dtype is None else str(_dtype(dtype)).replace("torch.", ""),
        "threads": torch.get_num_threads(),
        "cpu_capability": getattr(torch.backends.cpu, "get_cpu_capability", lambda: "unknown")(),
        "python": sys.version.split()[0],
    }


# --------------------------------------------------------------------------- timing
def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_interleaved(fns: dict, *, repeats: int = 7, warmup: int = 2, device="cpu") -> dict:
    """Time each callable ``repeats`` times, interleaved (order rotated per repeat), after ``warmup`` rounds.

    Returns ``{name: [seconds, ...]}``. On CUDA each sample uses CUDA events
    around the call and one synchronisation.
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
    for r in range(repeats):
        order = names[r % len(names):] + names[:r % len(names)]
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
    s = sorted(x * 1e3 for x in samples)
    q = lambda f: s[min(len(s) - 1, max(0, round(f * (len(s) - 1))))]
    return {"median_ms": statistics.median(s), "p10_ms": q(0.1), "p90_ms": q(0.9), "min_ms": s[0], "n": len(s)}


# --------------------------------------------------------------------------- the floor
def llc_bytes() -> int:
    """Last-level cache size from sysfs (the floor means little below it); 32 MiB when unknown."""
    best = 0
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    for idx in base.glob("index*") if base.exists() else []:
        try:
            size = (idx / "size").read_text().strip()
            mult = {"K": 1024, "M": 2**20, "G": 2**30}.get(size[-1], 1)
            best = max(best, int(size.rstrip("KMG")) * mult)
        except (OSError, ValueError):
            continue
    return best or 32 * 2**20


def bandwidth(device="cpu", *, nbytes: int = 512 * 2**20, repeats: int = 7) -> dict:
    """This box's memory bandwidth: a large copy, counting bytes read plus written. GB/s = 1e9 B/s."""
    device = resolve_device(device)
    n = nbytes // 4
    src = torch.rand(n, device=device)
    dst = torch.empty_like(src)
    t = time_interleaved({"copy": lambda: dst.copy_(src)}, repeats=repeats, warmup=2, device=device)["copy"]
    med = statistics.median(t)
    return {"bytes_moved": 2 * n * 4, "median_s": med, "gb_per_s": 2 * n * 4 / med / 1e9,
            "best_gb_per_s": 2 * n * 4 / min(t) / 1e9, "llc_bytes": llc_bytes() if device.type == "cpu" else None}


def live_kv_bytes(length: int, hkv: int, head_dim: int, dtype) -> int:
    """Bytes of live K and V one attention call must read once: 2 x Hkv x length x D x element size."""
    return 2 * hkv * length * head_dim * torch.tensor([], dtype=_dtype(dtype)).element_size()


def floor_ms(length: int, hkv: int, head_dim: int, dtype, gb_per_s: float) -> float:
    """The physical floor of one sliced attention call: live K/V bytes over the bandwidth."""
    return live_kv_bytes(length, hkv, head_dim, dtype) / (gb_per_s * 1e9) * 1e3


# --------------------------------------------------------------------------- attention sweep
def attention_sweep(positions: Sequence[int], *, capacity: int = 8192, dtype="float32", device="cpu",
                    hq: int = 16, hkv: int = 2, head_dim: int = 128, modes: Sequence[str] = MODES,
                    bucket: Optional[int] = None, repeats: int = 7, warmup: int = 2, seed: int = 0,
                    bw: Optional[dict] = None, slice_fix: bool = True, progress: bool = True) -> dict:
    """One ``attention_step`` call per mode at each position (length = position + 1), interleaved.

    Rows: ``{mode, position, length, window, median_ms, p10_ms, p90_ms, min_ms, n,
    max_err_f64, live_bytes, floor_ms, floor_meaningful, x_floor}``; ``floor_meaningful`` is
    False where the live K/V fit in the last-level cache (the loop re-reads
    them warm, so the DRAM floor does not bind). ``bucket=None`` measures the
    default ``exact`` (the calibrated granularity, recorded in params). With
    ``slice_fix``, a ``slice_fix`` row per position times the public slice fix
    (SDPA over ``cache[:, :, :p+1]``, no mask: what ``fast`` was before it chose by
    measurement), so ``fast`` is judged against what others ship. ``fast_choice``
    records which implementation ``fast`` picked and why.
    """
    from .attention import _exact_window
    from .checks import f64_attention
    from .fast import fast_report, sdpa_slice

    device, dt = resolve_device(device), _dtype(dtype)
    for p in positions:
        if not 0 <= p < capacity:
            raise ValueError(f"positions must be in [0, capacity={capacity}), got {p}")
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise ValueError(f"modes must be among {MODES}, got {bad}")
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(1, hkv, capacity, head_dim, generator=g).to(device=device, dtype=dt)
    v = torch.randn(1, hkv, capacity, head_dim, generator=g).to(device=device, dtype=dt)
    q = torch.randn(1, hq, 1, head_dim, generator=g).to(device=device, dtype=dt)
    bw = bw or bandwidth(device)
    llc = bw.get("llc_bytes") or 0
    variants = list(modes) + (["slice_fix"] if slice_fix else [])
    rows = []
    for p in _progress(positions, progress, f"attention {dtype}"):
        n = p + 1
        fns = {m: (lambda m=m: attention_step(q, k, v, n, mode=m, bucket=bucket)) for m in modes}
        if slice_fix:
            fns["slice_fix"] = lambda: sdpa_slice(q, k[:, :, :n], v[:, :, :n])
        times = time_interleaved(fns, repeats=repeats, warmup=warmup, device=device)
        r64 = f64_attention(q, k, v, n)
        live = live_kv_bytes(n, hkv, head_dim, dt)
        fl = floor_ms(n, hkv, head_dim, dt, bw["gb_per_s"])
        for m in variants:
            st = _stats_ms(times[m])
            window = {"reference": capacity, "fast": n, "slice_fix": n}.get(m) or _exact_window(q, k, n, bucket)
            rows.append({"mode": m, "position": p, "length": n, "window": window, **st,
                         "max_err_f64": (fns[m]().double() - r64).abs().max().item(),
                         "live_bytes": live, "floor_ms": fl, "floor_meaningful": live > llc,
                         "x_floor": st["median_ms"] / fl})
    fast_choice = [c for c in fast_report() if c["dtype"] == str(dt).replace("torch.", "")
                   and (c["hq"], c["hkv"], c["head_dim"]) == (hq, hkv, head_dim)]
    return {"kind": "attention", "env": env_record(device, dt), "fast_choice": fast_choice,
            "params": {"positions": list(positions), "capacity": capacity, "dtype": str(dt).replace("torch.", ""),
                       "hq": hq, "hkv": hkv, "head_dim": head_dim, "bucket": bucket,
                       "exact_granularity": _granularity_of(q, k, bucket), "repeats": repeats,
                       "warmup": warmup, "modes": variants},
            "bandwidth": bw, "rows": rows}


def fast_choices(device="cpu", *, dtypes=("float32", "bfloat16"), hq: int = 16, hkv: int = 2, head_dim: int = 128,
                 seed: int = 0) -> dict:
    """What ``fast`` picks on this device for each dtype and key-count class, and why: every candidate's
    error vs float64, ``reference``'s error on the same data, whether it was accepted, its median time."""
    from .fast import LENGTH_CLASSES, choose_fast
    device = resolve_device(device)
    rows = []
    for name in dtypes:
        for cls in LENGTH_CLASSES:
            ch = choose_fast(device, _dtype(name), hq=hq, hkv=hkv, head_dim=head_dim, lq=1, length_class=cls, seed=seed)
            rows += [{"class": f"{name}, {cls}", "dtype": name, **c, "reference_max_err": ch["reference_max_err"],
                      "winner": c["candidate"] == ch["winner"]} for c in ch["candidates"]]
    return {"kind": "fast_choice", "env": env_record(device),
            "params": {"dtypes": list(dtypes), "hq": hq, "hkv": hkv, "head_dim": head_dim, "classes": LENGTH_CLASSES},
            "rows": rows, "note": "fast mode trades bit-identity for speed: within twice reference's error vs float64"}


# --------------------------------------------------------------------------- decode-step sweep
def _lm_config(preset: str, layers: Optional[int]):
    from voxcpm.modules.minicpm4 import MiniCPM4Config
    from .models import voxcpm2_config
    cfg = voxcpm2_config(preset)["lm_config"]
    if layers is not None:
        cfg["num_hidden_layers"] = layers
    return MiniCPM4Config.model_validate(cfg)


def _granularity_of(q, k, bucket):
    """The window granularity ``exact`` used: the int bucket, the calibrated one, or None (whole cache)."""
    from .exactness import exact_granularity
    return bucket if bucket is not None else exact_granularity(
        q.device, q.dtype, hq=q.shape[1], hkv=k.shape[1], head_dim=q.shape[3], capacity=k.shape[2], lq=q.shape[2])


def _lm_and_caches(preset: str, layers: Optional[int], dt, device, max_length: int, bucket, seed: int):
    """A MiniCPMModel with the preset's LM geometry (random weights, built with voxcpm's own classes) and
    the two caches to compare: upstream's StaticKVCache and a RightSizedKVCache of the same geometry."""
    from voxcpm.modules.minicpm4 import MiniCPMModel
    from voxcpm.modules.minicpm4.cache import StaticKVCache
    from .cache import RightSizedKVCache
    from .patch import _cache_bucket, original_functions, swapped

    cfg = _lm_config(preset, layers)
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    with swapped(original_functions()):
        lm = MiniCPMModel(cfg).to(device=device, dtype=dt).eval()
    torch.random.set_rng_state(state)
    D = cfg.kv_channels or cfg.hidden_size // cfg.num_attention_heads
    geo = (cfg.num_hidden_layers, cfg.num_key_value_heads, D, 1, device, dt)
    caches = {"upstream": StaticKVCache(*geo, max_length=max_length),
              "patched": RightSizedKVCache(*geo, max_length=max_length,
                                           bucket=_cache_bucket(cfg, device, dt, max_length, bucket))}
    return lm, cfg, D, caches


def _start_request(caches: dict, kv: list, p: int) -> None:
    """Put every cache at position ``p``: the prefill ``kv`` (p slots per layer) filled, position p claimed."""
    for c in caches.values():
        c.fill_caches([(a[:, :, :p], b[:, :, :p]) for a, b in kv])
        if c.step() != p:
            raise RuntimeError(f"cache did not start at position {p}")


def _prefill(cfg, D: int, p: int, g, device, dt) -> list:
    return [(torch.randn(1, cfg.num_key_value_heads, p, D, generator=g).to(device=device, dtype=dt),
             torch.randn(1, cfg.num_key_value_heads, p, D, generator=g).to(device=device, dtype=dt))
            for _ in range(cfg.num_hidden_layers)]


def decode_step_sweep(positions: Sequence[int], *, preset: str = "small", layers: Optional[int] = None,
                      dtype="bfloat16", device="cpu", max_length: int = 8192, bucket: Optional[int] = None,
                      repeats: int = 7, warmup: int = 2, seed: int = 0, progress: bool = True) -> dict:
    """One MiniCPM decode step (``MiniCPMModel.forward_step``, the preset's LM geometry), upstream vs patched.

    Upstream: voxcpm's own classes with an 8192-slot ``StaticKVCache``. Patched:
    fastattn's ``exact`` step with a :class:`RightSizedKVCache`. Same weights,
    same prefill, calls interleaved. Rows per variant and position: per-token
    and per-layer medians.
    """
    from .patch import original_functions, swapped, variant_functions

    device, dt = resolve_device(device), _dtype(dtype)
    for p in positions:
        if not 0 <= p < max_length:
            raise ValueError(f"positions must be in [0, max_length={max_length}), got {p}")
    lm, cfg, D, caches = _lm_and_caches(preset, layers, dt, device, max_length, bucket, seed)
    fns = {"upstream": original_functions(), "patched": variant_functions("exact", bucket=bucket)}
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(1, cfg.hidden_size, generator=g).to(device=device, dtype=dt)
    rows = []
    for p in _progress(positions, progress, f"decode step {dtype}"):
        _start_request(caches, _prefill(cfg, D, p, g, device, dt), p)
        pos = torch.tensor([p], device=device)

        def call(name):
            def run():
                lm.kv_cache = caches[name]
                with swapped(fns[name]), torch.inference_mode():
                    return lm.forward_step(x, pos)
            return run

        outs = {n: call(n)() for n in caches}
        times = time_interleaved({n: call(n) for n in caches}, repeats=repeats, warmup=warmup, device=device)
        for n in caches:
            st = _stats_ms(times[n])
            rows.append({"variant": n, "position": p, **st, "per_layer_ms": st["median_ms"] / cfg.num_hidden_layers,
                         "bit_identical": bool(torch.equal(outs[n], outs["upstream"]))})
    lm.kv_cache = None
    return {"kind": "decode_step", "env": env_record(device, dt),
            "params": {"preset": preset, "layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size,
                       "heads": cfg.num_attention_heads, "kv_heads": cfg.num_key_value_heads, "head_dim": D,
                       "positions": list(positions), "dtype": str(dt).replace("torch.", ""),
                       "max_length": max_length, "bucket": bucket, "repeats": repeats, "warmup": warmup},
            "rows": rows}


def compiled_step_sweep(positions: Sequence[int], *, preset: str = "tiny", layers: Optional[int] = None,
                        dtype="float32", device="cpu", backend: str = "inductor", mode: Optional[str] = None,
                        max_length: int = 8192, bucket: Optional[int] = None, repeats: int = 7, warmup: int = 3,
                        seed: int = 0, progress: bool = True) -> dict:
    """Per-token decode step: eager upstream, eager patched, compiled upstream, compiled patched.

    Compiled the way voxcpm's ``optimize()`` does (``fullgraph=True``; ``mode``
    defaults to ``reduce-overhead`` on CUDA). Calls interleaved; the record also
    carries dynamo's graph counts (one per variant expected, never one per position).
    """
    from .graphs import graph_counts, reset_graph_counts
    from .patch import original_functions, swapped, variant_functions

    device, dt = resolve_device(device), _dtype(dtype)
    mode = mode if mode is not None else ("reduce-overhead" if device.type == "cuda" else None)
    lm, cfg, D, caches = _lm_and_caches(preset, layers, dt, device, max_length, bucket, seed)
    static, right = caches["upstream"], caches["patched"]
    if device.type == "cuda":
        torch._dynamo.mark_static_address(static.kv_cache)
        right.set_static_address(True)
    fns = {"upstream": original_functions(), "patched": variant_functions("exact", bucket=bucket)}
    opts = {"backend": backend, "fullgraph": True, **({"mode": mode} if mode else {})}
    step = {}
    for v in fns:
        fn = fns[v]["MiniCPMModel.forward_step"]
        step[f"eager {v}"] = (v, fn.__get__(lm))
        step[f"compiled {v}"] = (v, torch.compile(fn.__get__(lm), **opts))
    torch._dynamo.reset()
    reset_graph_counts()
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(1, cfg.hidden_size, generator=g).to(device=device, dtype=dt)
    rows = []
    for p in _progress(positions, progress, "compiled step"):
        _start_request(caches, _prefill(cfg, D, p, g, device, dt), p)
        pos = torch.tensor([p], device=device)

        def call(name):
            v, f = step[name]
            def run():
                lm.kv_cache = static if v == "upstream" else right
                with swapped(fns[v]), torch.inference_mode():
                    return f(x, pos)
            return run

        times = time_interleaved({n: call(n) for n in step}, repeats=repeats, warmup=warmup, device=device)
        for n in step:
            rows.append({"variant": n, "position": p, **_stats_ms(times[n])})
    return {"kind": "compiled_step", "env": env_record(device, dt), "graphs": graph_counts(),
            "params": {"preset": preset, "layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size,
                       "dtype": str(dt).replace("torch.", ""), "backend": backend, "mode": mode,
                       "positions": list(positions), "bucket": bucket, "repeats": repeats},
            "rows": rows}


# --------------------------------------------------------------------------- whole decode
class _Timers:
    """Per-component times within a decode, without extra syncs (CUDA events; perf_counter on CPU)."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self.samples: dict = {}

    def wrap(self, name: str, fn: Callable) -> Callable:
        def timed(*a, **k):
            if self.cuda:
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                out = fn(*a, **k)
                e.record()
                self.samples.setdefault(name, []).append((s, e))
            else:
                t0 = time.perf_counter()
                out = fn(*a, **k)
                self.samples.setdefault(name, []).append(time.perf_counter() - t0)
            return out
        return timed

    def totals_s(self) -> dict:
        if self.cuda:
            torch.cuda.synchronize()
            return {n: sum(s.elapsed_time(e) for s, e in v) / 1e3 for n, v in self.samples.items()}
        return {n: sum(v) for n, v in self.samples.items()}


@contextmanager
def _instrumented(model, timers: _Timers):
    """Time base LM step, residual LM step, local DiT, local encoder and decode-step attention."""
    import torch.nn.functional as F
    saved = []

    def put(obj, attr, name):
        saved.append((obj, attr, obj.__dict__.get(attr)))
        setattr(obj, attr, timers.wrap(name, getattr(obj, attr)))

    put(model.base_lm, "forward_step", "base_lm")
    put(model.residual_lm, "forward_step", "residual_lm")
    put(model.feat_decoder, "forward", "local_dit")
    put(model.feat_encoder, "forward", "local_encoder")
    raw = model.__dict__.get("_feat_encoder_raw")  # the prefill encoder call is not a decode step
    model.__dict__["_feat_encoder_raw"] = functools.partial(type(model.feat_encoder).forward, model.feat_encoder)
    sdpa = F.scaled_dot_product_attention
    timed_sdpa = timers.wrap("lm_attention", sdpa)

    def routed(q, *a, **k):  # decode-step calls (one query) inside the LMs; the DiT/encoder run Lq > 1
        return timed_sdpa(q, *a, **k) if q.dim() == 4 and q.shape[2] == 1 else sdpa(q, *a, **k)

    F.scaled_dot_product_attention = routed
    try:
        yield
    finally:
        F.scaled_dot_product_attention = sdpa
        model.__dict__.pop("_feat_encoder_raw", None)
        if raw is not None:
            model.__dict__["_feat_encoder_raw"] = raw
        for obj, attr, old in reversed(saved):
            if old is None:
                obj.__dict__.pop(attr, None)
            else:
                obj.__dict__[attr] = old


def whole_decode(preset: str = "tiny", *, steps: int = 12, dtype="bfloat16", device="cpu", seed: int = 0,
                 text: str = "The quick brown fox jumps over the lazy dog.", inference_timesteps: int = 10,
                 repeats: int = 2, mode: str = "exact", model=None, progress: bool = True) -> dict:
    """A VoxCPM2 ``generate()`` of ``steps`` decode steps, upstream vs patched, alternating, ``repeats`` each.

    Each run is split into base LM, residual LM, local DiT, local encoder, the
    decode-step attention inside the LMs (``lm_attention``, part of the two LM
    figures) and the rest (prefill, projections, stop head, VAE decode).
    ``identical`` says whether the patched waveform is ``torch.equal`` to upstream's.
    """
    from .models import build_voxcpm2, silence_progress
    from .patch import cache_bytes, patch_voxcpm
    device = resolve_device(device)
    model = model or build_voxcpm2(preset, seed=seed, device=str(device), dtype=dtype)
    silence_progress()
    runs, wav = [], {}
    order = ["upstream", "patched"]
    for r in _progress(range(repeats), progress, "whole decode"):
        for variant in (order if r % 2 == 0 else order[::-1]):
            timers = _Timers(device)
            handle = patch_voxcpm(model, mode=mode) if variant == "patched" else None
            try:
                with _instrumented(model, timers):
                    torch.manual_seed(seed)
                    _sync(device)
                    t0 = time.perf_counter()
                    out = model.generate(text, min_len=steps, max_len=steps, inference_timesteps=inference_timesteps)
                    _sync(device)
                    wall = time.perf_counter() - t0
                kv = cache_bytes(model)["total"]
                n_steps = model.base_lm.kv_cache.current_length
            finally:
                if handle is not None:
                    handle.revert()
            parts = timers.totals_s()
            comp = {k: parts.get(k, 0.0) for k in ("base_lm", "residual_lm", "local_dit", "local_encoder")}
            runs.append({"variant": variant, "repeat": r, "wall_s": wall, **{f"{k}_s": v for k, v in comp.items()},
                         "lm_attention_s": parts.get("lm_attention", 0.0),
                         "rest_s": wall - sum(comp.values()), "kv_bytes": kv, "final_length": n_steps})
            wav.setdefault(variant, out)
    identical = bool(torch.equal(wav["upstream"], wav["patched"]))
    med = {v: statistics.median(x["wall_s"] for x in runs if x["variant"] == v) for v in order}
    return {"kind": "whole_decode", "env": env_record(device, dtype),
            "params": {"preset": preset, "steps": steps, "dtype": dtype, "text": text, "mode": mode,
                       "inference_timesteps": inference_timesteps, "repeats": repeats,
                       "weights": getattr(model, "fastattn_info", {}).get("weights", "random")},
            "rows": runs, "identical": identical, "median_wall_s": med, "ratio": med["patched"] / med["upstream"]}


# --------------------------------------------------------------------------- memory
def kv_memory(preset: str = "full", *, prefill: int = 100, steps: int = 200, dtype="bfloat16",
              max_length: int = 8192, bucket: Optional[int] = None) -> dict:
    """KV bytes of one request, both LMs, upstream (max_length slots) vs patched (right-sized), from the config
    and the cache's sizing policy (granularity ``bucket``, default the CPU flash kernel's 512-key block)."""
    from .cache import fill_capacity, step_capacity
    from .exactness import CPU_FLASH_KEY_BLOCK
    from .models import voxcpm2_config
    cfg = voxcpm2_config(preset)
    lm = cfg["lm_config"]
    layers = lm["num_hidden_layers"] + cfg["residual_lm_num_layers"]
    per_slot = 2 * layers * lm["num_key_value_heads"] * lm["kv_channels"] * _dtype(dtype).itemsize
    g = bucket or CPU_FLASH_KEY_BLOCK
    slots = fill_capacity(prefill, 0, g, max_length)
    for pos in range(prefill, min(prefill + steps, max_length)):
        slots = step_capacity(pos, slots, g, max_length)
    return {"kind": "kv_memory", "params": {"preset": preset, "prefill": prefill, "steps": steps, "dtype": dtype,
                                            "max_length": max_length, "bucket": g, "layers": layers},
            "per_token_bytes": per_slot, "upstream_bytes": per_slot * max_length, "patched_bytes": per_slot * slots,
            "ratio": slots / max_length}


def step_allocations(*, preset: str = "small", layers: int = 1, dtype="float32", position: int = 256,
                     device="cpu", max_length: int = 8192) -> dict:
    """Bytes allocated by one decode step (profiler ``profile_memory``), upstream vs patched."""
    from torch.profiler import ProfilerActivity, profile
    from .backends import _quiet_native_stderr
    from .patch import original_functions, swapped, variant_functions
    device, dt = resolve_device(device), _dtype(dtype)
    lm, cfg, D, caches = _lm_and_caches(preset, layers, dt, device, max_length, 256, 0)
    g = torch.Generator().manual_seed(1)
    _start_request(caches, _prefill(cfg, D, position, g, device, dt), position)
    x = torch.randn(1, cfg.hidden_size, generator=g).to(device=device, dtype=dt)
    pos = torch.tensor([position], device=device)
    out = {}
    for name, fns in (("upstream", original_functions()), ("patched", variant_functions("exact"))):
        cache = caches[name]
        lm.kv_cache = cache
        with swapped(fns), torch.inference_mode():
            lm.forward_step(x, pos)  # warm
            with _quiet_native_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                lm.forward_step(x, pos)
        allocs = [e for e in prof.events() if e.cpu_memory_usage > 0]
        out[name] = {"allocated_bytes": sum(e.cpu_memory_usage for e in allocs), "allocations": len(allocs),
                     "largest": sorted(((e.name, e.cpu_memory_usage) for e in allocs), key=lambda t: -t[1])[:5],
                     "cache_bytes": cache.nbytes if hasattr(cache, "nbytes") else
                     cache.kv_cache.numel() * cache.kv_cache.element_size()}
    return {"kind": "step_allocations", "env": env_record(device, dt),
            "params": {"preset": preset, "layers": layers, "dtype": dtype, "position": position},
            "variants": out}


def fill_cost(preset: str = "full", *, prefill: int = 100, dtype="bfloat16", device="cpu", max_length: int = 8192,
              repeats: int = 5, warmup: int = 1) -> dict:
    """Per-request cost of starting a request's cache (``fill_caches``) for the preset's base LM geometry:
    upstream zeroes all ``max_length`` slots, the right-sized cache only what the request uses. Interleaved."""
    from voxcpm.modules.minicpm4.cache import StaticKVCache
    from .cache import RightSizedKVCache
    from .models import voxcpm2_config
    device, dt = resolve_device(device), _dtype(dtype)
    lm = voxcpm2_config(preset)["lm_config"]
    geo = (lm["num_hidden_layers"], lm["num_key_value_heads"], lm["kv_channels"], 1, device, dt)
    caches = {"upstream": StaticKVCache(*geo, max_length=max_length),
              "patched": RightSizedKVCache(*geo, max_length=max_length)}  # the CPU kernel's 512-slot granularity
    kv = [(torch.randn(1, geo[1], prefill, geo[2], dtype=dt, device=device),) * 2 for _ in range(geo[0])]
    times = time_interleaved({n: (lambda c=c: c.fill_caches(kv)) for n, c in caches.items()}, repeats=repeats,
                             warmup=warmup, device=device)
    rows = [{"variant": n, **_stats_ms(times[n]),
             "cache_bytes": c.nbytes if hasattr(c, "nbytes") else c.kv_cache.numel() * c.kv_cache.element_size()}
            for n, c in caches.items()]
    return {"kind": "fill_cost", "env": env_record(device, dt),
            "params": {"preset": preset, "layers": geo[0], "prefill": prefill, "dtype": str(dt).replace("torch.", ""),
                       "max_length": max_length}, "rows": rows}


def cache_growth(preset: str = "full", *, prefill: int = 100, steps: int = 8000, dtype="bfloat16", device="cpu",
                 max_length: int = 8192, bucket: Optional[int] = None) -> dict:
    """Cost of a long request's cache growth at the preset's base-LM geometry: every ``step()`` of a
    :class:`RightSizedKVCache` timed (prefill ``prefill``, ``steps`` steps), beside upstream's per-request
    zero-fill of its ``max_length`` slots. Rows: the steps that moved the storage (position, ms, capacity);
    summary: total seconds in ``step()``, moves, the largest step, and the capacity bound checked at every step."""
    from voxcpm.modules.minicpm4.cache import StaticKVCache
    from .cache import RightSizedKVCache
    from .exactness import CPU_FLASH_KEY_BLOCK
    from .models import voxcpm2_config
    device, dt = resolve_device(device), _dtype(dtype)
    lm = voxcpm2_config(preset)["lm_config"]
    geo = (lm["num_hidden_layers"], lm["num_key_value_heads"], lm["kv_channels"], 1, device, dt)
    g = bucket or CPU_FLASH_KEY_BLOCK
    cache = RightSizedKVCache(*geo, max_length=max_length, bucket=g)
    kv = [(torch.randn(1, geo[1], prefill, geo[2], dtype=dt, device=device),) * 2 for _ in range(geo[0])]
    cache.fill_caches(kv)
    total, moves, worst, bound_ok = 0.0, [], 0.0, True
    for _ in range(min(steps, max_length - prefill)):
        gen = cache.generation
        t0 = time.perf_counter()
        pos = cache.step()
        _sync(device)
        dt_s = time.perf_counter() - t0
        total, worst = total + dt_s, max(worst, dt_s)
        bound_ok &= cache.capacity <= min(max(2 * cache.current_length, g), max_length)
        if cache.generation != gen:
            moves.append({"position": pos, "ms": dt_s * 1e3, "capacity": cache.capacity})
    up = StaticKVCache(*geo, max_length=max_length)
    fill = time_interleaved({"upstream": lambda: up.fill_caches(kv)}, repeats=5, warmup=1, device=device)["upstream"]
    return {"kind": "cache_growth", "env": env_record(device, dt),
            "params": {"preset": preset, "layers": geo[0], "prefill": prefill, "steps": steps, "granularity": g,
                       "dtype": str(dt).replace("torch.", ""), "max_length": max_length},
            "rows": moves,
            "summary": {"step_total_s": total, "moves": len(moves), "max_step_ms": worst * 1e3,
                        "bound_held_every_step": bool(bound_ok), "final_capacity": cache.capacity,
                        "upstream_fill_ms": statistics.median(fill) * 1e3}}


_RSS_SCRIPT = """
import sys, torch, fastattn
from fastattn.models import build_voxcpm2, silence_progress
from fastattn.patch import patch_voxcpm
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
preset, dtype, variant, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
m = build_voxcpm2(preset, dtype=dtype)
silence_progress()
if variant == "patched":
    patch_voxcpm(m)
torch.manual_seed(0)
m.generate("Warm up.", min_len=2, max_len=2, inference_timesteps=2)  # first-touch costs out of the way
built = status("VmRSS:")
with open("/proc/self/clear_refs", "w") as f:  # reset the high-water mark (VmHWM) to the current RSS
    f.write("5")
torch.manual_seed(0)
m.generate("The quick brown fox jumps over the lazy dog.", min_len=steps, max_len=steps, inference_timesteps=2)
print(built, status("VmHWM:"))
"""


def peak_rss(preset: str = "small", *, dtype="bfloat16", steps: int = 20) -> dict:
    """Peak RSS of one short request above the model's resting RSS, upstream vs patched, each in a fresh
    process (Linux: the high-water mark is reset after building and a warm-up request)."""
    out = {}
    for variant in ("upstream", "patched"):
        r = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, preset, dtype, variant, str(steps)],
                           capture_output=True, text=True, timeout=1200)
        if r.returncode != 0:
            raise RuntimeError(f"peak_rss {variant} failed: {r.stderr[-2000:]}")
        built, peak = map(int, r.stdout.split()[-2:])
        out[variant] = {"resting_bytes": built, "peak_bytes": peak, "request_bytes": peak - built}
    return {"kind": "peak_rss", "params": {"preset": preset, "dtype": dtype, "steps": steps}, "variants": out}


# --------------------------------------------------------------------------- records
def save_record(record: dict, out_dir, name: Optional[str] = None) -> Path:
    """Write ``record`` as JSON (and its rows as CSV) under a fresh name; never overwrites."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    env = record.get("env", {})
    stem = name or "-".join(str(x) for x in (record.get("kind", "record"), env.get("device", ""),
                                             (env.get("dtype") or "")) if x).replace(":", "")
    path = out_dir / f"{stem}.json"
    i = 1
    while path.exists() or path.with_suffix(".csv").exists():
        i += 1
        path = out_dir / f"{stem}-{i}.json"
    path.write_text(json.dumps(record, indent=1, default=str))
    rows = record.get("rows")
    if rows and isinstance(rows, list) and isinstance(rows[0], dict):
        keys = list(dict.fromkeys(k for r in rows for k in r if not isinstance(r[k], (dict, list))))
        with path.with_suffix(".csv").open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
            w.writeheader()
            w.writerows(rows)
    return path


def load_record(path) -> dict:
    return json.loads(Path(path).read_text())


# --------------------------------------------------------------------------- targets
def _row(rows, **match):
    return next((r for r in rows if all(r.get(k) == v for k, v in match.items())), None)


def check_targets(records: dict) -> list[dict]:
    """The workbook's targets, judged from records: ``[{target, measured, goal, passed}]``.

    ``records`` maps names to records: ``attention_fp32`` (attention sweep,
    capacity 8192), ``decode_bf16`` / ``decode_fp32`` (decode-step sweeps),
    ``kv`` (kv_memory), ``whole`` (whole_decode). Missing records are skipped.
    """
    out = []

    def add(target, measured, goal, passed, note=""):
        out.append({"target": target, "measured": measured, "goal": goal, "passed": bool(passed), "note": note})

    att = records.get("attention_fp32")
    if att:
        ref, ex, fa = (_row(att["rows"], mode=m, position=256) for m in ("reference", "exact", "fast"))
        if ref and ex and fa:
            add("attention p=256, cap 8192, fp32: exact / reference", ex["median_ms"] / ref["median_ms"], "<= 0.10",
                ex["median_ms"] / ref["median_ms"] <= 0.10)
            add("attention p=256, cap 8192, fp32: fast / reference", fa["median_ms"] / ref["median_ms"], "<= 0.05",
                fa["median_ms"] / ref["median_ms"] <= 0.05)
        far = [r for r in att["rows"] if r["mode"] == "fast" and r["position"] >= 1024]
        if far:
            worst = max(r["x_floor"] for r in far)
            cached = [r["position"] for r in far if not r["floor_meaningful"]]
            add("fast attention at p >= 1024: time / bandwidth floor (worst)", worst, "<= 3", worst <= 3,
                f"live K/V fit in the last-level cache at positions {cached}: the DRAM floor does not bind there"
                if cached else "")
    for key, goal in (("attention_fp32", 0.75), ("attention_bf16", 0.20)):
        rec = records.get(key)
        dtname = key.split("_")[1].replace("fp32", "float32").replace("bf16", "bfloat16")
        for p in (2048, 4096) if rec else ():
            fa, sl = _row(rec["rows"], mode="fast", position=p), _row(rec["rows"], mode="slice_fix", position=p)
            if fa and sl:
                r = fa["median_ms"] / sl["median_ms"]
                add(f"attention p={p}, {dtname}: fast / slice fix (seed 000)", r, f"<= {goal}",
                    r <= goal, "fast chose " + ", ".join(c["winner"] for c in rec.get("fast_choice", [])))
        errs = [(_row(rec["rows"], mode="fast", position=p), _row(rec["rows"], mode="reference", position=p))
                for p in sorted({r["position"] for r in rec["rows"]})] if rec else []
        errs = [(f["max_err_f64"], r["max_err_f64"]) for f, r in errs if f and r and "max_err_f64" in f]
        if errs:
            worst = max(f / r if r else (0.0 if f == 0 else float("inf")) for f, r in errs)
            add(f"attention {dtname}: fast's error vs float64 / reference's (worst position)",
                worst, "<= 2", worst <= 2)
    att = records.get("attention_fp32")
    fa = _row(att["rows"], mode="fast", position=4096) if att else None
    if fa:
        add("attention p=4096, fp32: fast / DRAM floor (live K+V once)", fa["x_floor"], "<= 2.5", fa["x_floor"] <= 2.5,
            "" if fa["floor_meaningful"] else "live K/V fit in the last-level cache: the DRAM floor does not bind")
    growth = records.get("growth")
    if growth:
        gs, gp = growth["summary"], growth["params"]
        what = f"{gp['prefill']} + {gp['steps']}-step request, {gp['preset']} base LM, {gp['dtype']}"
        add(f"cache growth ({what}): total time in step(), s", gs["step_total_s"], "<= 0.2", gs["step_total_s"] <= 0.2,
            f"upstream zero-fills {gp['max_length']} slots per request instead: {gs['upstream_fill_ms']:.1f} ms")
        add(f"cache growth ({what}): storage moves", gs["moves"], "<= 6", gs["moves"] <= 6)
        add("cache capacity <= max(2 x live length, granularity) at every step", gs["bound_held_every_step"], "True",
            gs["bound_held_every_step"])
    for key, goal in (("decode_bf16", 0.4), ("decode_fp32", 0.85)):
        rec = records.get(key)
        if rec:
            up, pa = _row(rec["rows"], variant="upstream", position=256), _row(rec["rows"], variant="patched", position=256)
            if up and pa:
                r = pa["median_ms"] / up["median_ms"]
                add(f"decode step p=256 ({rec['params']['dtype']}, hidden {rec['params']['hidden']}): patched / upstream",
                    r, f"<= {goal}", r <= goal)
    kv = records.get("kv")
    if kv:
        add(f"KV of a {kv['params']['prefill'] + kv['params']['steps']}-token request: patched / upstream",
            kv["ratio"], "<= 0.10", kv["ratio"] <= 0.10)
    whole = records.get("whole")
    if whole:
        up = [r for r in whole["rows"] if r["variant"] == "upstream"]
        wall = statistics.median(r["wall_s"] for r in up)
        att = statistics.median(r["lm_attention_s"] for r in up)
        dit = statistics.median(r["local_dit_s"] for r in up)
        bound = (wall - att) / wall
        note = (f"Amdahl: upstream's LM decode attention is {att / wall:.0%} of its wall time and the local DiT "
                f"{dit / wall:.0%}; removing all attention time alone would leave about {bound:.2f}. The target "
                "needs attention to be over half of a step, which it is not on this device" if bound > 0.5 else "")
        add(f"whole decode ({whole['params']['preset']}, {whole['params']['dtype']}, {whole['params']['steps']} steps): "
            "patched / upstream wall", whole["ratio"], "<= 0.50", whole["ratio"] <= 0.5, note)
        add("whole decode output bit-identical", whole["identical"], "True", whole["identical"])
    return out


def headline(att: dict, dec: dict, whole: dict, targets: list, position: int = 256) -> dict:
    """The profiling notebook's findings, read from its records: ratios at ``position``, the whole-decode
    ratio and identity, the LMs' decode-attention share of wall time, and how many targets were met."""
    def at(rec, key, value):
        row = _row(rec["rows"], **{key: value, "position": position})
        return row["median_ms"] if row else float("nan")

    a, d16, d32 = att["float32"], dec["bfloat16"], dec["float32"]
    share = {v: sum(r["lm_attention_s"] for r in whole["rows"] if r["variant"] == v) /
             sum(r["wall_s"] for r in whole["rows"] if r["variant"] == v) for v in ("upstream", "patched")}
    p = whole["params"]
    return {
        f"attention fp32 at p={position}: exact / reference": at(a, "mode", "exact") / at(a, "mode", "reference"),
        f"attention fp32 at p={position}: fast / reference": at(a, "mode", "fast") / at(a, "mode", "reference"),
        f"decode step bf16 at p={position}: patched / upstream": at(d16, "variant", "patched") / at(d16, "variant", "upstream"),
        f"decode step fp32 at p={position}: patched / upstream": at(d32, "variant", "patched") / at(d32, "variant", "upstream"),
        f"whole decode ({p['preset']}, {p['dtype']}, {p['steps']} steps): patched / upstream wall": whole["ratio"],
        "whole decode output bit-identical": whole["identical"],
        "LM decode attention share of wall time (upstream, patched)": f"{share['upstream']:.2f}, {share['patched']:.2f}",
        "targets met": f"{sum(t['passed'] for t in targets)}/{len(targets)}",
    }


def reference_run(out, *, device="cpu", positions=(0, 16, 256, 512, 1024, 2048, 4096, 8000), repeats: int = 7,
                  whole_preset: str = "full", compiled_preset: str = "tiny") -> list[Path]:
    """The reference set this project commits under data/results/: every sweep, the whole decode of the
    ``full`` preset in bf16 (12 steps, 10 DiT steps), memory, the compiled step, and the targets judged."""
    out = Path(out)
    written = []
    bw = bandwidth(device)
    written.append(save_record({"kind": "bandwidth", "env": env_record(device), **bw}, out, "bandwidth"))
    att = {dt: attention_sweep(positions, dtype=dt, device=device, repeats=repeats, bw=bw) for dt in ("float32", "bfloat16")}
    dec = {dt: decode_step_sweep(positions, preset="small", dtype=dt, device=device, repeats=repeats)
           for dt in ("bfloat16", "float32")}
    for dt in att:
        written.append(save_record(att[dt], out, f"attention_{dt}"))
        written.append(save_record(dec[dt], out, f"decode_step_{dt}"))
    kv = kv_memory("full", prefill=100, steps=200, dtype="bfloat16")
    written.append(save_record(kv, out, "kv_memory_full"))
    written.append(save_record(fill_cost("full", device=device), out, "fill_cost_full"))
    growth = cache_growth("full", device=device)
    written.append(save_record(growth, out, "cache_growth_full"))
    written.append(save_record(step_allocations(device=device), out, "step_allocations"))
    written.append(save_record(peak_rss("small", steps=8), out, "peak_rss_small"))
    mode = "reduce-overhead" if str(device).startswith("cuda") else None
    written.append(save_record(compiled_step_sweep(positions[:5], preset=compiled_preset, device=device, mode=mode,
                                                   repeats=repeats), out, f"compiled_step_{compiled_preset}"))
    whole = whole_decode(whole_preset, steps=12, dtype="bfloat16", device=device, inference_timesteps=10, repeats=2)
    written.append(save_record(whole, out, f"whole_decode_{whole_preset}"))
    targets = check_targets({"attention_fp32": att["float32"], "attention_bf16": att["bfloat16"],
                             "decode_bf16": dec["bfloat16"], "decode_fp32": dec["float32"], "kv": kv,
                             "growth": growth, "whole": whole})
    written.append(save_record({"kind": "targets", "env": env_record(device), "rows": targets}, out, "targets"))
    return written


# --------------------------------------------------------------------------- CLI
def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="python -m fastattn bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["attention", "decode-step", "decode", "compiled", "memory", "bandwidth", "all",
                                     "reference"],
                    help="'reference' runs the committed reference set (full preset decode included: ~10 GB peak)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default=None, help="float32 | bfloat16 (default: both for sweeps, bf16 for decode)")
    ap.add_argument("--positions", type=_ints, default=[0, 16, 256, 512, 1024, 2048, 4096, 8000])
    ap.add_argument("--capacity", type=int, default=8192)
    ap.add_argument("--preset", default=None, help="model preset (decode-step: small; decode: tiny)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=None, help="output folder (default: reports/bench-<UTC time>)")
    args = ap.parse_args(argv)
    device = resolve_device(args.device)
    if args.what == "reference":
        out = Path(args.out) if args.out else Path("reports") / f"reference-{datetime.now(timezone.utc):%Y%m%dT%H%M%SZ}"
        for p in reference_run(out, device=str(device), positions=args.positions, repeats=args.repeats):
            print(p)
        return 0
    out = Path(args.out) if args.out else Path("reports") / f"bench-{datetime.now(timezone.utc):%Y%m%dT%H%M%SZ}"
    dtypes = [args.dtype] if args.dtype else ["float32", "bfloat16"]
    written = []
    bw = bandwidth(device) if args.what in ("attention", "bandwidth", "all") else None
    if bw:
        written.append(save_record({"kind": "bandwidth", "env": env_record(device), **bw}, out))
    if args.what in ("attention", "all"):
        for dt in dtypes:
            written.append(save_record(attention_sweep(args.positions, capacity=args.capacity, dtype=dt, device=device,
                                                       repeats=args.repeats, bw=bw), out))
    if args.what in ("decode-step", "all"):
        for dt in dtypes:
            written.append(save_record(decode_step_sweep(args.positions, preset=args.preset or "small", dtype=dt,
                                                         device=device, repeats=args.repeats), out))
    if args.what in ("decode", "all"):
        written.append(save_record(whole_decode(args.preset or "tiny", steps=args.steps, dtype=args.dtype or "bfloat16",
                                                device=str(device)), out))
    if args.what in ("compiled", "all"):
        written.append(save_record(compiled_step_sweep(args.positions, preset=args.preset or "tiny",
                                                       dtype=args.dtype or "float32", device=device,
                                                       repeats=args.repeats), out))
    if args.what in ("memory", "all"):
        written.append(save_record(kv_memory("full", dtype=args.dtype or "bfloat16"), out, "kv_memory-full"))
        written.append(save_record(step_allocations(device=str(device)), out, "step_allocations"))
    for p in written:
        print(p)
    return 0
