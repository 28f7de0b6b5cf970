"""Which key windows keep upstream's bits: by construction, confirmed by measurement (docs/design.md, "Exactness").

A window that is a multiple of the kernel's key block hands it the same blocks as the full call; others reorder sums."""

from __future__ import annotations

import threading
import time
import warnings
from typing import Optional

import torch
import torch.nn.functional as F

from .core import capturing_or_compiling, causal_mask, check_bucket, check_positive_int, host_length, sdpa, window_for
from .devices import device_key, dtype_name

#: torch's CPU flash-attention kernel walks keys in blocks of this many (kvSplitSize, every qSize).
CPU_FLASH_KEY_BLOCK = 512

_LOCK = threading.RLock()
_CALIBRATIONS: dict = {}   # geometry key -> calibration dict
_SELF_CHECKS: dict = {}    # (int-bucket) self-check key -> check_exactness dict
_WARNED: set = set()


# --------------------------------------------------------------------------- which kernel, which block
def kernel_key_block(device, dtype, *, hq: int, hkv: int, head_dim: int, lq: int = 1) -> tuple:
    """``(key_block, kernel)``: SDPA's kernel for upstream's call, and the key block making windows exact (or None)."""
    device = torch.device(device)
    if device.type == "meta":
        return None, "meta (no kernel runs)"
    n = max(lq, 16)
    q = torch.zeros(1, hq, lq, head_dim, device=device, dtype=dtype)
    k = torch.zeros(1, hkv, n, head_dim, device=device, dtype=dtype)
    mask = torch.ones(1, 1, lq, n, device=device, dtype=torch.bool)
    try:
        from torch.nn.attention import SDPBackend

        kernel = SDPBackend(torch._fused_sdp_choice(q, k, k, mask, 0.0, False, scale=None, enable_gqa=True)).name
    except Exception as exc:  # noqa: BLE001 - an unknown dispatcher means no construction argument
        return None, f"unknown ({type(exc).__name__})"
    if device.type == "cpu" and kernel == "FLASH_ATTENTION":
        return CPU_FLASH_KEY_BLOCK, "cpu FLASH_ATTENTION"
    return None, f"{device.type} {kernel}"


def _candidates(block: Optional[int], capacity: int, exhaustive: bool) -> list:
    """Powers of two from the key block below capacity; ``exhaustive`` prepends the (ineligible) half block."""
    base = block or CPU_FLASH_KEY_BLOCK
    out, c = [], base // 2 if exhaustive else base
    while c < capacity:
        out.append(c)
        c *= 2
    return out


# --------------------------------------------------------------------------- calibration
@torch.no_grad()
def calibrate_exact(device, dtype, *, hq: int, hkv: int, head_dim: int, capacity: int, lq: int = 1,
                    draws: int = 3, seed: int = 0, exhaustive: bool = True) -> dict:
    """Measure which window bucket keeps ``exact`` bit-identical (``torch.equal``) to the full-capacity call for this
    geometry, over ``draws`` random batches; ``exhaustive=False`` (first use) stops at the first eligible identical one.
    ``bucket`` is None where no window is exact. Bad geometry or ``draws``: ValueError."""
    for name, value in (("hq", hq), ("hkv", hkv), ("head_dim", head_dim), ("capacity", capacity), ("lq", lq)):
        check_positive_int(value, name)
    if hq % hkv:
        raise ValueError(f"hq ({hq}) must be a multiple of hkv ({hkv})")
    if lq > capacity:
        raise ValueError(f"lq ({lq}) must not exceed capacity ({capacity})")
    check_positive_int(draws, "draws")
    device, t0 = torch.device(device), time.perf_counter()
    block, kernel = kernel_key_block(device, dtype, hq=hq, hkv=hkv, head_dim=head_dim, lq=lq)
    cands = _candidates(block, capacity, exhaustive)
    # Lengths e-1, e, e+1 at each edge of the finest candidate (e+1 opens a block with one live key); lean checks
    # need only the key block's edges, where every eligible window ends.
    step = min(cands) if exhaustive and cands else (block or (min(cands) if cands else capacity))
    picks = {lq, lq + 1, capacity} | {e + d for e in range(step, capacity + 1, step) for d in (-1, 0, 1)}
    lengths = sorted(n for n in picks if lq <= n <= capacity)
    ladder = [{"candidate": c, "eligible": bool(block and c % block == 0),
               "reason": (f"multiple of the {kernel} key block ({block})" if block and c % block == 0 else
                          f"not a multiple of the {kernel} key block ({block})" if block else
                          f"{kernel}: no key-block argument, only the full capacity is exact by construction"),
               "measured": False, "bit_identical": None, "max_abs_diff": None, "lengths_checked": 0,
               "draws": draws, "first_diff_length": None} for c in cands]
    if device.type != "meta" and ladder:
        _measure(ladder, lengths, device, dtype, hq, hkv, head_dim, capacity, lq, draws, seed, exhaustive)
    chosen = next((r["candidate"] for r in ladder if r["eligible"] and r["bit_identical"]), None)
    return {"device": device_key(device), "dtype": dtype_name(dtype), "hq": hq, "hkv": hkv, "head_dim": head_dim,
            "capacity": capacity, "lq": lq, "draws": draws, "threads": torch.get_num_threads(),
            "kernel": kernel, "key_block": block, "bucket": chosen, "ladder": ladder,
            "lengths": len(lengths), "exhaustive": exhaustive, "torch": torch.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "seconds": round(time.perf_counter() - t0, 3)}


def _measure(ladder, lengths, device, dtype, hq, hkv, head_dim, capacity, lq, draws, seed, exhaustive) -> None:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    k = torch.randn(draws, hkv, capacity, head_dim, generator=gen).to(device=device, dtype=dtype)
    v = torch.randn(draws, hkv, capacity, head_dim, generator=gen).to(device=device, dtype=dtype)
    qs = [torch.randn(draws, hq, lq, head_dim, generator=gen).to(device=device, dtype=dtype) for _ in lengths]
    refs: dict = {}
    for row in sorted(ladder, key=lambda r: (not r["eligible"], r["candidate"])):
        if not exhaustive and not row["eligible"]:
            continue
        row["measured"], worst = True, 0.0
        for j, n in enumerate(lengths):
            w = window_for(n, capacity, row["candidate"])
            if j not in refs:
                refs[j] = sdpa(qs[j], k, v, causal_mask(capacity, qs[j].shape[2], n, k.device))
            row["lengths_checked"] += 1
            if w == capacity:
                continue  # the same call as the reference
            out = sdpa(qs[j], k[:, :, :w], v[:, :, :w], causal_mask(w, qs[j].shape[2], n, k.device))
            if not torch.equal(out, refs[j]):
                worst = max(worst, (out.double() - refs[j].double()).abs().max().item())
                row["first_diff_length"] = row["first_diff_length"] or n
                if not exhaustive:
                    break
        row["bit_identical"], row["max_abs_diff"] = row["first_diff_length"] is None, worst
        if not exhaustive and row["eligible"] and row["bit_identical"]:
            return


# --------------------------------------------------------------------------- an explicit int bucket
def self_check_once(q: torch.Tensor, k_cache: torch.Tensor, bucket: int) -> None:
    if bucket < k_cache.shape[2]:  # a bucket at or above capacity always windows the whole cache: upstream's call
        check_bucket_once(q.device, q.dtype, hq=q.shape[1], hkv=k_cache.shape[1], head_dim=q.shape[3], bucket=bucket)


def check_bucket_once(device, dtype, *, hq: int, hkv: int, head_dim: int, bucket: int,
                      capacity: Optional[int] = None) -> None:
    """Check an int bucket once per geometry and capacity (the patch's: ``max_length``); warns if not bit-identical."""
    device = torch.device(device)
    if capturing_or_compiling() or device.type == "meta" or (capacity is not None and bucket >= capacity):
        return
    key = (device_key(device), dtype_name(dtype), hq, hkv, head_dim, bucket, capacity)
    if key in _SELF_CHECKS:
        return
    with _LOCK:
        if key in _SELF_CHECKS:
            return
        result = check_exactness(device, dtype, hq=hq, hkv=hkv, head_dim=head_dim, bucket=bucket, capacity=capacity)
        _SELF_CHECKS[key] = result
    if not result["bit_identical"]:
        warnings.warn(
            "fastattn: mode='exact' is NOT bit-identical to mode='reference' on "
            f"{key[0]} {key[1]} (Hq={hq}, Hkv={hkv}, D={head_dim}, bucket={bucket}): "
            f"max |diff| {result['max_abs_diff']:.3g} over {result['positions_checked']} positions "
            f"(first differing position {result['first_diff_position']}). Results stay within rounding; "
            "use bucket=None (calibrated) or mode='reference' where bits must match upstream.",
            RuntimeWarning,
            stacklevel=4,
        )


@torch.no_grad()
def check_exactness(device, dtype, *, hq: int = 16, hkv: int = 2, head_dim: int = 128, bucket: int = 256,
                    capacity: Optional[int] = None, positions=None, seed: int = 0) -> dict:
    """Int-``bucket`` ``exact`` vs ``reference`` on one draw at bucket edges: weaker than :func:`calibrate_exact`."""
    check_bucket(bucket)
    device = torch.device(device)
    capacity = capacity or 4 * bucket
    if capacity > 1 << 20:
        raise ValueError(f"bucket={bucket} (capacity {capacity}): the self-check would allocate a {capacity}-slot "
                         f"cache; expected a capacity of at most {1 << 20} slots (a window never exceeds the cache)")
    if positions is None:
        positions = sorted({0, 1, 15, 16, bucket - 1, bucket, bucket + 1, 2 * bucket + 7, 3 * bucket - 1, capacity - 1})
    positions = [p for p in positions if 0 <= p < capacity]
    gen = torch.Generator(device="cpu").manual_seed(seed)
    k = torch.randn(1, hkv, capacity, head_dim, generator=gen).to(device=device, dtype=dtype)
    v = torch.randn(1, hkv, capacity, head_dim, generator=gen).to(device=device, dtype=dtype)
    max_diff, first = 0.0, None
    for p in positions:
        q = torch.randn(1, hq, 1, head_dim, generator=gen).to(device=device, dtype=dtype)
        ref = sdpa(q, k, v, causal_mask(capacity, 1, p + 1, device))
        w = window_for(p + 1, capacity, bucket)
        ex = sdpa(q, k[:, :, :w], v[:, :, :w], causal_mask(w, 1, p + 1, device))
        if not torch.equal(ref, ex):
            d = (ref.double() - ex.double()).abs().max().item()
            max_diff = max(max_diff, d)
            first = p if first is None else first
    return {"device": str(device), "dtype": dtype_name(dtype), "hq": hq, "hkv": hkv, "head_dim": head_dim,
            "bucket": bucket, "capacity": capacity, "bit_identical": first is None, "max_abs_diff": max_diff,
            "positions_checked": len(positions), "first_diff_position": first, "torch": torch.__version__}


# --------------------------------------------------------------------------- the cached choice
def exact_granularity(device, dtype, *, hq: int, hkv: int, head_dim: int, capacity: int, lq: int = 1) -> Optional[int]:
    """The calibrated bucket (calibrated at first use, not under compile or capture), or None: the whole capacity."""
    key = (device_key(torch.device(device)), dtype_name(dtype), hq, hkv, head_dim, capacity, lq,
           torch.get_num_threads(), id(F.scaled_dot_product_attention))
    hit = _CALIBRATIONS.get(key)
    if hit is not None:
        return hit["bucket"]
    if capturing_or_compiling():
        return None
    with _LOCK:
        if key not in _CALIBRATIONS:
            _CALIBRATIONS[key] = calibrate_exact(device, dtype, hq=hq, hkv=hkv, head_dim=head_dim,
                                                 capacity=capacity, lq=lq, exhaustive=False)
        cal = _CALIBRATIONS[key]
    quiet = torch.device(device).type == "meta" or capacity <= 2 * CPU_FLASH_KEY_BLOCK
    if cal["bucket"] is None and not quiet and key[:2] not in _WARNED:
        _WARNED.add(key[:2])
        why = next((r["reason"] for r in cal["ladder"] if not r["eligible"]), "no window was bit-identical")
        warnings.warn(f"fastattn: mode='exact' attends over the whole capacity on {key[0]} {key[1]} "
                      f"({cal['kernel']}): {why}. It stays bit-identical to upstream but is no faster than "
                      "mode='reference' there; mode='fast' is the opt-in speed path.", RuntimeWarning, stacklevel=3)
    return cal["bucket"]


def exact_window(q, k_cache, length, bucket) -> int:
    """``exact``'s key count: the length rounded up to ``bucket`` (None: calibrated), or the capacity where no window is
    exact. A tensor length is read back (a sync on CUDA)."""
    capacity = k_cache.shape[2]
    g = bucket if bucket is not None else exact_granularity(
        q.device, q.dtype, hq=q.shape[1], hkv=k_cache.shape[1], head_dim=q.shape[3], capacity=capacity,
        lq=q.shape[2])
    if g is None or g >= capacity:
        return capacity
    n = length if isinstance(length, int) else host_length(length, q.shape[2], capacity)
    return window_for(n, capacity, g)


def warn_if_unaligned_window(q, k_cache, window: int) -> None:
    """A caller-chosen window must end on a calibrated block edge (or be the capacity) to stay exact."""
    capacity = k_cache.shape[2]
    g = exact_granularity(q.device, q.dtype, hq=q.shape[1], hkv=k_cache.shape[1], head_dim=q.shape[3],
                          capacity=capacity, lq=q.shape[2])
    if window != capacity and (g is None or window % g):
        key = ("window", str(q.device), q.dtype, g)
        if key not in _WARNED:
            _WARNED.add(key)
            warnings.warn(f"fastattn: window={window} is not a multiple of the calibrated exact granularity ({g}) "
                          f"nor the capacity ({capacity}): the result is within rounding of mode='reference', "
                          "not guaranteed bit-identical.", RuntimeWarning, stacklevel=3)


def exactness_report() -> list:
    """Every exactness calibration (``bucket=None``) and int-bucket self-check made in this process."""
    with _LOCK:
        return [dict(v, check="calibration") for v in _CALIBRATIONS.values()] + \
               [dict(v, check="self-check") for v in _SELF_CHECKS.values()]


def reset_exactness_cache() -> None:
    """Forget every calibration and self-check (tests; a new device or driver in a long process)."""
    with _LOCK:
        _CALIBRATIONS.clear()
        _SELF_CHECKS.clear()
        _WARNED.clear()


def calibration_ladders(device="cpu", *, capacity: int = 8192, dtypes=("float32", "bfloat16"), lqs=(1, 5),
                        hq: int = 16, hkv: int = 2, head_dim: int = 128, draws: int = 3) -> list[dict]:
    """The exhaustive ladder, one row per (dtype, lq, candidate); ``chosen``: the bucket default ``exact`` uses."""
    rows = []
    for name in dtypes:
        for lq in lqs:
            cal = calibrate_exact(device, getattr(torch, name), hq=hq, hkv=hkv, head_dim=head_dim,
                                  capacity=capacity, lq=lq, draws=draws, exhaustive=True)
            for r in cal["ladder"]:
                rows.append({"dtype": name, "lq": lq, "candidate": r["candidate"], "eligible": r["eligible"],
                             "bit_identical": r["bit_identical"], "max_abs_diff": r["max_abs_diff"],
                             "lengths": r["lengths_checked"], "draws": r["draws"],
                             "first_diff_length": r["first_diff_length"], "chosen": cal["bucket"],
                             "kernel": cal["kernel"], "seconds": cal["seconds"]})
    return rows
