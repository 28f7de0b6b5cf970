"""Right-sized decode cache for MiniCPM4: the same bits as the whole-cache call, sizing, limits."""

import sys
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
pkg = types.ModuleType("voxcpm")
pkg.__path__ = [str(ROOT / "src" / "voxcpm")]
sys.modules.setdefault("voxcpm", pkg)

from voxcpm.modules.minicpm4 import cache as minicpm_cache  # noqa: E402
from voxcpm.modules.minicpm4.cache import StaticKVCache  # noqa: E402
from voxcpm.modules.minicpm4.config import MiniCPM4Config, RopeScalingConfig  # noqa: E402
from voxcpm.modules.minicpm4.model import MiniCPMModel  # noqa: E402

HIDDEN_SIZE = 64
NUM_ATTENTION_HEADS = 4
NUM_KEY_VALUE_HEADS = 2
HEAD_DIM = HIDDEN_SIZE // NUM_ATTENTION_HEADS
NUM_HIDDEN_LAYERS = 2
MAX_CACHE_LENGTH = 2048
CPU_KEY_BLOCK = 512
# torch >= 2.9 runs the masked grouped-query call on CPU through the flash kernel: the cache windows it there
WINDOWED = minicpm_cache.CPU_FLASH_GQA


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
    return StaticKVCache(
        NUM_HIDDEN_LAYERS, NUM_KEY_VALUE_HEADS, HEAD_DIM, 1, "cpu", torch.float32, max_length=MAX_CACHE_LENGTH, **kwargs
    )


def prefill_kv(length, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (1, NUM_KEY_VALUE_HEADS, length, HEAD_DIM)
    return [(torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in range(NUM_HIDDEN_LAYERS)]


@torch.no_grad()
def test_decode_step_matches_the_whole_cache_bit_for_bit_across_window_edges():
    """Steps across the 512 and 1024 window edges give the bits of the whole-cache call."""
    model = make_model()
    windowed, full = make_cache(), make_cache(granularity=MAX_CACHE_LENGTH)
    assert windowed.granularity == (CPU_KEY_BLOCK if WINDOWED else MAX_CACHE_LENGTH)
    g = torch.Generator().manual_seed(1)
    for prefill in (500, 1010):
        kv = prefill_kv(prefill)
        windowed.fill_caches(kv)
        full.fill_caches(kv)
        for _ in range(30):
            x = torch.randn(1, HIDDEN_SIZE, generator=g)
            outs = []
            for cache in (windowed, full):
                model.kv_cache = cache
                outs.append(model.forward_step(x, torch.tensor([cache.step()])))
            assert windowed.kv_cache.size(4) % CPU_KEY_BLOCK == 0
            assert full.kv_cache.size(4) == MAX_CACHE_LENGTH
            assert torch.equal(outs[0], outs[1]), windowed.current_length


@torch.no_grad()
def test_forward_step_attends_over_the_window_with_the_mask(monkeypatch):
    """SDPA gets the window (a multiple of the key block) and the mask, not the whole cache."""
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

    assert observed == [(CPU_KEY_BLOCK if WINDOWED else MAX_CACHE_LENGTH, True)] * NUM_HIDDEN_LAYERS


def test_cache_holds_what_the_request_needs():
    """Prefill rounded up to the key block, doubling as it decodes, shrinking for a shorter request."""
    cache = make_cache(granularity=CPU_KEY_BLOCK)
    for prefill, steps in ((1500, 300), (10, 20), (700, 900)):
        cache.fill_caches(prefill_kv(prefill))
        for _ in range(steps):
            cache.step()
            capacity = cache.storage.size(4)
            bound = min(max(2 * cache.current_length, CPU_KEY_BLOCK), MAX_CACHE_LENGTH)
            assert cache.current_length <= capacity <= bound
    cache.fill_caches(prefill_kv(10))

    assert cache.storage.size(4) == CPU_KEY_BLOCK


def test_cache_keeps_the_prefix_and_zeroes_the_rest():
    cache = make_cache(granularity=CPU_KEY_BLOCK)
    cache.fill_caches(prefill_kv(900, seed=3))
    for _ in range(200):
        position = cache.step()
        k, v = cache.get_layer_cache(0)
        k[:, :, position] = float("nan")
    kv = prefill_kv(30, seed=4)
    cache.fill_caches(kv)
    k, v = cache.get_layer_cache(1)

    assert torch.equal(k[:, :, :30], kv[1][0]) and torch.equal(v[:, :, :30], kv[1][1])
    assert not cache.storage[..., 30:, :].any()


def test_off_cpu_the_cache_is_one_tensor_of_max_length_slots():
    cache = StaticKVCache(NUM_HIDDEN_LAYERS, NUM_KEY_VALUE_HEADS, HEAD_DIM, 1, "meta", torch.float32, max_length=64)
    kv_cache = cache.kv_cache
    cache.fill_caches([(torch.zeros(1, NUM_KEY_VALUE_HEADS, 3, HEAD_DIM, device="meta"),) * 2] * NUM_HIDDEN_LAYERS)
    for _ in range(10):
        cache.step()

    assert cache.granularity == 64 and kv_cache.size(4) == 64
    assert cache.kv_cache is kv_cache is cache.storage


def test_setup_cache_can_keep_the_whole_cache_on_cpu():
    model = make_model()
    model.setup_cache(1, MAX_CACHE_LENGTH, "cpu", torch.float32, granularity=MAX_CACHE_LENGTH)

    assert model.kv_cache.granularity == MAX_CACHE_LENGTH and model.kv_cache.kv_cache.size(4) == MAX_CACHE_LENGTH


def test_kv_cache_full_at_max_length():
    cache = make_cache()
    cache.fill_caches(prefill_kv(MAX_CACHE_LENGTH - 2))

    assert cache.step() == MAX_CACHE_LENGTH - 2
    assert cache.step() == MAX_CACHE_LENGTH - 1
    with pytest.raises(ValueError, match="KV cache is full"):
        cache.step()
