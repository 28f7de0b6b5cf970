"""Graph safety: the patched exact step compiles with fullgraph=True once across many buckets.

In this process, each case from a fresh tiny model with dynamo reset and its counters zeroed (the patch reverted and
class functions restored after it), so the counts are the case's own.
"""

import io
import logging

import pytest
import torch

from fastattn import fast as FA
from fastattn.graphs import graph_counts, optimize, reset_graph_counts
from fastattn.models import build_voxcpm2, silence_progress
from fastattn.patch import patch_voxcpm

pytestmark = pytest.mark.usefixtures("seeded_fast_choice")  # fast's probe, cheap (conftest)

TEXT = "hello world " * 4  # ~50 prefill tokens
STEPS = 64                 # 16-slot buckets: 4 or more windows crossed while decoding
BUCKET = 16


@pytest.fixture
def m():
    """A fresh tiny model; every patch a case applies is reverted after it."""
    torch._dynamo.reset()
    reset_graph_counts()
    silence_progress()
    model, handles = build_voxcpm2("tiny", dtype="float32"), []
    model.patch = lambda **kw: handles.append(patch_voxcpm(model, **kw))
    yield model
    for h in reversed(handles):
        h.revert()
    torch._dynamo.reset()


def run(m, steps=STEPS):
    torch.manual_seed(0)
    return m.generate(TEXT, min_len=steps, max_len=steps + 10, inference_timesteps=2)  # 2: the DiT runs


def compile_steps(m, backend="eager"):
    for lm in (m.base_lm, m.residual_lm):
        lm.forward_step = torch.compile(lm.forward_step, fullgraph=True, backend=backend)


def windows_crossed(m) -> int:
    """Bucket edges the decode crossed (from the prefill's window to the last one): a recompile per bucket would
    add a graph per LM at each."""
    return m.base_lm.kv_cache.current_length // BUCKET - (m.base_lm.kv_cache.current_length - STEPS) // BUCKET


@pytest.mark.slow
def test_patched_exact_step_is_one_graph_across_buckets(m):
    m.patch(bucket=BUCKET)
    eager = run(m)
    compile_steps(m)
    out = run(m)
    g = graph_counts()
    assert g["graph_breaks"] == 0 and torch.equal(out, eager)
    assert windows_crossed(m) >= 4
    assert g["unique_graphs"] <= 2 * 2  # two LMs, each at most (1 static + 1 dynamic) graphs, never per bucket


@pytest.mark.slow
def test_contrast_upstream_compiles_static_and_the_naive_slice_fix_breaks_fullgraph(m, monkeypatch):
    m.base_lm.forward_step = torch.compile(m.base_lm.forward_step, fullgraph=True, backend="eager")
    run(m, steps=20)
    g = graph_counts()
    assert g["unique_graphs"] == 1 and g["graph_breaks"] == 0  # static shapes: one graph, O(8192) work
    # seed 000's fix: slice the cache by the tensor position (what PR #199 does)
    from voxcpm.modules.minicpm4 import model as M

    from fastattn.lab.experiments.patch_application import naive_slice_forward_step
    monkeypatch.setattr(M.MiniCPMAttention, "forward_step", naive_slice_forward_step)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="(?i)data-dependent"):
        run(m, steps=20)


@pytest.mark.slow
def test_optimize_falls_back_to_eager_with_one_warning(m):
    stream, logger = io.StringIO(), logging.getLogger("fastattn")
    handler = logging.StreamHandler(stream)
    logger.addHandler(handler)
    try:
        m.patch()
        eager = run(m, steps=12)

        def broken(gm, example_inputs):
            raise RuntimeError("no C++ compiler here")
        optimize(m, backend=broken)
        assert torch.equal(run(m, steps=12), eager) and torch.equal(run(m, steps=12), eager)
    finally:
        logger.removeHandler(handler)
    assert sorted(m.fastattn_compiled["failed"]) == ["base_lm", "feat_decoder", "feat_encoder", "residual_lm"]
    assert stream.getvalue().count("failed") == 4  # once per component, not per call


@pytest.mark.slow
def test_optimize_aot_eager_equals_eager_patched(m):
    m.patch(bucket=BUCKET)
    eager = run(m)
    optimize(m, backend="aot_eager")
    out = run(m)
    g = graph_counts()
    assert torch.equal(out, eager) and g["graph_breaks"] == 0 and not m.fastattn_compiled["failed"]
    assert g["unique_graphs"] <= 4 + 2  # four components; the LM steps at most one extra (dynamic) graph each


@pytest.mark.slow
def test_patched_fast_step_compiles_into_one_graph_across_buckets(m, monkeypatch):
    """Graph-safe fast: under compile the layers take the cache's window with the mask inside the grouped form.
    (fast's eager choice is stubbed to the slice: its probe is not what this test is about.)"""
    monkeypatch.setattr(FA, "choose_fast", lambda *a, **k: {"winner": "sdpa_slice", "candidates": []})
    FA.reset_fast_cache()
    m.patch(mode="fast", bucket=BUCKET)
    eager = run(m)
    compile_steps(m)
    out = run(m)
    g = graph_counts()
    FA.reset_fast_cache()
    assert g["graph_breaks"] == 0 and windows_crossed(m) >= 4
    assert g["unique_graphs"] <= 2 * 2
    assert (out - eager).abs().max().item() <= 0.05 * eager.abs().max().item()  # fast drifts within rounding
