"""The patch never changes a running request; nested handles; revert returns every model it touched."""

import logging

import pytest
import torch

import fastattn
from fastattn import patch as patch_mod
from fastattn.models import build_voxcpm2
from fastattn.patch import PatchError, patch_status, patch_voxcpm

from ..helpers import no_patch_leaks  # noqa: F401  (autouse: no test leaves voxcpm patched)

pytestmark = pytest.mark.usefixtures("seeded_fast_choice")  # fast's probe, cheap (conftest)

TEXT = "a stream that is still running when the patch is left " * 3
KW = dict(min_len=40, max_len=40, inference_timesteps=2)




@pytest.fixture(scope="module")
def model():
    return build_voxcpm2("tiny", dtype="float32")


def stream(model, seed=3):
    torch.manual_seed(seed)
    return model.generate_streaming(TEXT, **KW)


def test_leaving_the_block_while_a_stream_runs_keeps_that_request_intact(model, caplog):
    """#1: take 10 chunks inside `with`, leave it, consume the rest: the stream equals an unpatched run."""
    ref = list(stream(model))
    with caplog.at_level(logging.WARNING, logger="fastattn"):
        with patch_voxcpm(model, mode="fast"):  # fast: a swapped cache or function would show at once
            gen = stream(model)
            head = [next(gen) for _ in range(10)]
        assert patch_status()["applied"] and patch_status()["revert_pending"]  # deferred, not dropped
        assert any("deferred" in m for m in caplog.messages)
        rest = list(gen)
    assert not patch_status()["applied"]  # the request ended: the revert completed
    with patch_voxcpm(model, mode="fast"):
        fast_ref = list(stream(model))
    assert len(head) + len(rest) == len(ref) == len(fast_ref)
    assert all(torch.equal(a, b) for a, b in zip(head + rest, fast_ref))  # the whole request ran patched
    assert type(model.base_lm.kv_cache).__name__ == "StaticKVCache"


def test_patching_while_a_decode_runs_is_refused(model):
    """#1: another thread's patch would change a running request: refused, naming why."""
    with patch_voxcpm():
        pass  # the request tracker is installed from the first patch on
    gen = stream(model)
    next(gen)
    assert patch_mod.in_flight(model) == 1
    with pytest.raises(PatchError, match="in flight"):
        patch_voxcpm(model)
    gen.close()
    assert patch_mod.in_flight(model) == 0
    with patch_voxcpm(model):
        pass


def test_nested_handles_are_counted(model):
    """#5: an inner `with` of the same settings does not revert the outer holder's patch."""
    outer = patch_voxcpm()
    with patch_voxcpm() as inner:
        assert inner is not outer and patch_status()["holders"] == 2
    assert outer.applied and patch_status()["applied"]
    outer.revert()
    outer.revert()  # idempotent per holder
    assert not patch_status()["applied"]


def test_second_models_handle_does_not_revert_the_first():
    """#5: h2.revert() lets go of h2 only; the last holder returns both models to upstream."""
    m1, m2 = build_voxcpm2("tiny", dtype="float32"), build_voxcpm2("tiny", dtype="float32", seed=1)
    h1 = patch_voxcpm(m1)
    h2 = patch_voxcpm(m2)
    h2.revert()
    assert h1.applied and isinstance(m1.base_lm.kv_cache, fastattn.RightSizedKVCache)
    h1.revert()
    for m in (m1, m2):
        assert type(m.base_lm.kv_cache).__name__ == "StaticKVCache"


def test_revert_restores_models_built_while_patched():
    """#5: a model built under the patch got a RightSizedKVCache from the patched setup_cache; revert undoes it."""
    with patch_voxcpm():
        m = build_voxcpm2("tiny", dtype="float32")
        assert isinstance(m.base_lm.kv_cache, fastattn.RightSizedKVCache)
        assert any(x["cache"] == "RightSizedKVCache" for x in patch_status()["models"])
    assert type(m.base_lm.kv_cache).__name__ == "StaticKVCache"
    assert m.base_lm.kv_cache.kv_cache.shape[4] == 8192


def test_revert_drops_fastattn_optimize_wrappers(caplog):
    """#5: a model wrapped by fastattn.optimize would keep running the traced patched code: revert drops it."""
    m = build_voxcpm2("tiny", dtype="float32")
    torch.manual_seed(0)
    ref = m.generate("hello world", min_len=8, max_len=8, inference_timesteps=2)
    with caplog.at_level(logging.WARNING, logger="fastattn"):
        with patch_voxcpm(m):
            fastattn.optimize(m, backend="eager")
            assert "forward_step" in m.base_lm.__dict__
        assert "forward_step" not in m.base_lm.__dict__ and not hasattr(m, "fastattn_compiled")
        assert any("compiled steps" in msg for msg in caplog.messages)
    torch.manual_seed(0)
    assert torch.equal(m.generate("hello world", min_len=8, max_len=8, inference_timesteps=2), ref)
