from typing import List, Optional, Tuple

import torch

# From torch 2.9, SDPA runs this masked grouped-query decode call on CPU through its flash kernel, which walks the
# keys in blocks of 512 (aten/src/ATen/native/cpu/FlashAttentionKernel.cpp, flash_attention_kernel_impl:
# kv_split_size 512). A window whose size is a multiple of 512 hands it the same blocks as the whole cache; the
# whole cache's extra blocks are fully masked and add exact zeros. So on CPU the cache hands the attention the
# valid length rounded up to 512 slots, and the mask and the attention scale with that window, not max_length.
# Decodes through it were checked equal to the whole cache's, bit for bit, on CPU with torch 2.9.1, 2.11.0,
# 2.13.0, 2.14.1 and 2.15.0; a later torch that changes the kernel's block could break that, and
# granularity=max_length (StaticKVCache, MiniCPMModel.setup_cache) restores the whole cache. Older torch runs
# the call through its math kernel, where such a window changed float32 results: there, and off CPU, the window
# is the whole cache.
CPU_KEY_BLOCK = 512
CPU_FLASH_GQA = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 9)


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


class StaticKVCache:
    """KV cache of the decode loop, sized to the request.

    A request starts with its prefill rounded up to ``granularity`` slots (512 on CPU with
    torch >= 2.9, ``max_length`` elsewhere), the capacity doubles when decoding reaches its end, and a
    later shorter request shrinks it back: ``capacity <= min(max(2 * current_length,
    granularity), max_length)``. Only slots an earlier request wrote are cleared.
    ``kv_cache`` covers the valid length rounded up to ``granularity``; the slots past the
    valid length in it are zeros, masked by the attention. On CPU it is therefore shorter
    than ``max_length``, and ``step()`` or ``fill_caches()`` may replace it with a new view
    (when the window grows or the storage moves): read it, or ``get_layer_cache()``, after
    each call rather than holding on to it. Off CPU it is one tensor of ``max_length``
    slots for the life of the cache, as before.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        dim_kv_head: int,
        batch_size: int,
        device: torch.device,
        dtype: torch.dtype,
        max_length: int = 8192,
        granularity: Optional[int] = None,
    ):
        self.max_length = max_length
        self.num_layers = num_layers
        self.shape = (num_layers, batch_size, num_kv_heads, dim_kv_head)
        self.device = torch.device(device)
        self.dtype = dtype
        if granularity is None:
            granularity = CPU_KEY_BLOCK if self.device.type == "cpu" and CPU_FLASH_GQA else max_length
        self.granularity = granularity

        self.current_length = 0
        self.written = 0  # slots [0, written) may hold values; past it the storage is zeros
        self.storage = self._zeros(fill_capacity(0, 0, granularity, max_length))
        self.window = 0
        self._set_window(moved=True)

    def _zeros(self, capacity: int) -> torch.Tensor:
        layers, batch, heads, dim = self.shape
        return torch.zeros(2, layers, batch, heads, capacity, dim, device=self.device, dtype=self.dtype)

    def _set_window(self, moved: bool = False):
        window = window_slots(self.current_length, self.storage.size(4), self.granularity)
        if moved or window != self.window:
            self.window = window
            full = window == self.storage.size(4)
            self.kv_cache = self.storage if full else self.storage[:, :, :, :, :window]

    def get_layer_cache(self, layer_idx: int) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.kv_cache[0, layer_idx], self.kv_cache[1, layer_idx]

    def step(self) -> int:
        if self.current_length >= self.max_length:
            raise ValueError("KV cache is full")

        ret = self.current_length
        capacity = step_capacity(ret, self.storage.size(4), self.granularity, self.max_length)
        moved = capacity != self.storage.size(4)
        if moved:
            storage = self._zeros(capacity)
            storage[:, :, :, :, :ret] = self.storage[:, :, :, :, :ret]
            self.storage = storage
            self.written = ret
        self.current_length = ret + 1
        self.written = max(self.written, ret + 1)
        self._set_window(moved)
        return ret

    def fill_caches(self, kv_caches: List[Tuple[torch.Tensor, torch.Tensor]]):
        length = kv_caches[0][0].size(2)
        if length > self.max_length:
            raise ValueError("KV cache is full")
        capacity = fill_capacity(length, self.storage.size(4), self.granularity, self.max_length)
        moved = capacity != self.storage.size(4)
        if moved:
            self.storage = self._zeros(capacity)
        elif self.written > length:
            # only what an earlier request wrote past this one's prefix
            self.storage[:, :, :, :, length : self.written].zero_()
        for i in range(self.num_layers):
            self.storage[0, i, :, :, :length, :] = kv_caches[i][0]
            self.storage[1, i, :, :, :length, :] = kv_caches[i][1]
        self.current_length = length
        self.written = length
        self._set_window(moved)
