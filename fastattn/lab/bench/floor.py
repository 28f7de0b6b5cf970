"""The hardware's floor: this box's copy bandwidth and the live K/V bytes one call must read."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Optional

import torch

from fastattn.devices import dtype_of as _dtype
from fastattn.devices import resolve_device

from .timing import time_interleaved


def llc_bytes(device="cpu") -> int:
    """Last-level cache bytes of ``device``: on CPU from sysfs (32 MiB when unknown), on CUDA the GPU's L2."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).L2_cache_size)
    best = 0
    for idx in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):  # none where sysfs lacks it
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
    src = torch.rand(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    t = time_interleaved({"copy": lambda: dst.copy_(src)}, repeats=repeats, warmup=2, device=device)["copy"]
    moved, med = 2 * src.numel() * 4, statistics.median(t)
    return {"bytes_moved": moved, "median_s": med, "gb_per_s": moved / med / 1e9, "best_gb_per_s": moved / min(t) / 1e9,
            "llc_bytes": llc_bytes(device) if device.type in ("cpu", "cuda") else None,
            "llc_kind": {"cpu": "CPU last-level cache", "cuda": "GPU L2"}.get(device.type)}


def bandwidth_line(bw: dict) -> str:
    """One line for a bandwidth record: GB/s and the last-level cache, or that the cache size is unknown."""
    llc = bw.get("llc_bytes")
    cache = (f"{bw.get('llc_kind') or 'last-level cache'}: {llc / 2**20:.0f} MiB" if llc else
             "last-level cache: unknown on this device (the DRAM floor is shown, not judged)")
    return f"copy bandwidth: {bw['gb_per_s']:.1f} GB/s (read + write); {cache}"


def floor_binds(live_bytes: int, copies: int, llc) -> Optional[bool]:
    """Whether ``live_bytes * copies`` exceeds the last-level cache (the DRAM floor binds); None if ``llc`` unknown."""
    return None if not llc else live_bytes * copies > llc


def live_kv_bytes(length: int, hkv: int, head_dim: int, dtype) -> int:
    """Bytes of live K and V one attention call must read once: 2 x Hkv x length x D x element size."""
    return 2 * hkv * length * head_dim * torch.tensor([], dtype=_dtype(dtype)).element_size()


def floor_ms(length: int, hkv: int, head_dim: int, dtype, gb_per_s: float) -> float:
    """The physical floor of one sliced attention call: live K/V bytes over the bandwidth."""
    return live_kv_bytes(length, hkv, head_dim, dtype) / (gb_per_s * 1e9) * 1e3
