"""Opt-in decode attention over the live keys only for MiniCPM4 (VOXCPM_DECODE_ATTENTION="live")."""

import math
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
pkg = types.ModuleType("voxcpm")
pkg.__path__ = [str(ROOT / "src" / "voxcpm")]
sys.modules.setdefault("voxcpm", pkg)

from voxcpm.modules.minicpm4 import model as minicpm  # noqa: E402
from voxcpm.modules.minicpm4.cache import StaticKVCache  # noqa: E402
from voxcpm.modules.minicpm4.config import MiniCPM4Config, RopeScalingConfig  # noqa: E402

HIDDEN_SIZE = 64
NUM_ATTENTION_HEADS = 4
NUM_KEY_VALUE_HEADS = 2
HEAD_DIM = HIDDEN_SIZE // NUM_ATTENTION_HEADS
NUM_HIDDEN_LAYERS = 2
MAX_CACHE_LENGTH = 1024
# key counts around every FlexAttention block edge (128 keys)
LENGTHS = sorted({1, MAX_CACHE_LENGTH} | {e + d for e in range(128, MAX_CACHE_LENGTH, 128) for d in (-1, 0, 1)})


def make_model(mode="masked", seed=0, dtype=torch.float32):
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
    model = minicpm.MiniCPMModel(config).eval().to(dtype)
    if mode != "masked":
        model.set_decode_attention(mode)
    return model


def prefill_kv(length, dtype, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    shape = (1, NUM_KEY_VALUE_HEADS, length, HEAD_DIM)
    return [
        (torch.randn(shape, generator=g).to(device, dtype), torch.randn(shape, generator=g).to(device, dtype))
        for _ in range(NUM_HIDDEN_LAYERS)
    ]


def filled_cache(length, dtype, seed=0, device="cpu"):
    cache = StaticKVCache(
        NUM_HIDDEN_LAYERS, NUM_KEY_VALUE_HEADS, HEAD_DIM, 1, device, dtype, max_length=MAX_CACHE_LENGTH
    )
    cache.fill_caches(prefill_kv(length, dtype, seed, device))
    return cache


def attention_at(model, length, dtype, x):
    """One decode step of layer 0 with ``length`` valid keys afterwards."""
    cache = filled_cache(length - 1, dtype)
    position_id = torch.tensor([cache.step()])
    position_emb = model.rope_emb(position_id)
    return model.layers[0].self_attn.forward_step(x, position_emb, position_id, cache.get_layer_cache(0))


def test_default_is_masked_and_the_variable_sets_every_layer(monkeypatch):
    monkeypatch.delenv("VOXCPM_DECODE_ATTENTION", raising=False)
    assert make_model().decode_attention == "masked"

    monkeypatch.setenv("VOXCPM_DECODE_ATTENTION", " Live ")
    model = minicpm.MiniCPMModel(make_model().config)

    assert model.decode_attention == "live"
    assert [layer.self_attn.decode_attention for layer in model.layers] == ["live"] * NUM_HIDDEN_LAYERS


def test_bad_value_refused_when_the_model_is_built(monkeypatch):
    config = make_model().config
    monkeypatch.setenv("VOXCPM_DECODE_ATTENTION", "sliced")

    with pytest.raises(ValueError, match="decode attention must be one of"):
        minicpm.MiniCPMModel(config)


def test_flex_attention_is_imported_only_for_live():
    code = (
        "import sys, types; pkg = types.ModuleType('voxcpm'); pkg.__path__ = [sys.argv[1]]; "
        "sys.modules['voxcpm'] = pkg; import voxcpm.modules.minicpm4.model as m; "
        "assert 'torch.nn.attention.flex_attention' not in sys.modules; m._load_flex(); "
        "assert 'torch.nn.attention.flex_attention' in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code, str(ROOT / "src" / "voxcpm")], check=True)


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_default_is_unchanged(dtype):
    """The default gives the bits of SDPA over every slot under the mask, as before."""
    model = make_model(dtype=dtype)
    attn = model.layers[0].self_attn
    g = torch.Generator().manual_seed(1)
    for length in (1, 200, 700):
        x = torch.randn(1, HIDDEN_SIZE, generator=g).to(dtype)
        got = attention_at(model, length, dtype, x)
        q = attn.q_proj(x).view(1, 1, NUM_ATTENTION_HEADS, HEAD_DIM).transpose(1, 2)
        k = attn.k_proj(x).view(1, 1, NUM_KEY_VALUE_HEADS, HEAD_DIM).transpose(1, 2)
        v = attn.v_proj(x).view(1, 1, NUM_KEY_VALUE_HEADS, HEAD_DIM).transpose(1, 2)
        cos, sin = model.rope_emb(torch.tensor([length - 1]))
        q, k = minicpm.apply_rotary_pos_emb(q, k, cos, sin)
        key_cache, value_cache = filled_cache(length - 1, dtype).get_layer_cache(0)
        key_cache[:, :, length - 1], value_cache[:, :, length - 1] = k[:, :, 0], v[:, :, 0]
        mask = (torch.arange(key_cache.size(2)) <= length - 1).view(1, 1, 1, -1)
        out = torch.nn.functional.scaled_dot_product_attention(
            q, key_cache, value_cache, attn_mask=mask, enable_gqa=True
        )
        want = attn.o_proj(out.transpose(1, 2).reshape(1, NUM_ATTENTION_HEADS * HEAD_DIM))
        assert torch.equal(got, want), length


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_live_is_as_close_to_float64_as_masked(dtype):
    """Worst error against float64 over key counts around every block edge, three weight draws: "live"
    within twice "masked"'s."""
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
def test_live_eager_step_hands_every_layer_the_slot_step_returned_as_an_int(monkeypatch):
    """Through MiniCPMModel.forward_step each layer gets the position as an int, taken from the cache: no layer
    reads the position tensor back (a device sync on CUDA)."""
    model = make_model("live")
    model.kv_cache = filled_cache(300, torch.float32)
    positions = []
    live = minicpm.live_decode_attention

    def record(*args):
        positions.append(args[4])
        return live(*args)

    monkeypatch.setattr(minicpm, "live_decode_attention", record)
    model.forward_step(torch.ones(1, HIDDEN_SIZE), torch.tensor([model.kv_cache.step()]))

    assert positions == [300] * NUM_HIDDEN_LAYERS


def decode_compiled(backend, device="cpu"):
    """Steps across three block edges through forward_step compiled with fullgraph=True, against eager steps."""
    model = make_model("live").to(device)
    step = torch.compile(model.forward_step, backend=backend, fullgraph=True)
    compiled_cache = filled_cache(1, torch.float32, device=device)
    eager_cache = filled_cache(1, torch.float32, device=device)
    g = torch.Generator().manual_seed(2)  # drawn on the CPU, then moved: the same inputs on every device
    for edge in (128, 256, 384):
        for cache in (compiled_cache, eager_cache):  # a new request whose prompt ends 6 keys before the edge
            cache.fill_caches(prefill_kv(edge - 6, torch.float32, seed=edge, device=device))
        for _ in range(12):
            x = torch.randn(1, HIDDEN_SIZE, generator=g).to(device)
            model.kv_cache = compiled_cache
            got = step(x, torch.tensor([compiled_cache.step()], device=device))
            model.kv_cache = eager_cache
            want = model.forward_step(x, torch.tensor([eager_cache.step()], device=device))
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_live_compiles_into_one_graph_for_a_whole_decode():
    """Under fullgraph=True (what optimize() uses) "live" traces FlexAttention with a block mask made from the
    position tensor: one graph serves every step, across block edges."""
    graphs = []

    def count_graphs(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.compiler.reset()
    decode_compiled(count_graphs)

    assert len(graphs) == 1


@torch.no_grad()
def test_live_compiled_step_builds_one_block_mask_for_every_layer(monkeypatch):
    """Under torch.compile the block mask is made once per step, in MiniCPMModel.forward_step, and handed to
    every layer."""
    built = []
    make_block_mask = minicpm._decode_block_mask

    def record(position_id, n_keys):
        built.append(n_keys)
        return make_block_mask(position_id, n_keys)

    monkeypatch.setattr(minicpm, "_decode_block_mask", record)
    model = make_model("live")
    model.kv_cache = filled_cache(100, torch.float32)
    torch.compiler.reset()
    step = torch.compile(model.forward_step, backend="eager", fullgraph=True)
    step(torch.ones(1, HIDDEN_SIZE), torch.tensor([model.kv_cache.step()]))

    assert len(built) == 1, built  # not one per layer


@pytest.mark.skipif(not torch.cuda.is_available(), reason="optimize() compiles on CUDA only")
@torch.no_grad()
def test_live_under_inductor_matches_eager_on_cuda():
    torch.compiler.reset()
    decode_compiled("inductor", device="cuda")


def test_block_mask_reads_only_live_blocks():
    minicpm._load_flex()
    for length in (1, minicpm.FLEX_BLOCK - 1, minicpm.FLEX_BLOCK, minicpm.FLEX_BLOCK + 1, MAX_CACHE_LENGTH):
        mask = minicpm._decode_block_mask(torch.tensor([length - 1]), MAX_CACHE_LENGTH)
        full, partial = int(mask.full_kv_num_blocks.reshape(())), int(mask.kv_num_blocks.reshape(()))

        assert full == length // minicpm.FLEX_BLOCK and partial == int(length % minicpm.FLEX_BLOCK != 0)
        assert math.ceil(length / minicpm.FLEX_BLOCK) == full + partial
        assert mask.full_kv_indices[0, 0, 0, :full].tolist() == list(range(full))
        if partial:
            assert int(mask.kv_indices[0, 0, 0, 0]) == full
        live_blocks = torch.arange(MAX_CACHE_LENGTH // minicpm.FLEX_BLOCK) <= (length - 1) // minicpm.FLEX_BLOCK
        assert torch.equal(mask.to_dense().reshape(-1).bool(), live_blocks)
