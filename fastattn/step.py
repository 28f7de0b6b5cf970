"""``attention_step``: one decode-step attention call over a preallocated KV cache, in one of three modes."""

from __future__ import annotations

from typing import Optional

import torch

from .core import (
    Length,
    check_bucket,
    check_length_int,
    check_length_tensor,
    check_tensors,
    f64_attention,
    length_kind,
    window_for,
)
from .exactness import check_exactness, warn_if_unaligned_window
from .modes import MODES, mode_spec

__all__ = ["MODES", "attention_step", "window_for", "check_exactness", "f64_attention"]


def attention_step(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, length: Length, *,
                   mode: str = "exact", bucket: Optional[int] = None, window: Optional[int] = None) -> torch.Tensor:
    """Attention of ``q`` (B, Hq, Lq, D) over keys ``[0, length)`` of ``k_cache``, ``v_cache`` (B, Hkv, capacity, D),
    Hq a multiple of Hkv, bottom-right causal for Lq > 1: (B, Hq, Lq, D) in q's dtype.

    mode: ``"exact"`` (default) is bit-identical to ``"reference"`` (upstream's masked call) on this device; ``"fast"``
        is opt-in and changes bits (within rounding).
    length: ``Lq <= length <= capacity``: an int or a one-element integer tensor on the cache's device, range-checked
        for free on CPU, on CUDA by ``torch._assert_async`` (a failure poisons the CUDA context). Read back (a sync) by
        ``fast`` and by a windowed ``exact`` without ``window``.
    bucket: ``exact``'s window: None (calibrated) or a positive multiple of 16 (self-checked, warned if not identical).
    window: ``exact`` only: the caller's bucketed key count, ``length <= window <= capacity``; spares the read-back."""
    check_tensors(q, k_cache, v_cache)
    spec = mode_spec(mode)
    check_bucket(bucket, allow_none=True)
    lq, capacity = q.shape[2], k_cache.shape[2]
    kind = length_kind(length, k_cache.device)

    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int):
            raise TypeError(f"window must be a Python int, got {type(window).__name__}")
        check_length_int(window, lq, capacity, name="window")
        if not spec.masked:
            raise ValueError(f"window= is for mode='exact' (and 'reference' ignores it); {mode!r} slices to length "
                             "exactly")
    upper = window if window is not None else capacity
    if kind == "int":
        check_length_int(length, lq, capacity)
        if length > upper:
            raise ValueError(f"length ({length}) exceeds window ({window})")
    else:
        check_length_tensor(length, lq, capacity, upper)
    if spec.windowed and window is not None and bucket is None:
        warn_if_unaligned_window(q, k_cache, window)
    return spec.attend(q, k_cache, v_cache, length, bucket, window)
