"""The class functions :func:`fastattn.patch_voxcpm` installs in voxcpm's MiniCPM model.

The model step cuts each layer's K/V views to the mode's keys from host-side bookkeeping: no sync per layer."""

from __future__ import annotations

import threading
import weakref
from typing import Optional

import torch

from .cache import RightSizedKVCache
from .exactness import check_bucket_once, exact_granularity
from .fast import grouped_window, sdpa_slice
from .modes import REGISTRY

_MODEL_STEP = threading.local()  # .cut: the patched model step is handing its layers views cut to the live keys


def make_attention_forward_step(mode: str, bucket, *, attend=None):
    """``MiniCPMAttention.forward_step`` in ``mode``; ``attend`` (q, k, v: live keys) overrides an unmasked mode."""
    from voxcpm.modules.minicpm4.model import apply_rotary_pos_emb

    spec = REGISTRY[mode]
    unmasked = not spec.masked  # such a mode attends to every key it is handed: never hand it more than live

    def forward_step(self, hidden_states, position_emb, position_id, kv_cache):
        bsz, _ = hidden_states.size()

        query_states = self.q_proj(hidden_states)
        key_states = self.k_proj(hidden_states)
        value_states = self.v_proj(hidden_states)

        # (B, H * D) -> (B, 1, H, D) -> (B, H, 1, D): one new token per step
        query_states = query_states.view(bsz, 1, self.num_heads, self.head_dim).transpose(1, 2)
        key_states = key_states.view(bsz, 1, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        value_states = value_states.view(bsz, 1, self.num_key_value_heads, self.head_dim).transpose(1, 2)

        if position_emb is not None:
            cos, sin = position_emb
            query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

        key_cache, value_cache = kv_cache  # views cut by the model step (see make_model_forward_step)
        graph = unmasked and torch.compiler.is_compiling()
        if unmasked and not graph and not getattr(_MODEL_STEP, "cut", False):
            # called directly (not from the patched model step, whose views hold exactly the live keys):
            # never attend past the position. Reads the position (free on CPU, a sync on CUDA).
            n = int(position_id.reshape(-1)[-1] if isinstance(position_id, torch.Tensor) else position_id) + 1
            key_cache, value_cache = key_cache[:, :, :n], value_cache[:, :, :n]
        key_cache[:, :, position_id, :] = key_states
        value_cache[:, :, position_id, :] = value_states

        if query_states.device.type == "mps":  # pytorch#163597, as upstream; a copy elsewhere
            query_states = query_states.contiguous()
            key_cache = key_cache.contiguous()
            value_cache = value_cache.contiguous()

        # the mode's implementation without attention_step's argument checks (shapes come from the model)
        n_keys = key_cache.size(2)
        if graph:  # compiled fast: the cache's window, masked inside the grouped form (shapes change at edges only)
            attn_output = grouped_window(query_states, key_cache, value_cache, position_id + 1)
        elif unmasked and attend is not None:
            attn_output = attend(query_states, key_cache, value_cache)
        elif unmasked:  # the views hold exactly the live keys
            attn_output = spec.attend(query_states, key_cache, value_cache, n_keys, bucket, None)
        else:
            length = position_id + 1  # a device tensor in voxcpm's loop: no host sync
            window = n_keys if spec.windowed else None
            attn_output = spec.attend(query_states, key_cache, value_cache, length, bucket, window)

        # (B, Hq, 1, D) -> (B, 1, Hq, D) -> (B, Hq * D)
        attn_output = attn_output.transpose(1, 2).contiguous()
        attn_output = attn_output.reshape(bsz, self.num_heads * self.head_dim)
        return self.o_proj(attn_output)

    forward_step.__fastattn__ = ("MiniCPMAttention.forward_step", mode, bucket)
    return forward_step


def slice_fix_functions() -> dict:
    """The published slice fix (seed 000, PRs #199/#395) for benchmarks, never installed: SDPA over the live keys, no
    mask; neither bit-identical to upstream nor ``fullgraph``-safe."""
    return {"MiniCPMAttention.forward_step": make_attention_forward_step("fast", None, attend=sdpa_slice),
            "MiniCPMModel.forward_step": make_model_forward_step("fast", None)}


def make_model_forward_step(mode: str, bucket):
    unmasked = not REGISTRY[mode].masked

    def forward_step(self, inputs_embeds, position_id):
        assert self.kv_cache is not None, "KV cache is not setup"
        position_emb = self.rope_emb(position_id) if self.rope_emb is not None else None
        hidden_states = inputs_embeds
        cache = self.kv_cache
        graph = unmasked and torch.compiler.is_compiling()  # compiled unmasked modes keep the window views
        cut = None if graph else _keys_for(self, cache, mode, bucket)
        if unmasked and not graph:  # tell the layers their views hold exactly the live keys
            _MODEL_STEP.cut = True
        try:
            for i, decoder_layer in enumerate(self.layers):
                k, v = cache.get_layer_cache(i)
                if cut is not None:
                    k, v = k[:, :, :cut], v[:, :, :cut]
                hidden_states = decoder_layer.forward_step(hidden_states, position_emb, position_id, (k, v))
        finally:
            if unmasked and not graph:
                _MODEL_STEP.cut = False
        return self.norm(hidden_states)

    forward_step.__fastattn__ = ("MiniCPMModel.forward_step", mode, bucket)
    return forward_step


def _keys_for(lm, cache, mode: str, bucket) -> Optional[int]:
    """Keys of the cache's views the layers get (host-side only); None: the views as they are."""
    spec = REGISTRY[mode]
    g = None
    if spec.windowed:
        if isinstance(cache, RightSizedKVCache):
            return None  # its views are already the calibrated window (changes only at granularity edges)
        k = cache.kv_cache  # upstream's StaticKVCache: this patch's granularity (calibration is memoised)
        g = cache_granularity(lm.config, k.device, k.dtype, cache.max_length, bucket)
    n = spec.keys(cache.current_length, cache.max_length, g)
    return None if n >= cache.max_length else n


def _head_dim(config) -> int:
    return config.hidden_size // config.num_attention_heads if config.kv_channels is None else config.kv_channels


def cache_granularity(config, device, dtype, max_length: int, bucket) -> int:
    """The right-sized cache's bucket: the caller's int (self-checked), the calibrated one, else the whole cache."""
    if bucket is not None:  # checked once against the full max_length call, where the layers cannot
        check_bucket_once(device, dtype, hq=config.num_attention_heads, hkv=config.num_key_value_heads,
                          head_dim=_head_dim(config), bucket=bucket, capacity=max_length)
        return bucket
    g = exact_granularity(torch.device(device), dtype, hq=config.num_attention_heads, hkv=config.num_key_value_heads,
                          head_dim=_head_dim(config), capacity=max_length, lq=1)
    return g if g is not None else -(-max_length // 16) * 16


#: LMs whose cache the patched ``setup_cache`` built (so a revert can give them upstream's back)
BUILT: weakref.WeakSet = weakref.WeakSet()


def make_setup_cache(bucket):
    def setup_cache(self, batch_size, max_length, device, dtype):
        BUILT.add(self)
        self.kv_cache = RightSizedKVCache(
            num_layers=self.config.num_hidden_layers,
            num_kv_heads=self.config.num_key_value_heads,
            dim_kv_head=_head_dim(self.config),
            batch_size=batch_size, device=device, dtype=dtype, max_length=max_length,
            bucket=cache_granularity(self.config, device, dtype, max_length, bucket),
        )

    setup_cache.__fastattn__ = ("MiniCPMModel.setup_cache", bucket)
    return setup_cache

