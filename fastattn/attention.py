"""One attention call of a decode step over a preallocated KV cache.

Shapes (SDPA's layout)::

    q        (B, Hq,  Lq,       D)
    k_cache  (B, Hkv, capacity, D)   Hq % Hkv == 0 (grouped-query attention)
    v_cache  (B, Hkv, capacity, D)

``length`` is the number of valid keys (Lq <= length <= capacity). Throughout
fastattn, *position p* is the 0-based index of the newest token, so
``length = p + 1``. Causality is bottom-right aligned: query row ``i`` sees keys
``j <= length - Lq + i``; for ``Lq == 1`` that is keys ``[0, length)``.

Three modes:

``reference``
    upstream VoxCPM2's computation, reproduced exactly: a bool mask over the
    whole capacity and SDPA with ``enable_gqa=True``. O(capacity) per call.
``exact`` (default)
    bit-identical to ``reference`` on the device it runs on, by construction.
    Keys ``[0, W)`` with ``W = min(ceil(length / G) * G, capacity)`` and the
    mask kept inside the window, where ``G`` is the granularity calibrated for
    this device, dtype, head geometry, capacity and query length
    (:mod:`fastattn.exactness`: on CPU the flash kernel's 512-key block,
    confirmed by a dense random-data check at first use). Where no window is
    provably exact (``G`` is ``None``: CUDA's kernels, CPU's math kernel),
    ``exact`` attends over the whole capacity: upstream's computation. O(length
    + G) where a window is exact. Shapes change only at ``G`` boundaries, so
    the step is friendly to ``torch.compile`` and CUDA graphs. An explicit int
    ``bucket`` overrides ``G`` (not guaranteed exact: a first-use self-check
    warns where it is not).
``fast``
    keys sliced to exactly ``length``, no mask for ``Lq == 1``, computed by the
    fastest implementation on the device that is at most twice as far from a
    float64 reference as ``reference`` is (:mod:`fastattn.fast`: SDPA over the
    slice, or a grouped GEMM form, chosen by measurement at first use). Equal to
    ``reference`` within the dtype's rounding, not bit for bit. Opt-in.

What lies past ``length`` in the cache: ``fast`` never reads it. ``reference``
and ``exact`` read it under a False mask entry: finite values there cannot
change the result, but a NaN or Inf there poisons the output (0 * NaN = NaN in
the softmax-weighted sum). Keep the unused tail finite (zeros) —
:class:`fastattn.RightSizedKVCache` does.

Never used here: ``is_causal=True`` (top-left aligned: with Lq=1 it attends to
key 0 only), ``.contiguous()`` on a sliced cache (a copy per call), a
capacity-sized mask outside ``reference``.
"""

from __future__ import annotations

import math
from typing import Optional, Union

import torch
import torch.nn.functional as F

__all__ = ["MODES", "attention_step", "window_for", "exactness_report", "check_exactness", "reset_exactness_cache",
           "calibrate_exact", "f64_attention"]


Length = Union[int, torch.Tensor]


# --------------------------------------------------------------------------- validation
def _check_tensors(q, k_cache, v_cache) -> None:
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            shape = "(B, Hq, Lq, D)" if name == "q" else "(B, Hkv, capacity, D)"
            raise ValueError(f"{name} must have 4 dims {shape}, got shape {tuple(t.shape)}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must have the same shape, got {tuple(k_cache.shape)} and "
                         f"{tuple(v_cache.shape)}")
    if q.shape[0] != k_cache.shape[0]:
        raise ValueError(f"batch of q ({q.shape[0]}) and of k_cache ({k_cache.shape[0]}) differ")
    if q.shape[3] != k_cache.shape[3]:
        raise ValueError(f"head dim of q ({q.shape[3]}) and of k_cache ({k_cache.shape[3]}) differ")
    hq, hkv = q.shape[1], k_cache.shape[1]
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"query heads (q.shape[1]={hq}) must be a multiple of KV heads (k_cache.shape[1]={hkv})")
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise TypeError(f"dtypes differ: q {q.dtype}, k_cache {k_cache.dtype}, v_cache {v_cache.dtype}")
    if not q.dtype.is_floating_point:
        raise TypeError(f"q, k_cache and v_cache must be floating point (float32, bfloat16, float16, float64), "
                        f"got {q.dtype}")
    if not (q.device == k_cache.device == v_cache.device):
        raise ValueError(f"devices differ: q {q.device}, k_cache {k_cache.device}, v_cache {v_cache.device}")


def _check_bucket(bucket, *, allow_none: bool = False) -> None:
    if bucket is None and allow_none:
        return
    if isinstance(bucket, bool) or not isinstance(bucket, int) or bucket <= 0 or bucket % 16:
        expected = "None (calibrated) or a positive multiple of 16" if allow_none else "a positive multiple of 16"
        raise ValueError(f"bucket must be {expected}, got {bucket!r}")


def _check_length_int(length: int, lq: int, capacity: int, name: str = "length") -> None:
    if not lq <= length <= capacity:
        raise ValueError(f"{name} must satisfy Lq ({lq}) <= {name} <= capacity ({capacity}), got {length}")


def _length_kind(length, device) -> str:
    """'int' or 'tensor'; raises on anything else."""
    if isinstance(length, bool):
        raise TypeError("length must be an int or an integer tensor, got bool")
    if isinstance(length, int):
        return "int"
    if isinstance(length, torch.Tensor):
        if length.dtype.is_floating_point or length.dtype.is_complex or length.dtype == torch.bool:
            raise TypeError(f"length tensor must have an integer dtype, got {length.dtype}")
        if length.numel() != 1:
            raise ValueError(f"length tensor must hold one element, got shape {tuple(length.shape)}")
        if length.device != device:
            raise ValueError(f"length tensor is on {length.device}, the cache on {device}")
        return "tensor"
    raise TypeError(f"length must be an int or an integer tensor, got {type(length).__name__}")


# --------------------------------------------------------------------------- helpers
def window_for(length: int, capacity: int, bucket: int = 256) -> int:
    """Key window of ``exact`` mode: ``min(ceil(length / bucket) * bucket, capacity)``."""
    _check_bucket(bucket)
    return min(-(-int(length) // bucket) * bucket, int(capacity))


def f64_attention(q, k, v, length: int) -> torch.Tensor:
    """Float64 decode attention over keys [0, length), bottom-right causal; GQA by repetition."""
    lq = q.shape[2]
    g = q.shape[1] // k.shape[1]
    kk = k[:, :, :length].double().repeat_interleave(g, 1)
    vv = v[:, :, :length].double().repeat_interleave(g, 1)
    s = q.double() @ kk.transpose(-1, -2) / math.sqrt(q.shape[-1])
    rows = torch.arange(lq, device=q.device).view(-1, 1) + (length - lq)
    s = s.masked_fill(torch.arange(length, device=q.device).view(1, -1) > rows, float("-inf"))
    return torch.softmax(s, -1) @ vv


def _mask(n_keys: int, lq: int, length: Length, device) -> torch.Tensor:
    """Bool mask (1, 1, Lq, n_keys): row i sees keys j <= length - Lq + i (True = attend).

    For Lq == 1 it is upstream's ``(arange(n) <= length - 1).view(1, 1, 1, -1)``.
    ``length`` may be a device tensor: the comparison then stays on the device.
    """
    cols = torch.arange(n_keys, device=device)
    if isinstance(length, torch.Tensor):
        length = length.reshape(())
    if lq == 1:
        return (cols <= length - 1).view(1, 1, 1, -1)
    last = length - lq + torch.arange(lq, device=device).view(-1, 1)  # (Lq, 1): last visible key per row
    return (cols.view(1, -1) <= last).view(1, 1, lq, n_keys)


def _sdpa(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


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
    """Attention of ``q`` over the first ``length`` keys of a preallocated cache.

    Args:
        q: (B, Hq, Lq, D) queries.
        k_cache, v_cache: (B, Hkv, capacity, D); Hq must be a multiple of Hkv.
            Only keys ``[0, length)`` are attended to (bottom-right causal
            for Lq > 1).
        length: valid keys, ``Lq <= length <= capacity``: a Python int, or a
            one-element integer tensor on the cache's device (range-checked
            like an int: on CPU at no cost, raising ValueError; on CUDA by a
            device-side assert, ``torch._assert_async``, which does not raise a
            ValueError here but fails the CUDA context for the rest of the
            process: a bad length there means restarting it). A
            tensor without ``window`` is read back to the host for a windowed
            ``exact`` and for ``fast`` (one device-to-host sync on CUDA).
        mode: ``"exact"`` (default, bit-identical to ``reference`` on this
            device), ``"reference"`` (upstream), ``"fast"`` (opt-in, within
            rounding). See the module docstring.
        bucket: ``exact``'s window granularity. ``None`` (default): the
            granularity calibrated for this call (exact by construction and
            measurement; see :func:`fastattn.calibrate_exact`). An int (a positive
            multiple of 16): that granularity, self-checked at first use and
            warned about where it is not bit-identical.
        window: ``exact`` only: the caller's bucketed key count (a Python int,
            ``Lq <= window <= capacity``) so that a tensor ``length`` needs no
            host sync. The caller guarantees ``length <= window``; keys past
            ``length`` inside the window are masked.

    Returns:
        (B, Hq, Lq, D) in q's dtype.
    """
    _check_tensors(q, k_cache, v_cache)
    spec = mode_spec(mode)
    _check_bucket(bucket, allow_none=True)
    lq, capacity = q.shape[2], k_cache.shape[2]
    kind = _length_kind(length, k_cache.device)

    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int):
            raise TypeError(f"window must be a Python int, got {type(window).__name__}")
        _check_length_int(window, lq, capacity, name="window")
        if not spec.masked:
            raise ValueError(f"window= is for mode='exact' (and 'reference' ignores it); {mode!r} slices to length "
                             "exactly")
    upper = window if window is not None else capacity
    if kind == "int":
        _check_length_int(length, lq, capacity)
        if length > upper:
            raise ValueError(f"length ({length}) exceeds window ({window})")
    else:
        _check_length_tensor(length, lq, capacity, upper)
    if spec.windowed and window is not None and bucket is None:
        _exactness.warn_if_unaligned_window(q, k_cache, window)
    return _attend(q, k_cache, v_cache, length, mode, bucket, window)


def _check_length_tensor(length: torch.Tensor, lq: int, capacity: int, upper: int) -> None:
    """The int checks for a length tensor: exact on CPU (no sync there), a device-side assert elsewhere (no host
    sync; a failing one poisons the CUDA context, per torch's ``_assert_async``: the process must restart)."""
    if length.device.type == "cpu":
        n = int(length.reshape(()))
        _check_length_int(n, lq, capacity)
        if n > upper:
            raise ValueError(f"length ({n}) exceeds window ({upper})")
    elif length.device.type != "meta":
        torch._assert_async(((length >= lq) & (length <= upper)).reshape(()),
                            f"length must satisfy Lq ({lq}) <= length <= {upper}")


def _attend(q, k_cache, v_cache, length, mode: str, bucket, window):
    """``attention_step`` after validation: the mode's implementation (:mod:`fastattn.modes`). Callers that
    guarantee the contract (fastattn's patched decode step: shapes from the model, length from its position
    tensor, a calibrated window) call this directly, so the per-layer hot path does not re-validate."""
    return REGISTRY[mode].attend(q, k_cache, v_cache, length, bucket, window)


def _exact_window(q, k_cache, length, bucket) -> int:
    """``exact``'s key count: the length rounded up to the granularity, or the whole capacity."""
    capacity = k_cache.shape[2]
    g = bucket if bucket is not None else _exactness.exact_granularity(
        q.device, q.dtype, hq=q.shape[1], hkv=k_cache.shape[1], head_dim=q.shape[3], capacity=capacity, lq=q.shape[2])
    if g is None or g >= capacity:
        return capacity
    n = length if isinstance(length, int) else _host_length(length, q.shape[2], capacity)
    return window_for(n, capacity, g)


def _host_length(length: torch.Tensor, lq: int, capacity: int) -> int:
    """Read a length tensor back (a device-to-host sync on CUDA) and range-check it."""
    n = int(length.reshape(()).item())
    _check_length_int(n, lq, capacity)
    return n


from . import exactness as _exactness  # noqa: E402  (imports _mask from this module)
from .exactness import (  # noqa: E402,F401  (re-exported)
    calibrate_exact,
    check_exactness,
    exactness_report,
    reset_exactness_cache,
)
from .modes import MODES, REGISTRY, mode_spec  # noqa: E402,F401  (MODES re-exported)
