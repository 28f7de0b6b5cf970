"""RightSizedKVCache: sizing, growth, prefix kept, stale values cleared, errors."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fastattn.cache import RightSizedKVCache
from fastattn.step import attention_step

pytestmark = pytest.mark.usefixtures("seeded_fast_choice")  # fast's probe, cheap (conftest)


def make(max_length=8192, bucket=256, layers=2, dtype=torch.float32, B=1):
    return RightSizedKVCache(layers, 2, 16, B, "cpu", dtype, max_length=max_length, bucket=bucket)


def prefill(cache, P, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(cache.batch_size, 2, P, 16, generator=g), torch.randn(cache.batch_size, 2, P, 16, generator=g))
            for _ in range(cache.num_layers)]


def test_same_interface_as_upstream():
    from voxcpm.modules.minicpm4.cache import StaticKVCache
    up = StaticKVCache(2, 2, 16, 1, "cpu", torch.float32, max_length=1024)
    ours = make(max_length=1024)
    kv = prefill(ours, 40)
    for c in (up, ours):
        c.fill_caches(kv)
        assert c.current_length == 40 and c.step() == 40 and c.current_length == 41 and c.max_length == 1024
    for i in range(2):
        for a, b in zip(up.get_layer_cache(i), ours.get_layer_cache(i)):
            assert torch.equal(a[:, :, : b.shape[2]], b)  # same content over our window
            assert not a[:, :, b.shape[2]:].any()  # upstream's tail is zeros


def bound(c):
    return min(max(2 * c.current_length, c.bucket), c.max_length)


@given(P=st.integers(1, 700), N=st.integers(0, 700), bucket=st.sampled_from([16, 64, 256, 512]))
def test_allocation_bound_at_every_step_and_prefix_kept(P, N, bucket):
    c = make(max_length=2048, bucket=bucket)
    kv = prefill(c, P)
    c.fill_caches(kv)
    assert c.capacity <= bound(c)
    for _ in range(N):
        p = c.step()
        assert c.capacity <= bound(c) and c.capacity >= c.current_length
        assert c.capacity % bucket == 0 or c.capacity == c.max_length
        assert c.window == min(math.ceil(max(c.current_length, 1) / bucket) * bucket, c.capacity)
        k, v = c.get_layer_cache(0)
        k[:, :, p] = float(p)  # what a decode step writes
    assert c.nbytes == 2 * 2 * 1 * 2 * c.capacity * 16 * 4
    k, v = c.get_layer_cache(1)
    assert torch.equal(k[:, :, :P], kv[1][0]) and torch.equal(v[:, :, :P], kv[1][1])
    k0, _ = c.get_layer_cache(0)
    for p in range(P, P + N):
        assert (k0[:, :, p] == float(p)).all()


def test_growth_is_geometric():
    """A long request moves its storage O(log N) times: prefill 100 + 8000 steps at granularity 512."""
    c = make(max_length=8192, bucket=512)
    c.fill_caches(prefill(c, 100))
    for _ in range(8000):
        c.step()
    assert c.generation <= 6 and c.capacity == 8192


@given(seq=st.lists(st.tuples(st.integers(1, 900), st.integers(0, 600)), min_size=1, max_size=5))
def test_bound_holds_across_request_sequences(seq):
    """A longer earlier request never makes a later short one hold more than the bound."""
    c = make(max_length=2048, bucket=256)
    for P, N in seq:
        c.fill_caches(prefill(c, P))
        assert c.capacity <= bound(c)
        for _ in range(min(N, c.max_length - P)):
            c.step()
            assert c.capacity <= bound(c)


def test_full_error_like_upstream():
    c = make(max_length=32, bucket=16)
    c.fill_caches(prefill(c, 30))
    assert c.step() == 30 and c.step() == 31
    with pytest.raises(ValueError, match="KV cache is full"):
        c.step()
    with pytest.raises(ValueError, match="KV cache is full"):
        c.fill_caches(prefill(c, 33))


def test_stale_values_never_reach_a_result():
    c = make(max_length=1024, bucket=64)
    c.fill_caches(prefill(c, 100))
    for _ in range(50):
        c.step()
    c._storage[...] = float("nan")  # poison everything an earlier request could leave
    c.fill_caches(prefill(c, 20, seed=1))
    k, v = c.get_layer_cache(0)
    assert torch.isfinite(c._storage).all()
    p = c.step()
    k, v = c.get_layer_cache(0)
    q = torch.randn(1, 4, 1, 16)
    for mode in ("reference", "exact"):
        assert torch.isfinite(attention_step(q, k, v, p + 1, mode=mode)).all()


def test_short_request_after_long_one_shrinks():
    c = make(max_length=4096, bucket=256)
    c.fill_caches(prefill(c, 2000))
    big = c.nbytes
    c.fill_caches(prefill(c, 10))
    assert c.capacity == 256 and c.nbytes * 8 == big


def test_clearing_is_only_what_was_written():
    """A full-length cache (no exact window: granularity = max_length) is never zero-filled per request."""
    c = make(max_length=1024, bucket=1024)
    c.fill_caches(prefill(c, 100))
    for _ in range(50):
        c.step()
    assert c._dirty == 150
    c._storage[..., 150:, :] = float("nan")  # past the high-water mark: never cleared, never read as live
    c.fill_caches(prefill(c, 20, seed=1))
    assert torch.isfinite(c._storage[..., :150, :]).all() and not c._storage[..., 20:150, :].any()


def test_reserve_survives_the_next_fill_only():
    c = make(max_length=4096, bucket=256)
    c.reserve(3000)
    c.fill_caches(prefill(c, 10))
    assert c.capacity == 3072  # kept for this request
    c.fill_caches(prefill(c, 10))
    assert c.capacity == 256   # the next request is sized by the policy again


def test_reserve_and_growth_generation():
    c = make(max_length=1000, bucket=256)
    assert c.capacity == 256 and c.generation == 0
    c.reserve(300)
    assert c.capacity == 512 and c.generation == 1
    c.reserve(100)  # never shrinks
    assert c.capacity == 512
    c.reserve(1000)
    assert c.capacity == 1000  # clamped to max_length
    with pytest.raises(ValueError, match="max_length is 1000"):
        c.reserve(1001)


def test_stale_view_after_growth_is_nan_not_plausible():
    c = make(max_length=1024, bucket=16)
    c.fill_caches(prefill(c, 10))
    k_old, _ = c.get_layer_cache(0)
    for _ in range(10):
        c.step()
    assert c.generation >= 1 and torch.isnan(k_old).all()


@pytest.mark.parametrize("kw,match", [
    (dict(bucket=24), "bucket must be a positive multiple of 16"),
    (dict(bucket=0), "bucket must be a positive multiple of 16"),
    (dict(max_length=0), "max_length must be a positive int"),
    (dict(num_layers=0), "num_layers must be a positive int"),
])
def test_bad_constructor(kw, match):
    args = dict(num_layers=2, num_kv_heads=2, dim_kv_head=16, batch_size=1, device="cpu", dtype=torch.float32)
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        RightSizedKVCache(**args)


def test_bad_fill_and_layer():
    c = make()
    with pytest.raises(ValueError, match=r"must hold 2 \(K, V\) pairs, one per layer; got 3"):
        c.fill_caches(prefill(c, 5) + prefill(c, 5)[:1])
    with pytest.raises(ValueError, match=r"kv_caches\[0\]\[0\] must have shape \(B=1, Hkv=2, P=5, D=16\)"):
        c.fill_caches([(torch.zeros(1, 3, 5, 16), torch.zeros(1, 3, 5, 16))] * 2)
    with pytest.raises(IndexError, match="layer_idx 2 out of range"):
        c.get_layer_cache(2)
    with pytest.raises(TypeError, match="dtype must be a torch.dtype"):
        RightSizedKVCache(1, 1, 16, 1, "cpu", "float32")


@pytest.mark.parametrize("layer,which,bad", [
    (1, 0, torch.zeros(1, 2, 7, 16)),                       # another layer's P
    (1, 1, torch.zeros(1, 2, 5, 8)),                        # V's head dim
    (0, 1, torch.zeros(1, 2, 5, 16, dtype=torch.float64)),  # dtype
    (1, 0, torch.zeros(1, 1, 5, 16)),                       # would broadcast silently
])
def test_fill_checks_every_layer_and_leaves_the_cache_as_it_was(layer, which, bad):
    c = make(max_length=2048, bucket=256)
    c.fill_caches(prefill(c, 600))
    before = (c._storage.clone(), c.capacity, c.current_length, c.generation, c.kv_cache.data_ptr())
    kv = [list(p) for p in prefill(c, 5, seed=9)]
    kv[layer][which] = bad
    with pytest.raises(ValueError, match=rf"kv_caches\[{layer}\]\[{which}\] must"):
        c.fill_caches([tuple(p) for p in kv])
    assert torch.equal(c._storage, before[0]) and (c.capacity, c.current_length, c.generation) == before[1:4]
    assert c.kv_cache.data_ptr() == before[4] and torch.isfinite(c.kv_cache).all()


def test_static_address_survives_growth():
    """For CUDA graphs the storage and the window view the layers read must stay marked static after every
    move and every window change (dynamo reads static-ness from the tensor it receives; checked on CPU)."""
    c = make(max_length=1024, bucket=16)
    c.set_static_address(True)
    c.fill_caches(prefill(c, 10))
    for _ in range(40):
        c.step()
    assert c.generation >= 2
    for t in (c._storage, c.kv_cache):
        assert getattr(t, "_dynamo_static_input_type", None) is not None


@given(seq=st.lists(st.tuples(st.integers(1, 900), st.integers(0, 700)), min_size=1, max_size=4),
       g=st.sampled_from([16, 256, 512]))
def test_upstream_diff_cache_sizes_every_request_like_the_library(seq, g):
    """One sizing policy: the diff's StaticKVCache (generated from the library's sizing functions) holds
    the same layer-view shapes, storage bytes and contents as RightSizedKVCache after every fill and step."""
    from fastattn.lab.upstream import cache_source

    ns = {}
    exec(compile(cache_source(), "upstream_cache.py", "exec"), ns)
    up = ns["StaticKVCache"](2, 2, 16, 1, "cpu", torch.float32, max_length=2048, granularity=g)
    lib = make(max_length=2048, bucket=g)

    def same():
        assert up.storage.shape == lib._storage.shape and up.storage.nbytes == lib.nbytes
        assert up.current_length == lib.current_length and up.window == lib.window
        for i in range(2):
            for a, b in zip(up.get_layer_cache(i), lib.get_layer_cache(i)):
                assert torch.equal(a, b)

    same()
    for n, (P, N) in enumerate(seq):
        kv = prefill(lib, P, seed=n)
        up.fill_caches(kv)
        lib.fill_caches(kv)
        same()
        for i in range(min(N, 2048 - P)):
            moves, window = lib.generation, lib.window
            assert up.step() == lib.step()
            for c in (up, lib):
                k, _ = c.get_layer_cache(1)
                k[:, :, c.current_length - 1] = float(c.current_length)
            if lib.generation != moves or lib.window != window or i % 64 == 0:  # every growth and window edge
                same()
        same()


def test_a_process_that_never_compiles_neither_imports_dynamo_nor_marks():
    """A patched process that never compiles does not import torch._dynamo (~30 MB of modules, sympy among
    them) to mark the window, and writes no private dynamo attribute by hand (their set is torch-specific)."""
    import subprocess
    import sys
    code = ("import sys, torch\nfrom fastattn.cache import RightSizedKVCache\n"
            "c = RightSizedKVCache(2, 2, 8, 1, torch.device('cpu'), torch.float32, max_length=64, bucket=16)\n"
            "c.fill_caches([(torch.randn(1, 2, 5, 8),) * 2] * 2)\nfor _ in range(20): c.step()\n"
            "print('torch._dynamo' in sys.modules, [k for k in vars(c.kv_cache) if 'dynamo' in k])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "[]"]


def test_window_is_marked_by_dynamos_own_function_only_where_windows_vary():
    """With dynamo loaded the window view carries exactly dynamo's own maybe_mark_dynamic marks; a cache whose
    window is always max_length (no exact window: CUDA) keeps a static view, as upstream's cache."""
    import torch._dynamo
    marks = lambda t: {k: v for k, v in vars(t).items() if "dynamo" in k}  # noqa: E731
    theirs = torch.zeros(2, 3, 1, 2, 16, 8)[..., :4, :]
    torch._dynamo.maybe_mark_dynamic(theirs, 4)
    varying = make(max_length=64, bucket=16)
    varying.fill_caches(prefill(varying, 5))
    varying.step()
    assert marks(varying.kv_cache) == marks(theirs) and marks(theirs)
    whole = make(max_length=64, bucket=64)
    whole.fill_caches(prefill(whole, 5))
    whole.step()
    assert marks(whole.kv_cache) == {}


def test_03s_stale_nan_demonstration_holds():
    """03's claim: NaN left past the length reaches the masked modes, never fast, and the right-sized cache
    clears what an earlier request wrote before the next one reads it."""
    from fastattn.lab.experiments.causality import stale_nan_check
    r = stale_nan_check(capacity=1024, length=300)
    assert r["finite_output_with_nan_past_length"] == {"reference": False, "exact": False, "fast": True}
    assert r["finite_after_rightsized_fill"] == {"reference": True, "exact": True}
