"""Right-sized decode cache for MiniCPM4 (voxcpm.modules.minicpm4): exactness, sizing, limits.

torch and voxcpm only. These pass on the patched package and fail on unmodified voxcpm 2.0.3,
whose StaticKVCache always holds max_length slots and has no granularity.
"""

import pytest
import torch
from voxcpm.modules.minicpm4.cache import StaticKVCache
from voxcpm.modules.minicpm4.config import MiniCPM4Config, RopeScalingConfig
from voxcpm.modules.minicpm4.model import MiniCPMModel

HIDDEN_SIZE = 64
NUM_ATTENTION_HEADS = 4
NUM_KEY_VALUE_HEADS = 2
HEAD_DIM = HIDDEN_SIZE // NUM_ATTENTION_HEADS
NUM_HIDDEN_LAYERS = 2
MAX_CACHE_LENGTH = 2048
CPU_KEY_BLOCK = 512  # torch's CPU flash-attention kernel walks keys in blocks of 512


def make_model(seed=0):
    config = MiniCPM4Config(
        bos_token_id=0,
        eos_token_id=1,
        hidden_size=HIDDEN_SIZE,
        intermediate_size=2 * HIDDEN_SIZE,
        max_position_embeddings=MAX_CACHE_LENGTH,
        num_attention_heads=NUM_ATTENTION_HEADS,
        num_hidden_layers=NUM_HIDDEN_LAYERS,
        num_key_value_heads=NUM_KEY_VALUE_HEADS,
        rms_norm_eps=1e-6,
        rope_scaling=RopeScalingConfig(
            type="longrope",
            long_factor=[1.0] * (HEAD_DIM // 2),
            short_factor=[1.0] * (HEAD_DIM // 2),
            original_max_position_embeddings=MAX_CACHE_LENGTH,
        ),
        vocab_size=16,
        scale_emb=1.0,
        dim_model_base=HIDDEN_SIZE,
        scale_depth=1.0,
        rope_theta=10_000.0,
    )
    torch.manual_seed(seed)
    return MiniCPMModel(config).eval()


def make_cache(**kwargs):
    return StaticKVCache(NUM_HIDDEN_LAYERS, NUM_KEY_VALUE_HEADS, HEAD_DIM, 1, "cpu", torch.float32,
                         max_length=MAX_CACHE_LENGTH, **kwargs)


def prefill_kv(length, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (1, NUM_KEY_VALUE_HEADS, length, HEAD_DIM)
    return [(torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in range(NUM_HIDDEN_LAYERS)]


@torch.no_grad()
def test_decode_step_is_bit_identical_to_the_full_cache_across_window_edges():
    """The window (live length rounded up to the kernel's key block, mask kept) gives the same bits as
    attending over all max_length slots, at every step from 500 to 1100 (crossing 512 and 1024)."""
    model = make_model()
    windowed, full = make_cache(), make_cache(granularity=MAX_CACHE_LENGTH)
    kv = prefill_kv(500)
    windowed.fill_caches(kv)
    full.fill_caches(kv)
    g = torch.Generator().manual_seed(1)
    for _ in range(600):
        x = torch.randn(1, HIDDEN_SIZE, generator=g)
        outs = []
        for cache in (windowed, full):
            model.kv_cache = cache
            outs.append(model.forward_step(x, torch.tensor([cache.step()])))
        assert windowed.kv_cache.size(4) % CPU_KEY_BLOCK == 0 or windowed.kv_cache.size(4) == MAX_CACHE_LENGTH
        assert full.kv_cache.size(4) == MAX_CACHE_LENGTH
        assert torch.equal(outs[0], outs[1]), windowed.current_length


@torch.no_grad()
def test_forward_step_sees_the_window_with_the_mask(monkeypatch):
    """What replaces PR #395's test: the step hands SDPA the window (a multiple of the key block) and
    keeps the mask, because only such a window is bit-identical to the full-cache call. Slicing to
    exactly position + 1 without a mask changes the kernel's key blocks and with them the rounding."""
    model = make_model()
    cache = make_cache()
    cache.fill_caches(prefill_kv(2))
    model.kv_cache = cache
    original_sdpa = torch.nn.functional.scaled_dot_product_attention
    observed = []

    def record(query, key, value, **kwargs):
        observed.append((key.size(-2), kwargs.get("attn_mask") is not None))
        return original_sdpa(query, key, value, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", record)
    model.forward_step(torch.randn(1, HIDDEN_SIZE), torch.tensor([cache.step()]))
    assert observed == [(CPU_KEY_BLOCK, True)] * NUM_HIDDEN_LAYERS


def test_cache_holds_what_the_request_needs():
    """A request holds its prefill rounded up to the key block, doubling as it decodes; a shorter
    later request shrinks it back. Capacity never exceeds max(2 x live length, key block)."""
    cache = make_cache()
    for prefill, steps in ((1500, 300), (10, 20), (700, 900)):
        cache.fill_caches(prefill_kv(prefill))
        for _ in range(steps):
            cache.step()
            capacity = cache.storage.size(4)
            assert cache.current_length <= capacity <= min(max(2 * cache.current_length, CPU_KEY_BLOCK),
                                                           MAX_CACHE_LENGTH)
    cache.fill_caches(prefill_kv(10))
    assert cache.storage.size(4) == CPU_KEY_BLOCK


def test_cache_keeps_the_prefix_and_zeroes_the_rest():
    cache = make_cache()
    cache.fill_caches(prefill_kv(900, seed=3))
    for _ in range(200):
        position = cache.step()
        k, v = cache.get_layer_cache(0)  # after step(): growing moves the storage
        k[:, :, position] = float("nan")  # a later request must never see this
    kv = prefill_kv(30, seed=4)
    cache.fill_caches(kv)
    k, v = cache.get_layer_cache(1)
    assert torch.equal(k[:, :, :30], kv[1][0]) and torch.equal(v[:, :, :30], kv[1][1])
    assert not cache.storage[..., 30:, :].any()


def test_kv_cache_full_at_max_length():
    cache = make_cache()
    cache.fill_caches(prefill_kv(MAX_CACHE_LENGTH - 2))
    assert cache.step() == MAX_CACHE_LENGTH - 2
    assert cache.step() == MAX_CACHE_LENGTH - 1
    with pytest.raises(ValueError, match="KV cache is full"):
        cache.step()
