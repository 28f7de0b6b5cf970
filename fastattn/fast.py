"""``fast`` mode: the fastest decode attention within twice ``reference``'s error vs float64 (docs/design.md).

Chosen by measurement at first use, cached per (device, dtype, heads, head dim, Lq class, key-count class)."""

from __future__ import annotations

import logging
import math
import statistics
import threading
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from .clock import interleaved
from .core import capturing_or_compiling, causal_mask, f64_attention, sdpa
from .devices import device_key, dtype_name
from .static import called_key_counts, choose_graph_form, error_bound

log = logging.getLogger("fastattn")

_LOCK = threading.RLock()
_CHOICES: dict = {}
_LOGGED: set = set()  # (call shape, candidate) already logged as broken


# --------------------------------------------------------------------------- candidates: (q, k, v) over live keys
def _grouped(q, k, v, length=None):
    """The grouped form in float32; a tensor ``length`` masks keys at or past it (Lq = 1), else Lq > 1 is causal."""
    B, hq, lq, D = q.shape
    hkv, n = k.shape[1], k.shape[2]
    g = hq // hkv
    qg = q.reshape(B, hkv, g * lq, D).float()                            # (B, Hkv, G*Lq, D)
    s = (qg @ k.float().transpose(-1, -2)).mul_(1.0 / math.sqrt(D))     # (B, Hkv, G*Lq, n); scaling q
    # first is faster but rounds q once more (measured: further from float64 than reference)
    if length is not None:
        s = s.masked_fill(torch.arange(n, device=q.device) >= length.reshape(-1)[-1:], float("-inf"))  # (n,)
    elif lq > 1:  # row r is query r % Lq, which sees keys <= n - Lq + r % Lq
        last = n - lq + torch.arange(lq, device=q.device).repeat(g)  # (G*Lq,)
        s = s.masked_fill(torch.arange(n, device=q.device).view(1, -1) > last.view(-1, 1), float("-inf"))
    return (s.softmax(-1) @ v.float()).reshape(B, hq, lq, D).to(q.dtype)  # (B, Hkv, G*Lq, D) -> (B, Hq, Lq, D)


def grouped_fp32(q, k, v):
    return _grouped(q, k, v)


def grouped_window(q, k, v, length):
    """Graph-safe ``fast`` for Lq = 1 over a key window, keys at or past ``length`` (a tensor) masked."""
    return _grouped(q, k, v, length)


def sdpa_slice(q, k, v):
    lq, n = q.shape[2], k.shape[2]
    if lq == 1 or lq == n:  # Lq == n: bottom-right == top-left alignment, so is_causal is right here
        return F.scaled_dot_product_attention(q, k, v, is_causal=(lq > 1), enable_gqa=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask(n, lq, n, q.device), enable_gqa=True)


def flash_op(q, k, v):
    """The flash kernel as its aten op (CUDA, half precision): no process-wide SDPA flags, no cuDNN plan per key count.
    Lq > 1 with a causal offset needs a mask flash cannot take: SDPA."""
    lq, n = q.shape[2], k.shape[2]
    if lq not in (1, n):
        return sdpa_slice(q, k, v)
    return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, lq > 1)[0]


def _forced(backend: str) -> Callable:
    def run(q, k, v):
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel([getattr(SDPBackend, backend)]):
            return sdpa_slice(q, k, v)
    run.__name__ = f"sdpa_{backend.split('_')[0].lower()}"
    return run


#: candidates measured for the report but never chosen: they wrap every call in ``sdpa_kernel``, which flips
#: process-wide SDPA flags (unsafe beside other threads' SDPA calls) on the hot path
PROBE_ONLY = frozenset({"sdpa_flash", "sdpa_cudnn", "sdpa_efficient"})

#: name -> (implementation, devices it is tried on)
CANDIDATES: dict = {
    "sdpa_slice": (sdpa_slice, ("cpu", "cuda", "mps")),
    "grouped_fp32": (grouped_fp32, ("cpu", "cuda", "mps")),
    "flash_op": (flash_op, ("cuda",)),
    "sdpa_flash": (_forced("FLASH_ATTENTION"), ("cuda",)),
    "sdpa_cudnn": (_forced("CUDNN_ATTENTION"), ("cuda",)),
    "sdpa_efficient": (_forced("EFFICIENT_ATTENTION"), ("cuda",)),
}


# --------------------------------------------------------------------------- the choice
#: key-count classes, each probed at its own lengths (the winner can differ: per-call overhead vs bandwidth)
LENGTH_CLASSES = {"keys<=512": (128, 512), "keys<=2048": (1024, 2048), "keys>2048": (4096, 8192)}


def _length_class(n: int) -> str:
    """The class of ``LENGTH_CLASSES`` whose largest probe length is the first at or above ``n``."""
    return next((c for c, lengths in LENGTH_CLASSES.items() if n <= max(lengths) and c != "keys>2048"), "keys>2048")


def _key(q, k) -> tuple:
    return (device_key(q.device), dtype_name(q.dtype), q.shape[1], k.shape[1], q.shape[3],
            "lq=1" if q.shape[2] == 1 else "lq>1", _length_class(k.shape[2]))


def _time(fns: dict, q, k, v, lengths: list, device, repeats: int = 7, warmup: int = 2) -> dict:
    """Median seconds per candidate, interleaved, at fresh key counts (a per-count plan is paid, as in a decode)."""
    used = called_key_counts(device, q.dtype)  # the probe's key counts are not fresh for a later sweep (CUDA)

    def run(fn):
        shift = iter(range(1, 1 << 30))
        def call():
            i = next(shift)
            counts = [max(q.shape[2], n - i) for n in lengths]
            if used is not None:
                used.update(counts)
            return [fn(q, k[:, :, :c], v[:, :, :c]) for c in counts]
        return call
    times = interleaved({name: run(fn) for name, fn in fns.items()}, repeats=repeats, warmup=warmup, device=device)
    return {name: statistics.median(t) for name, t in times.items()}


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


@torch.no_grad()
def choose_fast(device, dtype, *, hq: int, hkv: int, head_dim: int, lq: int = 1, length_class: str = "keys>2048",
                candidates: Optional[dict] = None, seed: int = 0) -> dict:
    """Choose ``fast``'s implementation for one call shape. ``fast`` is opt-in and changes bits: a candidate within
    twice ``reference``'s error vs float64 is accepted, then timed at ``length_class``'s lengths; the fastest not in
    :data:`PROBE_ONLY` wins. Returns the shape, ``bound``, ``winner``, ``candidates`` rows; RuntimeError if none
    passes."""
    device = torch.device(device)
    cands = {n: fn for n, (fn, devs) in (candidates or CANDIDATES).items() if device.type in devs}
    if length_class not in LENGTH_CLASSES:
        raise ValueError(f"length_class must be one of {sorted(LENGTH_CLASSES)}, got {length_class!r}")
    lengths = sorted({max(lq, n) for n in LENGTH_CLASSES[length_class]})
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=gen).to(device=device, dtype=dtype)  # noqa: E731
    k, v = rand(1, hkv, max(lengths), head_dim), rand(1, hkv, max(lengths), head_dim)
    q = rand(1, hq, lq, head_dim)
    ref_err = max((sdpa(q, k, v, causal_mask(k.shape[2], lq, n, device)).double()
                   - f64_attention(q, k, v, n)).abs().max().item() for n in lengths)
    scale = max(f64_attention(q, k, v, n).abs().max().item() for n in lengths)
    bound = error_bound(ref_err, scale, dtype)  # twice reference's, floored at a few fp32 ulps (ulp noise)
    rows, ok = [], {}
    for name, fn in cands.items():
        row = {"candidate": name, "max_err": None, "accepted": False, "median_ms": None, "broken": None}
        try:
            row["max_err"] = max((fn(q, k[:, :, :n], v[:, :, :n]).double() - f64_attention(q, k, v, n))
                                 .abs().max().item() for n in lengths)
        except Exception as exc:  # noqa: BLE001 - a kernel that cannot run this shape is skipped
            if _is_oom(exc):
                raise
            row["broken"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
            if (_key(q, k)[:-1], name) not in _LOGGED:  # once per call shape, whatever the key-count class
                _LOGGED.add((_key(q, k)[:-1], name))
                log.warning("fastattn fast: candidate %s is broken for %s: %s", name, _key(q, k)[:-1], row["broken"])
        else:
            row["accepted"] = row["max_err"] <= bound
            if row["accepted"]:
                ok[name] = fn
        rows.append(row)
    if not ok:
        raise RuntimeError(f"fastattn fast: no candidate is within twice reference's error for {_key(q, k)}: "
                           f"{[(r['candidate'], r['max_err'], r['broken']) for r in rows]}")
    medians = _time(ok, q, k, v, lengths, device)
    for row in rows:
        row["probe_only"] = row["candidate"] in PROBE_ONLY
        if row["candidate"] in medians:
            row["median_ms"] = medians[row["candidate"]] * 1e3
    eligible = {n: t for n, t in medians.items() if n not in PROBE_ONLY}
    if not eligible:
        raise RuntimeError(f"fastattn fast: only probe-only candidates are within twice reference's error for "
                           f"{_key(q, k)}")
    winner = min(eligible, key=eligible.get)
    return {"device": str(device), "dtype": dtype_name(dtype), "hq": hq, "hkv": hkv, "head_dim": head_dim,
            "lq_class": "lq=1" if lq == 1 else "lq>1", "length_class": length_class, "probe_lengths": lengths,
            "reference_max_err": ref_err, "bound": bound, "candidates": rows, "winner": winner,
            "note": "fast mode trades bit-identity for speed: within twice reference's error vs float64"}


def _implementation(q, k) -> Callable:
    key = _key(q, k)
    hit = _CHOICES.get(key)
    if hit is None:
        if capturing_or_compiling() or q.device.type == "meta":
            return sdpa_slice
        with _LOCK:  # every key-count class at once: a decode crossing 512 or 2048 keys never stalls to probe
            for cls in LENGTH_CLASSES:
                if key[:-1] + (cls,) not in _CHOICES:
                    _CHOICES[key[:-1] + (cls,)] = choose_fast(q.device, q.dtype, hq=q.shape[1], hkv=k.shape[1],
                                                              head_dim=q.shape[3], lq=q.shape[2], length_class=cls)
            hit = _CHOICES[key]
    return CANDIDATES[hit["winner"]][0]


def fast_attention(q, k, v):
    """``fast`` over exactly the live keys ``k``, ``v`` (B, Hkv, n, D), bottom-right causal. A chosen implementation
    that raises (not OOM) is marked broken, logged once, and the next fastest takes over."""
    fn = _implementation(q, k)
    try:
        return fn(q, k, v)
    except Exception as exc:  # noqa: BLE001
        if _is_oom(exc):
            raise
        return _fall_back(q, k, v, exc)


def _fall_back(q, k, v, exc):
    key = _key(q, k)
    with _LOCK:
        choice = _CHOICES.get(key)
        if choice is None:
            raise exc
        bad = choice["winner"]
        for row in choice["candidates"]:
            if row["candidate"] == bad:
                row["accepted"], row["broken"] = False, f"{type(exc).__name__}: {str(exc)[:160]}"
        rest = [r for r in choice["candidates"] if r["accepted"] and r["median_ms"] is not None
                and r["candidate"] not in PROBE_ONLY]
        if not rest:
            raise exc
        choice["winner"] = min(rest, key=lambda r: r["median_ms"])["candidate"]
    log.warning("fastattn fast: %s raised %s for %s; using %s", bad, type(exc).__name__, key, choice["winner"])
    return CANDIDATES[choice["winner"]][0](q, k, v)


def graph_choice(device, dtype, *, hq: int, hkv: int, head_dim: int, capacity: int, bucket: int = 256,
                 **kw) -> dict:
    """The chain's ``graph`` class, :func:`fastattn.static.choose_graph_form`, once per process and shape until
    :func:`reset_fast_cache`. Compiles every form and resets dynamo: choose before compiling a model."""
    device = torch.device(device)
    key = (device_key(device), dtype_name(dtype), hq, hkv, head_dim, "lq=1", "graph", capacity, bucket)
    with _LOCK:
        if key not in _CHOICES:
            _CHOICES[key] = choose_graph_form(device, dtype, hq=hq, hkv=hkv, head_dim=head_dim, capacity=capacity,
                                              bucket=bucket, **kw)
        return _CHOICES[key]


def fast_report() -> list:
    """Every ``fast`` choice made in this process (``length_class == "graph"``: :func:`graph_choice`'s)."""
    with _LOCK:
        return [dict(v, candidates=[dict(r) for r in v["candidates"]]) for v in _CHOICES.values()]


def reset_fast_cache() -> None:
    """Forget the ``fast`` choices (tests; a new device in a long process)."""
    with _LOCK:
        _CHOICES.clear()
        _LOGGED.clear()
