"""A KV cache sized to the request: a drop-in for voxcpm's ``StaticKVCache``.

Upstream allocates ``(2, layers, B, Hkv, max_length=8192, D)`` per LM and zeroes
all of it on every request (``fill_caches`` -> ``kv_cache.zero_()``). For a
reply of a few hundred tokens that is ~600 MB resident (fp32, both LMs) and a
full-capacity memset per request.

:class:`RightSizedKVCache` keeps the same interface and semantics but holds
``capacity`` slots, a multiple of ``bucket`` (never above ``max_length``):

* storage is zeroed when it is allocated or grown, never per request up to
  ``max_length``;
* ``fill_caches`` copies the prefill prefix and clears only what lies past it
  within the current capacity, O(request) — stale values (a NaN left by an
  earlier request) would otherwise poison the masked ``reference``/``exact``
  attention, which multiplies them by zero weight;
* ``step()`` grows by whole buckets when the next position does not fit and
  raises ``ValueError("KV cache is full")`` past ``max_length``, like upstream;
* ``get_layer_cache(i)`` returns views over the current *window*: the first
  ``ceil(current_length / bucket) * bucket`` slots (clamped to capacity). Keys
  past ``current_length`` inside the window are zeros; upstream's masked
  ``forward_step`` over these views is therefore exactly ``exact`` mode.

A request of prefill P and N decode steps allocates at most
``ceil((P + N + 1) / bucket) * bucket`` slots. A longer earlier request does
not make a later short one hold more: ``fill_caches`` reallocates when the
capacity exceeds what the new prefill needs by more than one bucket.

Fresh views: growth moves the storage. Views returned by ``get_layer_cache``
before a growth point into the old storage, which is filled with NaN when it
is replaced: a computation that keeps using a stale view produces NaN instead
of plausible numbers, and what it writes is lost with the old tensor. Fetch
views after ``step()`` (voxcpm's decode loop fetches them every step, through
``get_layer_cache``). ``generation`` counts storage moves (compiled graphs and
CUDA graphs key their captures on the storage). (Releasing the old storage
with ``resize_(0)`` was tried: writes then raise, but reads segfault.)
"""

from __future__ import annotations

from typing import List, Tuple

import torch

from .attention import _check_bucket

__all__ = ["RightSizedKVCache"]


def _pos_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


class RightSizedKVCache:
    """KV storage ``(2, num_layers, batch, num_kv_heads, capacity, dim_kv_head)`` grown by buckets.

    Same constructor and methods as ``voxcpm.modules.minicpm4.cache.StaticKVCache``
    plus ``bucket``, ``capacity``, ``window``, ``nbytes``, ``reserve()``,
    ``generation``. ``kv_cache`` is, as upstream, the 6-D tensor the layers'
    views come from, but here it is the *window* view ``(..., window, D)`` of the
    storage; the storage itself is ``_storage``.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, dim_kv_head: int, batch_size: int,
                 device, dtype: torch.dtype, max_length: int = 8192, *, bucket: int = 256):
        self.num_layers = _pos_int(num_layers, "num_layers")
        self.num_kv_heads = _pos_int(num_kv_heads, "num_kv_heads")
        self.dim_kv_head = _pos_int(dim_kv_head, "dim_kv_head")
        self.batch_size = _pos_int(batch_size, "batch_size")
        self.max_length = _pos_int(max_length, "max_length")
        _check_bucket(bucket)
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
        self.bucket = bucket
        self.device = torch.device(device)
        self.dtype = dtype
        self.current_length = 0
        self.generation = 0
        self.static_address = False
        self._storage = self._zeros(self._rounded(1))
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
        """Point ``kv_cache`` at the first ``window`` slots of the storage.

        The view's slot dimension is marked dynamic for torch.compile, so a compiled
        step sees one symbolic window size instead of recompiling at every bucket.
        """
        w = min(self._rounded(max(self.current_length, 1)), self.capacity)
        view = getattr(self, "kv_cache", None)
        if w != getattr(self, "window", None) or view is None or view.data_ptr() != self._storage.data_ptr():
            self.window = w
            self.kv_cache = self._storage[:, :, :, :, :w]
            torch._dynamo.maybe_mark_dynamic(self.kv_cache, 4)

    @property
    def capacity(self) -> int:
        """Slots currently allocated per layer (a multiple of bucket, or max_length)."""
        return self._storage.shape[4]

    @property
    def nbytes(self) -> int:
        """Bytes of K and V storage held now (the whole capacity, not just the window)."""
        return self._storage.numel() * self._storage.element_size()

    def _move_to(self, capacity: int) -> None:
        """Reallocate to ``capacity`` slots (zeros), keep the live prefix, poison the old storage."""
        old = self._storage
        new = self._zeros(capacity)
        keep = min(self.current_length, capacity)
        if keep:
            new[..., :keep, :] = old[..., :keep, :]
        self._storage = new
        self.generation += 1
        if old.is_floating_point():
            old.fill_(float("nan"))  # a stale view now yields NaN, never plausible numbers

    def set_static_address(self, flag: bool = True) -> None:
        """Mark the storage (now and after every growth) as a static address for CUDA graphs."""
        self.static_address = bool(flag)
        if flag:
            torch._dynamo.mark_static_address(self._storage)

    def reserve(self, n_tokens: int) -> None:
        """Grow capacity to hold at least ``n_tokens`` (never shrinks; bucket-rounded, <= max_length)."""
        if isinstance(n_tokens, bool) or not isinstance(n_tokens, int) or n_tokens < 0:
            raise ValueError(f"n_tokens must be a non-negative int, got {n_tokens!r}")
        if n_tokens > self.max_length:
            raise ValueError(f"cannot reserve {n_tokens} tokens: max_length is {self.max_length}")
        if n_tokens > self.capacity:
            self._move_to(self._rounded(n_tokens))
            self._set_window()

    # ------------------------------------------------------------------ StaticKVCache interface
    def get_layer_cache(self, layer_idx: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """(K, V) views of layer ``layer_idx`` over the current window: (B, Hkv, window, D) each.

        Reads no Python int: the window is the shape of ``kv_cache`` (dynamic under torch.compile).
        """
        if not 0 <= layer_idx < self.num_layers:
            raise IndexError(f"layer_idx {layer_idx} out of range for {self.num_layers} layers")
        return self.kv_cache[0, layer_idx], self.kv_cache[1, layer_idx]

    def step(self) -> int:
        """Claim the next position (returned) and grow by a bucket if it does not fit."""
        if self.current_length >= self.max_length:
            raise ValueError("KV cache is full")
        ret = self.current_length
        if ret >= self.capacity:
            self._move_to(self._rounded(ret + 1))
        self.current_length += 1
        self._set_window()
        return ret

    def fill_caches(self, kv_caches: List[Tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Start a request from prefill K/V: per layer (B, Hkv, P, D) each.

        Copies the P-slot prefix and zeroes only slots [P, capacity) — O(request).
        """
        if len(kv_caches) != self.num_layers:
            raise ValueError(f"kv_caches has {len(kv_caches)} layers, the cache {self.num_layers}")
        k0 = kv_caches[0][0]
        want = (self.batch_size, self.num_kv_heads, k0.shape[2] if k0.dim() == 4 else -1, self.dim_kv_head)
        if k0.dim() != 4 or tuple(k0.shape) != want:
            raise ValueError(f"kv_caches[0][0] must have shape (B={want[0]}, Hkv={want[1]}, P, D={want[3]}), got {tuple(k0.shape)}")
        n = k0.shape[2]
        if n > self.max_length:
            raise ValueError("KV cache is full")  # upstream's slice assignment would fail here too
        need = self._rounded(n + 1)  # the prefix plus the first decode position
        self.current_length = 0
        if self.capacity < need or self.capacity > need + self.bucket:
            self._move_to(need)  # fresh zeros: no clearing needed
        else:
            self._storage[..., n:, :].zero_()
        for i, (k, v) in enumerate(kv_caches):
            self._storage[0, i, :, :, :n, :] = k
            self._storage[1, i, :, :, :n, :] = v
        self.current_length = n
        self._set_window()

    def __repr__(self) -> str:
        return (f"RightSizedKVCache(layers={self.num_layers}, B={self.batch_size}, Hkv={self.num_kv_heads}, "
                f"D={self.dim_kv_head}, length={self.current_length}, window={self.window}, "
                f"capacity={self.capacity}/{self.max_length}, bucket={self.bucket}, {self.nbytes / 2**20:.1f} MiB)")
