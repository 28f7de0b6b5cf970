"""A KV cache sized to the request: a drop-in for voxcpm's ``StaticKVCache`` (docs/design.md).

Storage ``(2, layers, B, Hkv, capacity, D)``. After every ``fill_caches`` and ``step()``: ``capacity`` at most
``max(2 * current_length, bucket)``, zeros past ``current_length``; views fetched before a growth read NaN."""

from __future__ import annotations

import sys
from typing import List, Optional, Tuple

import torch

from .core import check_bucket, check_positive_int


# --------------------------------------------------------------------------- the sizing policy (ints only)
def fill_capacity(length: int, capacity: int, granularity: int, max_length: int) -> int:
    """Slots a request with ``length`` prefill tokens starts with, given the ``capacity`` held now."""
    need = min(-(-(length + 1) // granularity) * granularity, max_length)
    if need <= capacity <= max(2 * length, granularity):
        return capacity  # enough, and at most twice what is live: keep it (no move)
    return need


def step_capacity(position: int, capacity: int, granularity: int, max_length: int) -> int:
    """Slots after claiming ``position``: unchanged while it fits, else doubled (rounded, clamped)."""
    if position < capacity:
        return capacity
    need = -(-(position + 1) // granularity) * granularity
    return min(max(2 * capacity, need), max_length)


def window_slots(length: int, capacity: int, granularity: int) -> int:
    """Slots the layers see: the live length rounded up to the granularity, clamped to capacity."""
    return min(-(-max(length, 1) // granularity) * granularity, capacity)


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def _mark_dynamic(t: torch.Tensor, dim: int) -> None:
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:
        dynamo.maybe_mark_dynamic(t, dim)


class RightSizedKVCache:
    """voxcpm's ``StaticKVCache`` interface holding ``capacity`` slots; ``kv_cache`` is the window view
    ``(2, layers, B, Hkv, window, D)``. Bad sizes raise ValueError, a bad dtype TypeError."""

    def __init__(self, num_layers: int, num_kv_heads: int, dim_kv_head: int, batch_size: int,
                 device, dtype: torch.dtype, max_length: int = 8192, *, bucket: int = 512):
        self.num_layers = check_positive_int(num_layers, "num_layers")
        self.num_kv_heads = check_positive_int(num_kv_heads, "num_kv_heads")
        self.dim_kv_head = check_positive_int(dim_kv_head, "dim_kv_head")
        self.batch_size = check_positive_int(batch_size, "batch_size")
        self.max_length = check_positive_int(max_length, "max_length")
        check_bucket(bucket)
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
        self.bucket = bucket
        self.device = torch.device(device)
        self.dtype = dtype
        self.current_length = 0
        self.generation = 0
        self.static_address = False
        self._dirty = 0      # slots [0, _dirty) may hold values; past it the storage is zeros
        self._reserved = 0   # reserve() for the coming request
        self._storage = self._zeros(fill_capacity(0, 0, bucket, self.max_length))
        self._set_window()

    # ------------------------------------------------------------------ sizing
    def _rounded(self, n_tokens: int) -> int:
        return min(-(-n_tokens // self.bucket) * self.bucket, self.max_length)

    def _zeros(self, capacity: int) -> torch.Tensor:
        t = torch.zeros(2, self.num_layers, self.batch_size, self.num_kv_heads, capacity, self.dim_kv_head,
                        device=self.device, dtype=self.dtype)
        if self.static_address:
            torch._dynamo.mark_static_address(t)
        return t

    def _set_window(self) -> None:
        """Point ``kv_cache`` at the first ``window`` slots, marked static too (a view of a marked storage is not)."""
        w = window_slots(self.current_length, self.capacity, self.bucket)
        view = getattr(self, "kv_cache", None)
        if w != getattr(self, "window", None) or view is None or view.data_ptr() != self._storage.data_ptr():
            self.window = w
            self.kv_cache = self._storage[:, :, :, :, :w]
            if self.windowed:
                _mark_dynamic(self.kv_cache, 4)
            if self.static_address:
                torch._dynamo.mark_static_address(self.kv_cache)

    @property
    def windowed(self) -> bool:
        return self.bucket < self.max_length

    @property
    def granularity(self) -> Optional[int]:
        """``bucket``, or None where the cache holds all ``max_length`` slots (no exact window)."""
        return self.bucket if self.windowed else None

    @property
    def capacity(self) -> int:
        return self._storage.shape[4]

    @property
    def nbytes(self) -> int:
        """Bytes of K and V storage held now (the whole capacity, not just the window)."""
        return self._storage.numel() * self._storage.element_size()

    def _move_to(self, capacity: int, keep: int) -> None:
        """Reallocate to ``capacity`` slots, keep the first ``keep``, zeros past them; poison the old storage."""
        old = self._storage
        new = torch.empty(*old.shape[:4], capacity, old.shape[5], device=self.device, dtype=self.dtype)
        keep = min(keep, capacity)
        new[..., :keep, :] = old[..., :keep, :]
        new[..., keep:, :].zero_()  # only past the kept slots: a grow writes each slot once
        if self.static_address:
            torch._dynamo.mark_static_address(new)
        self._storage, self._dirty = new, keep
        self.generation += 1
        if old.is_floating_point():
            old.fill_(float("nan"))  # a stale view now yields NaN, never plausible numbers

    def set_static_address(self, flag: bool = True) -> None:
        """Mark the storage and window view CUDA-graph static addresses, now and after every move."""
        self.static_address = bool(flag)
        if flag:
            torch._dynamo.mark_static_address(self._storage)
            torch._dynamo.mark_static_address(self.kv_cache)

    def reserve(self, n_tokens: int) -> None:
        """Hold ``n_tokens`` slots or more through the next ``fill_caches``; ValueError past ``max_length``."""
        if isinstance(n_tokens, bool) or not isinstance(n_tokens, int) or n_tokens < 0:
            raise ValueError(f"n_tokens must be a non-negative int, got {n_tokens!r}")
        if n_tokens > self.max_length:
            raise ValueError(f"cannot reserve {n_tokens} tokens: max_length is {self.max_length}")
        self._reserved = max(self._reserved, n_tokens)
        if n_tokens > self.capacity:
            self._move_to(self._rounded(n_tokens), keep=self._dirty)
            self._set_window()

    # ------------------------------------------------------------------ StaticKVCache interface
    def get_layer_cache(self, layer_idx: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """(K, V) views of layer ``layer_idx``, (B, Hkv, window, D) each; IndexError out of range."""
        if not 0 <= layer_idx < self.num_layers:
            raise IndexError(f"layer_idx {layer_idx} out of range for {self.num_layers} layers")
        return self.kv_cache[0, layer_idx], self.kv_cache[1, layer_idx]

    def step(self) -> int:
        """Claim and return the next position, doubling capacity if it does not fit; ValueError when full."""
        if self.current_length >= self.max_length:
            raise ValueError("KV cache is full")
        ret = self.current_length
        grown = step_capacity(ret, self.capacity, self.bucket, self.max_length)
        if grown != self.capacity:
            self._move_to(grown, keep=ret)
        self.current_length = ret + 1
        self._dirty = max(self._dirty, ret + 1)  # the layers write at position ret
        self._set_window()
        return ret

    def fill_caches(self, kv_caches: List[Tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Start a request from per-layer prefill K/V (B, Hkv, P, D), all checked before any write (ValueError leaves
        the cache as it was); clears only the slots earlier requests wrote."""
        n = self._check_prefill(kv_caches)
        target = fill_capacity(n, self.capacity, self.bucket, self.max_length)
        if self._reserved:
            target = max(target, self._rounded(self._reserved))
            self._reserved = 0
        if target != self.capacity:
            self._move_to(target, keep=0)  # fresh zeros: nothing to clear
        elif self._dirty > n:
            self._storage[..., n:self._dirty, :].zero_()
        for i, (k, v) in enumerate(kv_caches):
            self._storage[0, i, :, :, :n, :] = k
            self._storage[1, i, :, :, :n, :] = v
        self.current_length, self._dirty = n, n
        self._set_window()

    def _check_prefill(self, kv_caches) -> int:
        """The prefill length P, after checking every layer's K and V (shape, dtype, device)."""
        if not isinstance(kv_caches, (list, tuple)) or len(kv_caches) != self.num_layers:
            got = len(kv_caches) if isinstance(kv_caches, (list, tuple)) else type(kv_caches).__name__
            raise ValueError(f"kv_caches must hold {self.num_layers} (K, V) pairs, one per layer; got {got}")
        n = None
        for i, pair in enumerate(kv_caches):
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                raise ValueError(f"kv_caches[{i}] must be a (K, V) pair")
            for j, t in enumerate(pair):
                name = f"kv_caches[{i}][{j}]"
                if not isinstance(t, torch.Tensor) or t.dim() != 4:
                    raise ValueError(f"{name} must be a 4-D tensor (B, Hkv, P, D)")
                n = t.shape[2] if n is None else n
                want = (self.batch_size, self.num_kv_heads, n, self.dim_kv_head)
                if tuple(t.shape) != want:
                    raise ValueError(f"{name} must have shape (B={want[0]}, Hkv={want[1]}, P={n}, D={want[3]}), "
                                     f"got {tuple(t.shape)}")
                if t.dtype != self.dtype or not _same_device(t.device, self.device):
                    raise ValueError(f"{name} must be {self.dtype} on {self.device}, got {t.dtype} on {t.device}")
        if n > self.max_length:
            raise ValueError("KV cache is full")  # upstream's slice assignment would fail here too
        return n

    def __repr__(self) -> str:
        return (f"RightSizedKVCache(layers={self.num_layers}, B={self.batch_size}, Hkv={self.num_kv_heads}, "
                f"D={self.dim_kv_head}, length={self.current_length}, window={self.window}, "
                f"capacity={self.capacity}/{self.max_length}, bucket={self.bucket}, {self.nbytes / 2**20:.1f} MiB)")
