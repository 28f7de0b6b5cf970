"""The attention modes as data: :data:`REGISTRY` of :class:`Mode`; adding a mode is one entry here and its tests."""

from __future__ import annotations

from typing import Callable, NamedTuple

from .cache import window_slots
from .core import causal_mask, host_length, sdpa
from .exactness import exact_window, self_check_once
from .fast import fast_attention


class Mode(NamedTuple):
    name: str
    attend: Callable     # (q, k_cache, v_cache, length, bucket, window) -> (B, Hq, Lq, D)
    keys: Callable       # (live length, capacity, granularity or None) -> keys the layers are handed
    masked: bool
    windowed: bool
    exact: bool
    graph_safe: bool
    note: str


def _reference(q, k_cache, v_cache, length, bucket, window):
    return sdpa(q, k_cache, v_cache, causal_mask(k_cache.shape[2], q.shape[2], length, q.device))


def _exact(q, k_cache, v_cache, length, bucket, window):
    if window is None:  # the bucket decides the window only here (the patch checks its own at max_length)
        if bucket is not None:
            self_check_once(q, k_cache, bucket)
        window = exact_window(q, k_cache, length, bucket)
    k, v = k_cache[:, :, :window], v_cache[:, :, :window]
    return sdpa(q, k, v, causal_mask(window, q.shape[2], length, q.device))


def _fast(q, k_cache, v_cache, length, bucket, window):
    n = length if isinstance(length, int) else host_length(length, q.shape[2], k_cache.shape[2])
    return fast_attention(q, k_cache[:, :, :n], v_cache[:, :, :n])


REGISTRY = {m.name: m for m in (
    Mode("reference", _reference, lambda n, capacity, g: capacity, masked=True, windowed=False, exact=True,
         graph_safe=True, note="reference mode is upstream's computation: a bool mask over the whole cache"),
    Mode("exact", _exact, lambda n, capacity, g: capacity if g is None else window_slots(n, capacity, g),
         masked=True, windowed=True, exact=True, graph_safe=True,
         note="exact mode: bit-identical to upstream on this device, by construction and calibration"),
    Mode("fast", _fast, lambda n, capacity, g: n, masked=False, windowed=False, exact=False, graph_safe=True,
         note="fast mode trades bit-identity for speed (within twice reference's error vs float64)"),
)}

#: the mode names, in the order reports list them
MODES = tuple(REGISTRY)


def mode_spec(mode) -> Mode:
    """The registry entry for ``mode``; a clear ValueError for anything else."""
    spec = REGISTRY.get(mode) if isinstance(mode, str) else None
    if spec is None:
        raise ValueError(f"mode must be one of {', '.join(map(repr, MODES))}; got {mode!r}")
    return spec
