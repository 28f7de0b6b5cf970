"""One attention call per mode at each position, interleaved; what ``fast`` chose and why."""

from __future__ import annotations

import itertools
from typing import Optional, Sequence

import torch

from fastattn import fast as _fast
from fastattn.core import causal_mask, check_positions, f64_attention, random_decode, sdpa
from fastattn.devices import dtype_name, resolve_device
from fastattn.devices import dtype_of as _dtype
from fastattn.exactness import exact_granularity
from fastattn.fast import LENGTH_CLASSES, fast_report, sdpa_slice
from fastattn.modes import MODES, REGISTRY
from fastattn.static import fresh_positions
from fastattn.step import attention_step

from ..machine import cpu_flags
from .floor import bandwidth, floor_binds, floor_ms, live_kv_bytes
from .records import env_record, record
from .timing import progress_bar, stats_ms, time_interleaved


def attention_sweep(positions: Sequence[int], *, capacity: int = 8192, dtype="float32", device="cpu",
                    hq: int = 16, hkv: int = 2, head_dim: int = 128, modes: Sequence[str] = MODES,
                    bucket: Optional[int] = None, repeats: int = 7, warmup: int = 2, seed: int = 0,
                    bw: Optional[dict] = None, slice_fix: bool = True, gemm_floor: bool = True, caches: int = 1,
                    progress: bool = True) -> dict:
    """One ``attention_step`` call per mode at each position (length = position + 1), interleaved. Rows: a timed
    row plus ``mode, position, length, window, max_err_f64, live_bytes, floor_ms, floor_meaningful, x_floor``.
    ``caches`` > 1: rotated over that many caches (36: every layer of both LMs); each row's ``floor_meaningful``
    says whether they outgrow the last-level cache (None: its size unknown);
    ``gemm_floor`` (fp32): the grouped form's two bare GEMMs, the best torch's BLAS does with these bytes."""
    device, dt = resolve_device(device), _dtype(dtype)
    check_positions(positions, capacity, "capacity")
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise ValueError(f"modes must be among {MODES}, got {bad}")
    if not isinstance(caches, int) or caches < 1:
        raise ValueError(f"caches must be an int >= 1 (distinct K/V caches to rotate over), got {caches!r}")
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, hq, 1, head_dim, generator=g).to(device=device, dtype=dt)  # first: cache 0 is the same
    kvs = [(torch.randn(1, hkv, capacity, head_dim, generator=g).to(device=device, dtype=dt),   # for any caches
            torch.randn(1, hkv, capacity, head_dim, generator=g).to(device=device, dtype=dt)) for _ in range(caches)]
    bw = bw or bandwidth(device)
    gran = bucket if bucket is not None else exact_granularity(q.device, dt, hq=hq, hkv=hkv, head_dim=head_dim,
                                                               capacity=capacity)
    fns = _variants(q, modes, bucket, slice_fix, gemm=gemm_floor and dt == torch.float32)
    rows = [row for p in progress_bar(positions, progress, f"attention {dtype}")
            for row in _position_rows(fns, q, kvs, p, device, repeats, warmup, capacity, gran, bw)]
    fast_choice = [c for c in fast_report() if c["dtype"] == dtype_name(dt) and c["length_class"] != "graph"
                   and (c["hq"], c["hkv"], c["head_dim"]) == (hq, hkv, head_dim)]
    params = {"positions": list(positions), "capacity": capacity, "dtype": dtype_name(dt), "hq": hq, "hkv": hkv,
              "head_dim": head_dim, "bucket": bucket, "exact_granularity": gran, "caches": caches,
              "repeats": repeats, "warmup": warmup, "modes": list(fns), "fresh_key_counts": list(FRESH)}
    return record("attention", env=env_record(device, dt), params=params, rows=rows, fast_choice=fast_choice,
                  bandwidth=bw)


#: the variants whose kernel sees the live key count: timed at a fresh count per call, as a decode pays it (a
#: kernel that builds a plan per count, cuDNN's on Hopper, pays that here too)
FRESH = ("slice_fix", "fast")


def _variants(q, modes, bucket, slice_fix: bool, gemm: bool) -> dict:
    """name -> fn(k, v, n) of one call at length ``n`` over full-capacity caches ``k``, ``v``."""
    fns = {m: (lambda k, v, n, m=m: attention_step(q, k, v, n, mode=m, bucket=bucket)) for m in modes}
    if slice_fix:
        fns["slice_fix"] = lambda k, v, n: sdpa_slice(q, k[:, :, :n], v[:, :, :n])
    if gemm:
        def gemms(k, v, n):
            b, hq, _, d = q.shape
            qg = q.reshape(b, k.shape[1], hq // k.shape[1], d)                 # (B, Hkv, G, D)
            s = qg @ k[:, :, :n].transpose(-1, -2)                             # (B, Hkv, G, n)
            return s, s @ v[:, :, :n]  # softmax left out: the same bytes, less work
        fns["gemm_floor"] = gemms
    return fns


def _position_rows(fns, q, kvs, p, device, repeats, warmup, capacity, gran, bw) -> list:
    n, k0, v0 = p + 1, kvs[0][0], kvs[0][1]
    turn = itertools.count()
    walk = [i + 1 for i in fresh_positions(p, warmup + repeats, capacity, device=device, dtype=q.dtype)]

    def timed(m, fn):
        lengths = iter(walk) if m in FRESH else itertools.repeat(n)
        return lambda: fn(*kvs[next(turn) % len(kvs)], next(lengths))
    host: dict = {}
    times = time_interleaved({m: timed(m, fn) for m, fn in fns.items()}, repeats=repeats, warmup=warmup,
                             device=device, host=host)
    r64 = f64_attention(q, k0, v0, n)
    live = live_kv_bytes(n, k0.shape[1], q.shape[3], k0.dtype)
    fl = floor_ms(n, k0.shape[1], q.shape[3], k0.dtype, bw["gb_per_s"])
    binds = floor_binds(live, len(kvs), bw.get("llc_bytes"))
    rows = []
    for m, fn in fns.items():
        st = stats_ms(times[m], host[m])
        window = n if m in ("slice_fix", "gemm_floor") else REGISTRY[m].keys(n, capacity, gran)  # the mode's rule
        err = None if m == "gemm_floor" else (fn(k0, v0, n).double() - r64).abs().max().item()
        rows.append({"mode": m, "position": p, "length": n, "window": window, **st, "max_err_f64": err,
                     "live_bytes": live, "floor_ms": fl, "floor_meaningful": binds,
                     "x_floor": st["median_ms"] / fl})
    return rows


def fast_choices(device="cpu", *, dtypes=("float32", "bfloat16"), hq: int = 16, hkv: int = 2, head_dim: int = 128,
                 seed: int = 0) -> dict:
    """What ``fast`` picks per dtype and key-count class: each candidate's error vs float64, ``reference``'s, time."""
    device = resolve_device(device)
    rows = []
    for name in dtypes:
        for cls in LENGTH_CLASSES:
            ch = _fast.choose_fast(device, _dtype(name), hq=hq, hkv=hkv, head_dim=head_dim, lq=1, length_class=cls,
                                   seed=seed)
            rows += [{"class": f"{name}, {cls}", "dtype": name, **c, "reference_max_err": ch["reference_max_err"],
                      "winner": c["candidate"] == ch["winner"]} for c in ch["candidates"]]
    return record("fast_choice", env=env_record(device),
                  params={"dtypes": list(dtypes), "hq": hq, "hkv": hkv, "head_dim": head_dim,
                          "classes": LENGTH_CLASSES},
                  rows=rows, note="fast mode trades bit-identity for speed: within twice reference's error vs float64")


def dtype_costs(device="cpu", *, length: int = 4096, capacity: int = 8192, hq: int = 16, hkv: int = 2,
                head_dim: int = 128, repeats: int = 9, warmup: int = 2, seed: int = 0) -> dict:
    """Why bf16 attention costs what it does: masked SDPA, sliced SDPA, a bare ``q @ k^T`` and the bf16 -> fp32
    cast of K, in fp32 and bf16, interleaved. Rows ``{op, dtype, median_ms, ...}``; ``ratios``: bf16 / fp32 per op."""
    device = resolve_device(device)
    fns = {}
    for dt in (torch.float32, torch.bfloat16):
        q, k, v = random_decode(device, dt, hq=hq, hkv=hkv, head_dim=head_dim, capacity=capacity, seed=seed)
        m, name = causal_mask(capacity, 1, length, device), dtype_name(dt)
        qg = q.reshape(1, hkv, hq // hkv, head_dim)
        fns[("masked SDPA over the capacity (upstream)", name)] = lambda q=q, k=k, v=v, m=m: sdpa(q, k, v, m)
        fns[("SDPA over the slice", name)] = lambda q=q, k=k, v=v: sdpa_slice(q, k[:, :, :length], v[:, :, :length])
        fns[("bare GEMM q @ k^T", name)] = lambda qg=qg, k=k: qg @ k[:, :, :length].transpose(-1, -2)
        if dt == torch.bfloat16:
            fns[("bf16 -> fp32 conversion of K", name)] = lambda k=k: k[:, :, :length].float()
    host: dict = {}
    times = time_interleaved(fns, repeats=repeats, warmup=warmup, device=device, host=host)
    rows = [{"op": op, "dtype": dt, **stats_ms(times[(op, dt)], host[(op, dt)])} for op, dt in fns]
    ms = {(r["op"], r["dtype"]): r["median_ms"] for r in rows}
    ratios = {op: ms[(op, "bfloat16")] / ms[(op, "float32")] for op, dt in fns if dt == "float32"}
    return record("dtype_costs", env=env_record(device), rows=rows, ratios=ratios,
                  flags=cpu_flags() if device.type == "cpu" else {},
                  params={"length": length, "capacity": capacity, "hq": hq, "hkv": hkv, "head_dim": head_dim,
                          "repeats": repeats})
