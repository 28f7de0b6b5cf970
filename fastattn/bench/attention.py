"""One attention call per mode at each position, interleaved; what ``fast`` chose and why."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..attention import MODES, attention_step
from ..devices import dtype_name, resolve_device
from ..devices import dtype_of as _dtype
from ..modes import REGISTRY
from .floor import bandwidth, floor_ms, live_kv_bytes
from .records import env_record, record
from .timing import _progress, _stats_ms, time_interleaved


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
    from ..attention import f64_attention
    from ..fast import fast_report, sdpa_slice

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
    g = _granularity_of(q, k, bucket)
    rows = []
    for p in _progress(positions, progress, f"attention {dtype}"):
        n = p + 1
        fns = {m: (lambda m=m, n=n: attention_step(q, k, v, n, mode=m, bucket=bucket)) for m in modes}
        if slice_fix:
            fns["slice_fix"] = lambda n=n: sdpa_slice(q, k[:, :, :n], v[:, :, :n])
        times = time_interleaved(fns, repeats=repeats, warmup=warmup, device=device)
        r64 = f64_attention(q, k, v, n)
        live = live_kv_bytes(n, hkv, head_dim, dt)
        fl = floor_ms(n, hkv, head_dim, dt, bw["gb_per_s"])
        for m in variants:
            st = _stats_ms(times[m])
            window = n if m == "slice_fix" else REGISTRY[m].keys(n, capacity, g)  # the mode's own rule
            rows.append({"mode": m, "position": p, "length": n, "window": window, **st,
                         "max_err_f64": (fns[m]().double() - r64).abs().max().item(),
                         "live_bytes": live, "floor_ms": fl, "floor_meaningful": live > llc,
                         "x_floor": st["median_ms"] / fl})
    fast_choice = [c for c in fast_report() if c["dtype"] == dtype_name(dt)
                   and (c["hq"], c["hkv"], c["head_dim"]) == (hq, hkv, head_dim)]
    params = {"positions": list(positions), "capacity": capacity, "dtype": dtype_name(dt), "hq": hq, "hkv": hkv,
              "head_dim": head_dim, "bucket": bucket, "exact_granularity": g,
              "repeats": repeats, "warmup": warmup, "modes": variants}
    return record("attention", env=env_record(device, dt), params=params, rows=rows, fast_choice=fast_choice,
                  bandwidth=bw)


def fast_choices(device="cpu", *, dtypes=("float32", "bfloat16"), hq: int = 16, hkv: int = 2, head_dim: int = 128,
                 seed: int = 0) -> dict:
    """What ``fast`` picks on this device for each dtype and key-count class, and why: every candidate's
    error vs float64, ``reference``'s error on the same data, whether it was accepted, its median time."""
    from ..fast import LENGTH_CLASSES, choose_fast
    device = resolve_device(device)
    rows = []
    for name in dtypes:
        for cls in LENGTH_CLASSES:
            ch = choose_fast(device, _dtype(name), hq=hq, hkv=hkv, head_dim=head_dim, lq=1, length_class=cls, seed=seed)
            rows += [{"class": f"{name}, {cls}", "dtype": name, **c, "reference_max_err": ch["reference_max_err"],
                      "winner": c["candidate"] == ch["winner"]} for c in ch["candidates"]]
    return record("fast_choice", env=env_record(device),
                  params={"dtypes": list(dtypes), "hq": hq, "hkv": hkv, "head_dim": head_dim,
                          "classes": LENGTH_CLASSES},
                  rows=rows, note="fast mode trades bit-identity for speed: within twice reference's error vs float64")


def _granularity_of(q, k, bucket):
    """The window granularity ``exact`` used: the int bucket, the calibrated one, or None (whole cache)."""
    from ..exactness import exact_granularity
    return bucket if bucket is not None else exact_granularity(
        q.device, q.dtype, hq=q.shape[1], hkv=k.shape[1], head_dim=q.shape[3], capacity=k.shape[2], lq=q.shape[2])
