"""Decode primitives the attention modules build on: SDPA, the causal mask, the window rule, float64, checks.

SDPA's layout: q ``(B, Hq, Lq, D)``, k, v ``(B, Hkv, capacity, D)``; row ``i`` sees keys ``j <= length - Lq + i``."""

from __future__ import annotations

import math
from typing import Union

import torch
import torch.nn.functional as F

Length = Union[int, torch.Tensor]


def check_tensors(q, k_cache, v_cache) -> None:
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            shape = "(B, Hq, Lq, D)" if name == "q" else "(B, Hkv, capacity, D)"
            raise ValueError(f"{name} must have 4 dims {shape}, got shape {tuple(t.shape)}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must have the same shape, got {tuple(k_cache.shape)} and "
                         f"{tuple(v_cache.shape)}")
    for dim, what in ((0, "batch"), (3, "head dim")):
        if q.shape[dim] != k_cache.shape[dim]:
            raise ValueError(f"{what} of q ({q.shape[dim]}) and of k_cache ({k_cache.shape[dim]}) differ")
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


def check_positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def check_positions(positions, limit: int, name: str) -> None:
    """Every position in ``[0, limit)``; ``name`` is what ``limit`` is called in the message (capacity, max_length)."""
    for p in positions:
        if not 0 <= p < limit:
            raise ValueError(f"positions must be in [0, {name}={limit}), got {p}")


def check_bucket(bucket, *, allow_none: bool = False) -> None:
    if bucket is None and allow_none:
        return
    if isinstance(bucket, bool) or not isinstance(bucket, int) or bucket <= 0 or bucket % 16:
        expected = "None (calibrated) or a positive multiple of 16" if allow_none else "a positive multiple of 16"
        raise ValueError(f"bucket must be {expected}, got {bucket!r}")


def check_length_int(length: int, lq: int, capacity: int, name: str = "length") -> None:
    if not lq <= length <= capacity:
        raise ValueError(f"{name} must satisfy Lq ({lq}) <= {name} <= capacity ({capacity}), got {length}")


def length_kind(length, device) -> str:
    """'int' or 'tensor'; TypeError or ValueError for anything else."""
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


def check_length_tensor(length: torch.Tensor, lq: int, capacity: int, upper: int) -> None:
    """Range-check a length tensor: on the host on CPU, else by ``_assert_async`` (no sync; failing poisons CUDA)."""
    if length.device.type == "cpu":
        n = int(length.reshape(()))
        check_length_int(n, lq, capacity)
        if n > upper:
            raise ValueError(f"length ({n}) exceeds window ({upper})")
    elif length.device.type != "meta":
        torch._assert_async(((length >= lq) & (length <= upper)).reshape(()),
                            f"length must satisfy Lq ({lq}) <= length <= {upper}")


def host_length(length: torch.Tensor, lq: int, capacity: int) -> int:
    """Read a length tensor back (a device-to-host sync on CUDA) and range-check it."""
    n = int(length.reshape(()).item())
    check_length_int(n, lq, capacity)
    return n


def window_for(length: int, capacity: int, bucket: int = 256) -> int:
    """Key window of ``exact`` mode: ``min(ceil(length / bucket) * bucket, capacity)``."""
    check_bucket(bucket)
    return min(-(-int(length) // bucket) * bucket, int(capacity))


def f64_attention(q, k, v, length: int) -> torch.Tensor:
    """Float64 decode attention over keys [0, length), bottom-right causal; GQA by repetition."""
    lq = q.shape[2]
    g = q.shape[1] // k.shape[1]
    # (B, Hkv, length, D) -> (B, Hq, length, D)
    kk = k[:, :, :length].double().repeat_interleave(g, 1)
    vv = v[:, :, :length].double().repeat_interleave(g, 1)
    # (B, Hq, Lq, length)
    s = q.double() @ kk.transpose(-1, -2) / math.sqrt(q.shape[-1])
    rows = torch.arange(lq, device=q.device).view(-1, 1) + (length - lq)
    s = s.masked_fill(torch.arange(length, device=q.device).view(1, -1) > rows, float("-inf"))
    return torch.softmax(s, -1) @ vv


def random_decode(device, dtype, *, hq: int, hkv: int, head_dim: int, capacity: int, seed: int = 0) -> tuple:
    """Seeded q (1, Hq, 1, D) and K, V (1, Hkv, capacity, D), drawn on CPU: every device gets the same numbers."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, hq, 1, head_dim, generator=g).to(device=device, dtype=dtype)
    # (2, B, Hkv, capacity, D): K and V are views of one tensor, as in voxcpm's cache
    kv = torch.randn(2, 1, hkv, capacity, head_dim, generator=g).to(device=device, dtype=dtype)
    return q, kv[0], kv[1]


def causal_mask(n_keys: int, lq: int, length: Length, device) -> torch.Tensor:
    """Bool (1, 1, Lq, n_keys), True where row i sees key j <= length - Lq + i; upstream's for Lq == 1."""
    cols = torch.arange(n_keys, device=device)
    if isinstance(length, torch.Tensor):
        length = length.reshape(())
    if lq == 1:
        return (cols <= length - 1).view(1, 1, 1, -1)
    last = length - lq + torch.arange(lq, device=device).view(-1, 1)  # (Lq, 1): last visible key per row
    return (cols.view(1, -1) <= last).view(1, 1, lq, n_keys)


def sdpa(q, k, v, mask):
    """SDPA with a bool mask and GQA, as upstream calls it; looked up per call, so a replaced kernel is what runs."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def capturing_or_compiling() -> bool:
    """Inside ``torch.compile`` tracing or a CUDA-graph capture (no probe, calibration or host read may run)."""
    return torch.compiler.is_compiling() or bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
