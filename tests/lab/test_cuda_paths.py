"""The CUDA branches, exercised on CPU: each device-conditional piece of logic fed what a GPU gives it
(reasons on C++ stderr, an L2 size, a device index, cudagraph skips), so a GPU box runs tested code."""

import os
import warnings

import pytest
import torch

from fastattn.lab import bench
from fastattn.lab.bench.floor import bandwidth_line, floor_binds, llc_bytes

pytestmark = pytest.mark.usefixtures("seeded_fast_choice")  # fast's probe, cheap (conftest)


def test_native_warnings_are_read_from_fd2():
    """torch's can_use_* bindings print their reasons with c10's handler on C++ stderr, not Python warnings."""
    from fastattn.backends import call_capturing_native_stderr, native_warnings

    def binding():
        os.write(2, b"[W1201 10:00:00.000000 42 aten/src/ATen/native/transformers/cuda/sdp_utils.cpp:690] Warning: "
                    b"Flash attention does not support non-null attn_mask. (function check_for_attn_mask)\n")
        os.write(2, b"unrelated line\n")
        return False
    ok, text = call_capturing_native_stderr(binding)
    assert ok is False
    assert native_warnings(text) == ["Flash attention does not support non-null attn_mask."]


def test_cuda_eligibility_collects_the_bindings_stderr(monkeypatch):
    from fastattn import backends
    cb = torch.backends.cuda

    def refuse(params, debug):
        os.write(2, b"[W sdp_utils.cpp:1] Warning: Mem efficient attention requires no GQA. (function f)\n")
        return False
    for name in ("can_use_flash_attention", "can_use_efficient_attention", "can_use_cudnn_attention"):
        monkeypatch.setattr(cb, name, refuse)
    q, k = torch.randn(1, 16, 1, 64), torch.randn(1, 2, 32, 64)
    e = backends._eligibility_cuda(q, k, k, None, False, True)
    assert e["EFFICIENT_ATTENTION"] == {"eligible": False, "reason": "Mem efficient attention requires no GQA."}
    assert e["MATH"]["eligible"]


def test_gpu_last_level_cache_is_its_l2(monkeypatch):
    class Props:
        L2_cache_size = 60 * 2**20
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: Props())
    assert llc_bytes("cuda") == 60 * 2**20
    assert floor_binds(1000, 36, None) is None and floor_binds(2**20, 36, 30 * 2**20) is True
    line = bandwidth_line({"gb_per_s": 4000.0, "llc_bytes": None})
    assert "unknown" in line and "4000.0 GB/s" in line
    assert "GPU L2: 60 MiB" in bandwidth_line({"gb_per_s": 4000.0, "llc_bytes": 60 * 2**20, "llc_kind": "GPU L2"})


def test_cudagraph_skips_and_their_reasons_are_counted():
    """inductor's cudagraph trees log why they ran a compiled function without CUDA graphs; graph_counts says."""
    from torch._inductor.cudagraph_utils import log_cudagraph_skip_and_bump_counter

    from fastattn.graphs import graph_counts, reset_graph_counts
    reset_graph_counts()
    log_cudagraph_skip_and_bump_counter("skipping cudagraphs due to mutated inputs (1 instances)")
    g = graph_counts()
    assert g["cudagraph_skips"] == 1 and g["cudagraph_skip_reasons"] == [
        "skipping cudagraphs due to mutated inputs (1 instances)"]
    assert "recompiles" not in g  # torch never writes that counter: reporting 0 would be a false claim
    import logging
    logging.getLogger("torch._inductor.cudagraph_utils.__cudagraphs").warning(
        "CUDAGraph supports dynamic shapes by recording a new graph for each distinct input size. ... We have "
        "observed 9 distinct sizes.")  # a warning on the same logger that is not a skip
    assert graph_counts()["cudagraph_skip_reasons"] == g["cudagraph_skip_reasons"]
    reset_graph_counts()
    assert graph_counts()["cudagraph_skips"] == 0 and graph_counts()["cudagraph_skip_reasons"] == []


def test_a_chosen_cuda_index_becomes_the_current_device(monkeypatch):
    from fastattn.lab.gpucheck import select_device
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    assert select_device("cuda:1") == torch.device("cuda") and chosen == [1]
    assert select_device("cpu") == torch.device("cpu") and chosen == [1]


def test_a_cuda_build_without_usable_cuda_is_said_loudly(monkeypatch):
    from fastattn import devices
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(devices, "_WARNED_NO_CUDA", [])
    assert "built for CUDA 13.0" in devices.cuda_build_without_cuda()
    with pytest.warns(RuntimeWarning, match="runs on CPU"):
        assert devices.resolve_device("auto") == torch.device("cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        devices.resolve_device("auto")  # once per process


def test_priority_order_names():
    from fastattn.lab.doctor import priority_names
    assert priority_names([3, 1, 2, 0]) == ["CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH"]


def test_probe_only_candidates_are_measured_never_chosen():
    """sdpa_kernel flips process-wide flags: a forced candidate is reported, never put on the decode path."""
    from fastattn.fast import PROBE_ONLY, choose_fast, sdpa_slice
    assert "sdpa_flash" in PROBE_ONLY
    seen = []

    def forced(q, k, v):
        seen.append(k.shape[2])
        return sdpa_slice(q, k, v)
    ch = choose_fast("cpu", torch.float32, hq=4, hkv=2, head_dim=16, length_class="keys<=512",
                     candidates={"sdpa_slice": (sdpa_slice, ("cpu",)), "sdpa_flash": (forced, ("cpu",))})
    assert ch["winner"] == "sdpa_slice"
    row = next(r for r in ch["candidates"] if r["candidate"] == "sdpa_flash")
    assert row["probe_only"] and row["median_ms"] is not None
    timed = seen[2:]  # after the two accuracy calls: one call per probe length per sample, never a key count twice
    assert len(timed) == len(set(timed)) > 2


def test_memory_measures_the_cache_the_device_really_keeps():
    """Where no window is exact (CUDA), the patched cache holds every slot: the KV and growth figures say so and
    the targets do not judge them (here forced on CPU with a granularity of max_length)."""
    kv = bench.kv_memory("tiny", prefill=10, steps=20, dtype="float32", max_length=1024, bucket=1024)
    assert kv["right_sized"] is False and kv["ratio"] == 1.0 and "holds all 1024 slots" in kv["note"]
    growth = bench.cache_growth("tiny", prefill=10, steps=50, dtype="float32", max_length=1024, bucket=1024)
    assert growth["summary"]["right_sized"] is False and growth["summary"]["moves"] == 0
    rows = {t["id"]: t for t in bench.check_targets({"kv": kv, "growth": growth})}
    assert {rows[g]["passed"] for g in ("kv_bytes", "growth_time", "growth_moves", "capacity_bound")} == {None}
    sized = bench.kv_memory("tiny", prefill=10, steps=20, dtype="float32", max_length=1024)
    assert sized["right_sized"] is True and sized["params"]["bucket"] == 512  # what the patch picks on CPU


def test_decode_step_times_the_published_slice_fix_beside_the_patch():
    rec = bench.decode_step_sweep([0, 40], preset="tiny", dtype="float32", repeats=2, warmup=1, progress=False,
                                  slice_fix=True, max_length=1024)
    assert {r["variant"] for r in rec["rows"]} == {"upstream", "patched", "slice_fix"}
    assert all(r["bit_identical"] for r in rec["rows"] if r["variant"] == "patched")
    assert rec["params"]["granularity"] == 512 and rec["params"]["variants"][-1] == "slice_fix"


def test_stream_chunks_times_every_chunk_with_its_counters():
    from fastattn.lab.gpucheck import stream_chunks, upstream_optimized
    from fastattn.models import build_voxcpm2, silence_progress
    model = build_voxcpm2("tiny", dtype="float32")
    silence_progress()
    with pytest.raises(RuntimeError, match="did not compile"):
        upstream_optimized(model)  # voxcpm's optimize() runs eagerly off CUDA: never mistaken for compiled
    rows = stream_chunks(model, 8, text="hello world " * 8, recordings=lambda d: 0)
    assert [r["chunk"] for r in rows] == list(range(8))
    assert all(r["ms"] > 0 and {"unique_graphs", "cudagraph_skips", "cudagraph_recordings"} <= set(r) for r in rows)


def test_cuda_allocations_are_counted_by_the_caching_allocator(monkeypatch):
    """The profiler's CPU activity sees no CUDA allocation: on CUDA the allocator's counters are read instead."""
    from fastattn.lab.bench.memory import _cuda_allocations
    stats = iter([{"allocated_bytes.all.current": 1000, "allocation.all.allocated": 10},
                  {"allocated_bytes.all.peak": 5000, "allocation.all.allocated": 13}])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d=None: None)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda d=None: next(stats))
    got = _cuda_allocations(lambda: None, "cuda")
    assert got["allocated_bytes"] == 4000 and got["allocations"] == 3 and got["counted_by"] == "torch.cuda.memory_stats"


def test_cudagraph_recordings_read_the_tree_managers_counter(monkeypatch):
    import itertools

    import torch._inductor.cudagraph_trees as trees

    from fastattn.graphs import cudagraph_recordings

    class Manager:
        graph_counter = itertools.count(5)
    asked = []
    monkeypatch.setattr(trees, "get_manager", lambda i, create_if_none_exists=True: asked.append(i) or Manager())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)  # after select_device("cuda:1"): plain "cuda"
    assert cudagraph_recordings("cuda") == 5 and next(Manager.graph_counter) == 5  # read, not consumed
    assert cudagraph_recordings("cuda:2") == 6 and asked == [1, 2]  # the current device's tree, not device 0's
    monkeypatch.setattr(trees, "get_manager", lambda index, create_if_none_exists=True: None)
    assert cudagraph_recordings("cuda") is None


def test_priority_order_is_read_after_a_selection():
    from fastattn.lab.doctor import sdp_priority_order
    order = sdp_priority_order("cpu")
    assert order is None or {"FLASH_ATTENTION", "MATH"} <= set(order)


def test_a_cache_that_keeps_every_slot_says_so():
    from fastattn import RightSizedKVCache
    whole = RightSizedKVCache(2, 2, 16, 1, "cpu", torch.float32, max_length=64, bucket=64)
    sized = RightSizedKVCache(2, 2, 16, 1, "cpu", torch.float32, max_length=64, bucket=16)
    assert (whole.windowed, whole.granularity) == (False, None) and (sized.windowed, sized.granularity) == (True, 16)


def test_both_caches_are_marked_static_alike():
    """CUDA graphs need the tensor each compiled step mutates at a static address: upstream's one tensor, the
    right-sized cache's storage and window view (a compiled-step comparison marks both, never one)."""
    from voxcpm.modules.minicpm4.cache import StaticKVCache

    from fastattn import RightSizedKVCache
    from fastattn.graphs import mark_cache_static
    up = StaticKVCache(2, 2, 16, 1, "cpu", torch.float32, max_length=64)
    ours = RightSizedKVCache(2, 2, 16, 1, "cpu", torch.float32, max_length=64, bucket=16)
    for c in (up, ours, None):
        mark_cache_static(c)
    marked = lambda t: getattr(t, "_dynamo_static_input_type", None) is not None  # noqa: E731
    assert marked(up.kv_cache) and marked(ours._storage) and marked(ours.kv_cache)


def test_cudnn_on_a_bool_mask_is_named_before_the_where_it_also_shows(monkeypatch):
    """A CUDA profile where cuDNN ran a bool-masked call (its own conversion shows an ``aten::where`` too): the note
    names cuDNN's conversion, not the generic one."""
    from fastattn import backends
    ops = ["aten::where", "aten::_scaled_dot_product_cudnn_attention"]
    monkeypatch.setattr(backends, "_run_profiled", lambda call: ops)
    monkeypatch.setattr(backends, "_choice", lambda *a: "CUDNN_ATTENTION")
    q, k, v = (torch.randn(1, 2, n, 8) for n in (1, 16, 16))
    notes = backends.explain_sdpa(q, k, v, attn_mask=torch.ones(1, 1, 1, 16, dtype=torch.bool)).notes
    assert "cuDNN converts the bool mask" in notes[0] and not any("aten::where" in n for n in notes)


def test_peak_memory_reads_cudas_allocator_on_cuda(monkeypatch):
    """bench.rss_probe's CUDA branch, fed a fake allocator on CPU: the peak is reset and read from torch.cuda, never
    from the process's RSS."""
    from fastattn.lab.bench import rss_probe
    calls = []
    monkeypatch.setattr(rss_probe.torch.cuda, "reset_peak_memory_stats", lambda *a: calls.append("reset"))
    monkeypatch.setattr(rss_probe.torch.cuda, "max_memory_allocated", lambda *a: calls.append("peak") or 123)
    assert rss_probe.reset_peak("cuda:0") is True and calls == ["reset"]
    assert rss_probe.peak("cuda:0") == 123 and calls == ["reset", "peak"]
    cpu = rss_probe.peak("cpu")  # the CPU reads the process's VmHWM (None off Linux), never the allocator
    assert calls == ["reset", "peak"]
    assert cpu is None or cpu > 0


def test_trim_empties_cudas_cache_on_cuda_only(monkeypatch):
    """bench.rss_probe.trim's CUDA branch, fed a fake allocator on CPU: a CUDA device's cache is handed back too."""
    from fastattn.lab.bench import rss_probe
    calls = []
    monkeypatch.setattr(rss_probe.torch.cuda, "empty_cache", lambda: calls.append("empty"))
    rss_probe.trim("cpu")
    rss_probe.trim()
    assert calls == []
    rss_probe.trim(torch.device("cuda", 0))
    assert calls == ["empty"]
