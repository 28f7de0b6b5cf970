"""Opt-in live-key decode attention for MiniCPM4 (``MiniCPM4Config.decode_attention``).

torch and voxcpm only. "masked" (the default) must stay bit-identical to the attention over every slot of
the cache; "live" must be as close to a float64 computation as "masked" is (within twice its error), and
must compile with fullgraph=True into one graph for a whole decode. These fail on unmodified voxcpm 2.0.3,
which has no decode_attention.
"""

import math

import pytest
import torch
from torch._dynamo.utils import counters
from voxcpm.modules.minicpm4.cache import StaticKVCache
from voxcpm.modules.minicpm4.config import MiniCPM4Config, RopeScalingConfig
from voxcpm.modules.minicpm4.model import MiniCPMModel, apply_rotary_pos_emb

HIDDEN_SIZE = 64
NUM_ATTENTION_HEADS = 4
NUM_KEY_VALUE_HEADS = 2
HEAD_DIM = HIDDEN_SIZE // NUM_ATTENTION_HEADS
NUM_HIDDEN_LAYERS = 2
MAX_CACHE_LENGTH = 1024
# key counts around every FlexAttention block edge (128 keys)
LENGTHS = sorted({1, MAX_CACHE_LENGTH} | {n for e in range(128, MAX_CACHE_LENGTH + 1, 128) for n in (e - 1, e, e + 1)
                                         if n <= MAX_CACHE_LENGTH})


def make_model(decode_attention=None, seed=0, dtype=torch.float32):
    extra = {} if decode_attention is None else {"decode_attention": decode_attention}
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
        **extra,
    )
    assert decode_attention is None or config.decode_attention == decode_attention
    torch.manual_seed(seed)
    return MiniCPMModel(config).eval().to(dtype)


def filled_cache(length, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (1, NUM_KEY_VALUE_HEADS, length, HEAD_DIM)
    kv = [(torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype))
          for _ in range(NUM_HIDDEN_LAYERS)]
    cache = StaticKVCache(NUM_HIDDEN_LAYERS, NUM_KEY_VALUE_HEADS, HEAD_DIM, 1, "cpu", dtype,
                          max_length=MAX_CACHE_LENGTH)
    cache.fill_caches(kv)
    return cache


def masked_layer_step(attn, hidden_states, position_emb, position_id, kv_cache):
    """The attention step as voxcpm 2.0.3 computes it: every slot of the cache under a bool mask."""
    bsz, _ = hidden_states.size()
    q = attn.q_proj(hidden_states).view(bsz, 1, attn.num_heads, attn.head_dim).transpose(1, 2)
    k = attn.k_proj(hidden_states).view(bsz, 1, attn.num_key_value_heads, attn.head_dim).transpose(1, 2)
    v = attn.v_proj(hidden_states).view(bsz, 1, attn.num_key_value_heads, attn.head_dim).transpose(1, 2)
    cos, sin = position_emb
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    key_cache, value_cache = kv_cache
    key_cache[:, :, position_id, :] = k
    value_cache[:, :, position_id, :] = v
    mask = (torch.arange(key_cache.size(2)) <= position_id).view(1, 1, 1, -1)
    out = torch.nn.functional.scaled_dot_product_attention(q, key_cache.contiguous(), value_cache.contiguous(),
                                                           attn_mask=mask, enable_gqa=True)
    return attn.o_proj(out.transpose(1, 2).reshape(bsz, attn.num_heads * attn.head_dim))


def attention_at(model, length, dtype, x):
    """One decode step of layer 0 with ``length`` valid keys afterwards: (output, cos/sin, cache views)."""
    cache = filled_cache(length - 1, dtype)
    position_id = torch.tensor([cache.step()])
    position_emb = model.rope_emb(position_id)
    return model.layers[0].self_attn.forward_step(x, position_emb, position_id, cache.get_layer_cache(0))


def test_default_is_masked():
    assert make_model().config.decode_attention == "masked"


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_default_is_bit_identical_to_the_full_cache_call(dtype):
    model = make_model(dtype=dtype)
    g = torch.Generator().manual_seed(1)
    for length in (1, 200, 700):
        x = torch.randn(1, HIDDEN_SIZE, generator=g).to(dtype)
        cache = filled_cache(length - 1, dtype)
        position_id = torch.tensor([cache.step()])
        position_emb = model.rope_emb(position_id)
        attn = model.layers[0].self_attn
        got = attn.forward_step(x, position_emb, position_id, cache.get_layer_cache(0))
        want = masked_layer_step(attn, x, position_emb, position_id, filled_cache(length - 1, dtype).get_layer_cache(0))
        assert torch.equal(got, want), length


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_live_is_as_close_to_float64_as_masked(dtype):
    """Max error against float64 over key counts around every block edge, three weight draws: "live" within
    twice "masked"'s."""
    worst = {"live": 0.0, "masked": 0.0}
    for seed in range(3):
        truth_model = make_model("masked", seed=seed, dtype=torch.float64)
        models = {mode: make_model(mode, seed=seed, dtype=dtype) for mode in worst}
        g = torch.Generator().manual_seed(seed)
        for length in LENGTHS:
            x = torch.randn(1, HIDDEN_SIZE, generator=g)
            truth = attention_at(truth_model, length, torch.float64, x.double())
            for mode, model in models.items():
                err = (attention_at(model, length, dtype, x.to(dtype)).double() - truth).abs().max().item()
                worst[mode] = max(worst[mode], err)
    assert worst["live"] <= 2 * worst["masked"] + 1e-12, worst


@torch.no_grad()
@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_live_compiles_into_one_graph_for_a_whole_decode(backend):
    """optimize() compiles forward_step with fullgraph=True: "live" traces FlexAttention with a block mask built
    from the position tensor, so 300 steps across block edges reuse one graph and match the eager steps."""
    model = make_model("live")
    step = torch.compile(model.forward_step, backend=backend, fullgraph=True)
    cache = filled_cache(100, torch.float32)
    model.kv_cache = cache
    torch._dynamo.reset()
    counters.clear()
    g = torch.Generator().manual_seed(2)
    for i in range(300):
        x = torch.randn(1, HIDDEN_SIZE, generator=g)
        position_id = torch.tensor([cache.step()])
        eager_cache = [(k.clone(), v.clone()) for k, v in (cache.get_layer_cache(i) for i in range(NUM_HIDDEN_LAYERS))]
        try:
            got = step(x, position_id)
        except Exception as exc:  # noqa: BLE001
            if i == 0 and backend == "inductor" and "same buffer" in str(exc):
                pytest.skip("this torch's CPU FlexAttention lowering refuses K and V views of one buffer (the KV "
                            "cache's layout; torch 2.13's accepts it, CUDA's has no such check); optimize() "
                            "compiles on CUDA only")
            if i == 0 and backend == "inductor" and "not supported for CPU" in str(exc):
                pytest.skip("inductor lowers FlexAttention on CPU only over AVX2 or AVX-512 kernels; optimize() "
                            "compiles on CUDA only")
            raise
        model.kv_cache = _Views(eager_cache)
        want = model.forward_step(x, position_id)
        model.kv_cache = cache
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1
    assert sum(counters["graph_break"].values()) == 0


class _Views:
    """A stand-in cache holding copies of the layer views (the eager step writes its own copy)."""

    def __init__(self, layers):
        self.layers = layers

    def get_layer_cache(self, i):
        return self.layers[i]


@torch.no_grad()
def test_bad_value_refused():
    with pytest.raises(ValueError):
        make_model("sliced")
    model = make_model()
    model.config.decode_attention = "sliced"  # assignment is not validated by the config
    cache = filled_cache(4, torch.float32)
    model.kv_cache = cache
    with pytest.raises(ValueError, match="decode_attention must be 'masked' or 'live'"):
        model.forward_step(torch.randn(1, HIDDEN_SIZE), torch.tensor([cache.step()]))


def test_flex_block_mask_reads_only_live_blocks():
    from voxcpm.modules.minicpm4.model import FLEX_BLOCK, _decode_block_mask

    for length in (1, FLEX_BLOCK - 1, FLEX_BLOCK, FLEX_BLOCK + 1, MAX_CACHE_LENGTH):
        mask = _decode_block_mask(torch.tensor([length - 1]), MAX_CACHE_LENGTH)
        full, partial = int(mask.full_kv_num_blocks.reshape(())), int(mask.kv_num_blocks.reshape(()))
        assert full == length // FLEX_BLOCK and partial == int(length % FLEX_BLOCK != 0)
        assert (full + partial) * FLEX_BLOCK >= length and math.ceil(length / FLEX_BLOCK) == full + partial
        # which blocks: the full ones from 0, then the one holding the last key (eager FlexAttention ignores
        # the indices, compiled kernels read only these)
        assert mask.full_kv_indices[0, 0, 0, :full].tolist() == list(range(full))
        if partial:
            assert int(mask.kv_indices[0, 0, 0, 0]) == full
        live_blocks = torch.arange(MAX_CACHE_LENGTH // FLEX_BLOCK) <= (length - 1) // FLEX_BLOCK
        assert torch.equal(mask.to_dense().reshape(-1).bool(), live_blocks)
