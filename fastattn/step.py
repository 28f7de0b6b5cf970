"""``attention_step``: one attention call of a decode step over a preallocated KV cache, in one of three modes.

q ``(B, Hq, Lq, D)``, caches ``(B, Hkv, capacity, D)``, ``Hq % Hkv == 0``; ``length`` valid keys, bottom-right
causal. ``exact`` (default) is bit-identical to ``reference`` (upstream's masked call) on the device;
``fast`` (opt-in) is within rounding. The modes are docs/design.md's "The three modes"."""

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
from .exactness import (
    calibrate_exact,
    check_exactness,
    exactness_report,
    reset_exactness_cache,
    warn_if_unaligned_window,
)
from .modes import MODES, mode_spec

__all__ = ["MODES", "attention_step", "window_for", "exactness_report", "check_exactness", "reset_exactness_cache",
           "calibrate_exact", "f64_attention"]


# --------------------------------------------------------------------------- the step
def attention_step(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    length: Length,
    *,
    mode: str = "exact",
    bucket: Optional[int] = None,
    window: Optional[int] = None,
) -> torch.Tensor:
    """Attention of ``q`` over the first ``length`` keys of a preallocated cache: (B, Hq, Lq, D) in q's dtype.

    Args:
        q: (B, Hq, Lq, D). k_cache, v_cache: (B, Hkv, capacity, D), Hq a multiple of Hkv; keys ``[0, length)``
            are attended to, bottom-right causal for Lq > 1.
        length: ``Lq <= length <= capacity``: an int, or a one-element integer tensor on the cache's device
            (checked on CPU for free; on CUDA by ``torch._assert_async``, which fails the CUDA context for the rest
            of the process). A tensor without ``window`` is read back for a windowed ``exact`` and for ``fast``.
        mode: ``"exact"`` (default, bit-identical to ``"reference"``, upstream's call, on this device) or
            ``"fast"`` (opt-in, within rounding). See docs/design.md.
        bucket: ``exact``'s window: None (calibrated, :func:`fastattn.calibrate_exact`) or a positive multiple of
            16 (self-checked at first use, warned about where it is not bit-identical).
        window: ``exact`` only: the caller's bucketed key count (an int, ``length <= window <= capacity``), so a
            tensor ``length`` needs no host sync."""
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
