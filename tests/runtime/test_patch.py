"""patch_voxcpm on the real voxcpm: whole decodes bit-identical, reversible, guarded; the upstream diff."""

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import fastattn
from fastattn import patch as patch_mod
from fastattn.models import build_voxcpm2, load_voxcpm2
from fastattn.patch import PatchError, cache_bytes, patch_status, patch_voxcpm

from ..helpers import no_patch_leaks  # noqa: F401  (autouse: no test leaves voxcpm patched)

pytestmark = pytest.mark.usefixtures("seeded_fast_choice")  # fast's probe, cheap (conftest)

MODES_TEXT = re.escape(", ".join(map(repr, fastattn.MODES)))  # the message lists the registry

ROOT = Path(__file__).resolve().parents[2]
TEXT = "hello world this is a test sentence " * 12  # ~430 tokens: max_len cap 6x + 10 is far away
STEPS = 120  # prefill ~433 + 120 steps crosses the 512-key bucket edge (the CPU flash kernel's block)


def decode(model, steps=STEPS, streaming=False, seed=1, timesteps=2):
    torch.manual_seed(seed)
    kw = dict(min_len=steps, max_len=steps + 10, inference_timesteps=timesteps)
    if streaming:
        return torch.cat(list(model.generate_streaming(TEXT, **kw)), dim=-1)
    return model.generate(TEXT, **kw)




@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def tiny(request):
    model = build_voxcpm2("tiny", dtype=request.param)
    return model, decode(model), decode(model, streaming=True)


@pytest.mark.slow
@pytest.mark.parametrize("cache", [True, False])
def test_exact_patch_is_bit_identical_whole_decode(tiny, cache):
    model, wav, chunks = tiny
    assert model.base_lm.kv_cache.current_length > 512 + 16  # crossed a bucket edge
    with patch_voxcpm(model, mode="exact", cache=cache):
        assert torch.equal(decode(model), wav)
        assert torch.equal(decode(model, streaming=True), chunks)
        if cache:
            assert isinstance(model.base_lm.kv_cache, fastattn.RightSizedKVCache)
            assert model.base_lm.kv_cache.capacity <= 1024
    assert torch.equal(decode(model), wav)  # reverted: upstream again


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_small_preset_real_geometry_few_steps(dtype):
    model = build_voxcpm2("small", dtype=dtype)
    text = "a short sentence for the small preset"
    def run():
        torch.manual_seed(3)
        return model.generate(text, min_len=3, max_len=4, inference_timesteps=2)
    ref = run()
    with patch_voxcpm(model):
        assert torch.equal(run(), ref)


def test_models_built_after_patching_get_right_sized_caches():
    with patch_voxcpm() as h:
        m = build_voxcpm2("tiny", dtype="float32")
        assert isinstance(m.base_lm.kv_cache, fastattn.RightSizedKVCache) and h.applied
    m2 = build_voxcpm2("tiny", dtype="float32")
    assert type(m2.base_lm.kv_cache).__name__ == "StaticKVCache"


def test_fast_mode_one_step_error_within_tolerance():
    """Identical inputs, one decode step of the base LM: fast vs upstream within fp32 rounding."""
    model = build_voxcpm2("tiny", dtype="float32")
    lm = model.base_lm
    g = torch.Generator().manual_seed(0)
    P_len = 300
    h = lm.config.hidden_size
    prefill = torch.randn(1, P_len, h, generator=g)
    _, kv = lm(prefill, is_causal=True)
    x = torch.randn(1, h, generator=g)

    def one_step():
        lm.kv_cache.fill_caches(kv)
        return lm.forward_step(x, torch.tensor([lm.kv_cache.step()]))

    ref = one_step()
    with patch_voxcpm(model, mode="fast"):
        fast = one_step()
    with patch_voxcpm(model, mode="exact"):
        exact = one_step()
    assert torch.equal(exact, ref)
    rel = ((fast - ref).abs().max() / ref.abs().max()).item()
    assert 0 <= rel <= 1e-5, rel


def test_calibrated_granularity_is_reported_and_sizes_the_cache():
    fastattn.reset_exactness_cache()
    model = build_voxcpm2("tiny", dtype="float32")
    with patch_voxcpm(model) as h:
        assert h.bucket is None
        s = patch_status()
        cal = [c for c in s["calibrations"] if c["hq"] == model.base_lm.config.num_attention_heads]
        assert s["granularity"] == "calibrated" and cal and cal[0]["capacity"] == 8192
        c = model.base_lm.kv_cache
        g = cal[0]["bucket"]
        assert c.bucket == (g if g is not None else 8192)
        decode(model, steps=20)
        assert c.window % c.bucket == 0 or c.window == c.max_length  # never inside a partial kernel block


@pytest.mark.parametrize("multiple", [1024, None], ids=["1024-multiples-exact", "only-full-capacity-exact"])
def test_model_path_follows_the_calibration_of_an_order_sensitive_kernel(monkeypatch, multiple):
    """Under a kernel whose rounding depends on the key count, the default patch still decodes
    bit-identically to upstream (run under the same kernel): the calibration picks the granularity."""
    import torch.nn.functional as F

    from ..helpers import order_sensitive

    monkeypatch.setattr(F, "scaled_dot_product_attention", order_sensitive(multiple, capacity=8192))
    fastattn.reset_exactness_cache()
    model = build_voxcpm2("tiny", dtype="float32")
    ref = decode(model, steps=120)
    with patch_voxcpm(model):
        assert torch.equal(decode(model, steps=120), ref)
        assert model.base_lm.kv_cache.bucket == (multiple or 8192)
    fastattn.reset_exactness_cache()


def test_fast_layer_called_directly_with_full_views_is_not_wrong():
    """PR #395's test shape: the fast layer handed full-capacity views attends only to [0, position]."""
    model = build_voxcpm2("tiny", dtype="float32")
    lm = model.base_lm
    g = torch.Generator().manual_seed(5)
    _, kv = lm(torch.randn(1, 200, lm.config.hidden_size, generator=g), is_causal=True)
    lm.kv_cache.fill_caches(kv)
    pos = torch.tensor([lm.kv_cache.step()])
    x = torch.randn(1, lm.config.hidden_size, generator=g)
    layer, emb = lm.layers[0].self_attn, lm.rope_emb(pos)
    k, v = lm.kv_cache.get_layer_cache(0)
    assert k.shape[2] == 8192  # the whole upstream cache
    ref = layer.forward_step(x, emb, pos, (k, v))
    with patch_voxcpm(mode="fast", cache=False):
        out = layer.forward_step(x, emb, pos, (k, v))
    assert (out - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()


def test_revert_restores_identity_and_is_idempotent():
    from voxcpm.modules.audiovae import audio_vae_v2 as V
    from voxcpm.modules.minicpm4 import model as M

    def class_dicts():  # read voxcpm's classes directly, not through fastattn's table
        return {n: getattr(V if n.startswith("Streaming") else M, n.split(".")[0]).__dict__[n.split(".")[1]]
                for n in patch_mod.TARGETS}

    assert set(patch_mod.TARGETS) == {"MiniCPMAttention.forward_step", "MiniCPMModel.forward_step",
                                      "MiniCPMModel.setup_cache", "StreamingVAEDecoder.__enter__",
                                      "StreamingVAEDecoder.__exit__"}
    originals = class_dicts()
    h = patch_voxcpm()
    assert all(class_dicts()[n] is not originals[n] for n in patch_mod.TARGETS)
    inner = patch_voxcpm()  # same settings: a second holder of the same patch
    assert inner is not h and inner.applied and patch_status()["holders"] == 2
    inner.revert()
    assert h.applied and patch_status()["applied"]  # h still holds it
    with pytest.raises(PatchError, match="already patched"):
        patch_voxcpm(mode="fast")
    h.revert()
    h.revert()  # twice: no-op
    assert all(class_dicts()[n] is originals[n] for n in patch_mod.TARGETS)
    assert patch_status()["applied"] is False


def test_converted_model_works_under_upstream_after_revert():
    model = build_voxcpm2("tiny", dtype="float32")
    ref = decode(model, steps=40)
    with patch_voxcpm(model):
        pass
    assert type(model.base_lm.kv_cache).__name__ == "StaticKVCache"
    assert model.base_lm.kv_cache.kv_cache.shape[4] == 8192
    assert torch.equal(decode(model, steps=40), ref)


def test_status_reports_settings():
    with patch_voxcpm(mode="fast", cache=False):
        s = patch_status()
        assert s["applied"] and s["mode"] == "fast" and s["cache"] is False and s["verified_as"] == "2.0.3"
        assert "trades bit-identity" in s["note"]
    s = patch_status()
    assert s["applied"] is False and s["fingerprints_match"] == "2.0.3"


def test_compiled_model_is_refused():
    model = build_voxcpm2("tiny", dtype="float32")
    model.base_lm.forward_step = torch.compile(model.base_lm.forward_step, backend="eager")
    with pytest.raises(PatchError, match="optimize=False"):
        patch_voxcpm(model)
    assert patch_mod._STATE is None


def test_unknown_voxcpm_source_is_refused_unless_forced(monkeypatch):
    changed = {**patch_mod.VERIFIED["2.0.3"], "MiniCPMModel.forward_step": "0" * 16}
    monkeypatch.setattr(patch_mod, "VERIFIED", {"2.0.3": changed})
    with pytest.raises(PatchError, match=r"changed source in MiniCPMModel\.forward_step.*force=True"):
        patch_voxcpm()
    with patch_voxcpm(force=True) as h:
        assert h.verification["forced"] and h.status()["changed"] == ["MiniCPMModel.forward_step"]


def test_bad_arguments():
    with pytest.raises(ValueError, match=MODES_TEXT):
        patch_voxcpm(mode="flash")
    with pytest.raises(ValueError, match=r"bucket must be None \(calibrated\) or a positive multiple of 16"):
        patch_voxcpm(bucket=100)
    with pytest.raises(TypeError, match="base_lm"):
        patch_voxcpm(object())


def test_short_request_kv_memory_under_a_tenth():
    """Prefill ~100, 200 steps: the patched request's KV bytes are <= 1/10 of upstream's."""
    model = build_voxcpm2("tiny", dtype="bfloat16")
    text = "a b c d e f g h i j " * 5  # ~100 tokens
    def run():
        torch.manual_seed(0)
        return model.generate(text, min_len=200, max_len=210, inference_timesteps=1)
    run()
    up = cache_bytes(model)["total"]
    assert 280 <= model.base_lm.kv_cache.current_length <= 320
    with patch_voxcpm(model):
        run()
        ours = cache_bytes(model)["total"]
    assert ours * 10 <= up, (ours, up)


def _voxcpm1_tiny(dtype="float32"):
    from voxcpm.model.voxcpm import AudioVAE, AudioVAEConfig, VoxCPMConfig, VoxCPMModel

    from fastattn.models import _tokenizer, voxcpm2_config
    cfg = voxcpm2_config("tiny", dtype=dtype)
    for k in ("residual_lm_no_rope", "audio_vae_config"):
        cfg.pop(k)
    cfg["dit_config"].pop("dit_mean_mode")
    cfg["max_length"] = 4096
    torch.manual_seed(0)
    vae = AudioVAE(AudioVAEConfig(encoder_dim=8, encoder_rates=[2, 2], decoder_dim=16, decoder_rates=[2, 2]))
    m = VoxCPMModel(VoxCPMConfig.model_validate(cfg), _tokenizer(256), vae, device="cpu").eval()
    return m


@pytest.mark.slow
def test_voxcpm1_models_share_the_classes_and_stay_identical():
    m = _voxcpm1_tiny()
    def run():
        torch.manual_seed(2)
        return m.generate(TEXT, min_len=120, max_len=130, inference_timesteps=2)
    ref = run()
    with patch_voxcpm(m):
        assert isinstance(m.base_lm.kv_cache, fastattn.RightSizedKVCache)
        assert torch.equal(run(), ref)


# ------------------------------------------------------------------ models
def test_build_is_deterministic_and_real():
    from voxcpm.model.voxcpm2 import VoxCPM2Model
    a, b = build_voxcpm2("tiny", seed=5, dtype="float32"), build_voxcpm2("tiny", seed=5, dtype="float32")
    c = build_voxcpm2("tiny", seed=6, dtype="float32")
    assert isinstance(a, VoxCPM2Model)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)
    bf = build_voxcpm2("tiny")
    assert bf.base_lm.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    assert next(bf.audio_vae.parameters()).dtype == torch.float32


def test_build_bad_arguments():
    with pytest.raises(ValueError, match="preset must be one of tiny, small, full"):
        build_voxcpm2("huge")
    with pytest.raises(ValueError, match="dtype must be one of"):
        build_voxcpm2("tiny", dtype="int8")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            build_voxcpm2("tiny", device="cuda")


def test_load_voxcpm2_never_reaches_voxcpm_without_files(tmp_path, monkeypatch):
    from voxcpm.model.voxcpm2 import VoxCPM2Model
    monkeypatch.setattr(VoxCPM2Model, "from_local", classmethod(lambda *a, **k: pytest.fail("voxcpm was called")))
    with pytest.raises(FileNotFoundError, match="not an existing directory"):
        load_voxcpm2(tmp_path / "nope")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="model.safetensors or pytorch_model.bin.*audiovae"):
        load_voxcpm2(tmp_path)
    with pytest.raises(ValueError, match="checkpoint path is empty"):
        load_voxcpm2("")


# ------------------------------------------------------------------ the upstream kits
KIT_TESTS = ROOT / "data" / "upstream-tests"


def _kit_tree(dest: Path, kits) -> Path:
    """Upstream's layout: the installed 2.0.3 under ``src/`` with ``kits`` applied, the kits' tests in ``tests/``."""
    import shutil

    from fastattn.lab.upstream import patched_copy, pristine_copy
    patched_copy(dest, kits, layout="src") if kits else pristine_copy(dest, "src")
    shutil.copytree(KIT_TESTS, dest / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def _outcomes(*roots: Path) -> list:
    """One pytest session over every kit's tests in each of ``roots``, side by side: per root
    ``{file::test: passed | failed | skipped}``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VOXCPM_")}
    procs = [subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--junitxml=report.xml",
                               "--continue-on-collection-errors", "tests"], cwd=root, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env)
             for root in roots]
    return [_report(root, *p.communicate(timeout=600)) for root, p in zip(roots, procs)]


def _report(root: Path, out: str, err: str) -> dict:
    import xml.etree.ElementTree as ET
    assert (root / "report.xml").exists(), out[-3000:] + err[-2000:]
    cases = ET.parse(root / "report.xml").getroot().iter("testcase")
    tag = lambda c: next((t for t in ("failure", "error", "skipped") if c.find(t) is not None), "passed")  # noqa
    return {f"{c.get('classname').split('.')[-1]}::{c.get('name')}": tag(c).replace("failure", "failed")
            .replace("error", "failed") for c in cases}


@pytest.fixture(scope="module")
def kit_runs(tmp_path_factory):
    """Two sessions for all three kits: their tests on the three diffs stacked, and on unmodified 2.0.3."""
    from fastattn.lab.upstream import KITS
    base = tmp_path_factory.mktemp("kits")
    stacked, orig = _outcomes(_kit_tree(base / "stacked", list(KITS)), _kit_tree(base / "orig", []))
    return {"stacked": stacked, "2.0.3": orig}


def test_stored_diffs_add_the_same_lines_in_both_layouts():
    """The stored diffs (written by make docs from the kit files) add the same lines to 2.0.3 and to main; main's
    (upstream's repository) also adds the PR's test under tests/. The bench only adds files to the repository (not
    the wheel): one diff serves both."""
    import re

    from fastattn.lab.upstream import KITS, REPO_FILES
    for kit, (_, diffs, test) in KITS.items():
        wheel = (ROOT / "data" / diffs["wheel"]).read_text()
        src = (ROOT / "data" / diffs["src"]).read_text()
        assert f"+++ b/tests/{test}" in src
        if kit in REPO_FILES:
            assert diffs["src"] == diffs["wheel"] and "--- /dev/null" in src
            continue
        package = src[:re.search(r"^--- (/dev/null|a/(?!src/))", src, re.M).start()]  # then tests/, scripts/
        added = lambda d: [x for x in d.splitlines() if x.startswith("+") and not x.startswith("+++")]  # noqa: E731
        assert added(package) == added(wheel), f"data/{diffs['src']} adds other lines than the 2.0.3 diff"
        assert "tests/" not in wheel


def test_kits_apply_alone_and_stacked_in_every_order_with_no_patch_binary(tmp_path, monkeypatch):
    """Applied in Python: each kit alone gives its files; stacked in any order, the same tree (no hunk misplaced)."""
    import itertools

    from fastattn.lab.upstream import KITS, kit_sources, patched_copy
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no patch, no git
    for kit in KITS:
        root = patched_copy(tmp_path / kit, kit, layout="src")
        for rel, (_, new) in kit_sources(kit).items():
            assert (root / "src" / rel).read_text() == new, (kit, rel)
    trees = set()
    for n, order in enumerate(itertools.permutations(KITS)):
        root = patched_copy(tmp_path / f"stack{n}", order)
        trees.add(tuple(p.read_text() for p in sorted(root.rglob("*.py"))))
    assert len(trees) == 1


def test_apply_diff_refuses_a_hunk_that_is_not_there_and_writes_nothing(tmp_path):
    from fastattn.lab.upstream import DiffError, apply_diff, upstream_diff
    (tmp_path / "voxcpm" / "model").mkdir(parents=True)
    target = tmp_path / "voxcpm" / "model" / "utils.py"
    target.write_text("something else\n")
    with pytest.raises(DiffError, match=r"voxcpm/model/utils.py: hunk 1 .* does not apply"):
        apply_diff(tmp_path, upstream_diff("wheel", "cpu-dtype"))
    assert target.read_text() == "something else\n"
    with pytest.raises(DiffError, match=r"src/voxcpm/model/utils.py: no such file"):  # a tree without the file
        apply_diff(tmp_path, upstream_diff("src", "cpu-dtype"))


def test_the_dtype_pr_changes_upstreams_check_script_too():
    """Upstream's scripts/test_pick_runtime_dtype.py would fail with VOXCPM_CPU_DTYPE set in the shell: the src diff
    (stored, made against main) clears it there and adds the CPU cases; the 2.0.3 diff (the wheel) has no scripts/."""
    src = (ROOT / "data" / "voxcpm-main-src-cpu-dtype-override.diff").read_text()
    assert '+++ b/scripts/test_pick_runtime_dtype.py' in src and '+os.environ.pop("VOXCPM_CPU_DTYPE", None)' in src
    assert "scripts/" not in (ROOT / "data" / "voxcpm-2.0.3-cpu-dtype-override.diff").read_text()


@pytest.mark.slow
def test_kit_suites_pass_on_the_stacked_diffs_and_fail_on_2_0_3(kit_runs):
    """Upstream-style tests (by-path loading from src/, torch, pydantic and stubs only): all pass on the three
    kits stacked (the CUDA-only compile test skips off CUDA); on 2.0.3 every test of a new behaviour fails and the
    tests of behaviour 2.0.3 already has pass."""
    stacked, orig = kit_runs["stacked"], kit_runs["2.0.3"]
    assert len(stacked) > 20
    assert {t for t, o in stacked.items() if o != "passed"} <= {t for t in stacked if t.endswith("_on_cuda")}, stacked
    for f in KIT_TESTS.glob("test_*.py"):  # a file that reads what its diff adds fails at collection on 2.0.3
        mine = {t for t in stacked if t.startswith(f"{f.stem}::")}
        theirs = {t for t in orig if t.startswith(f"{f.stem}::")}
        uncollected = [o for t, o in orig.items() if f.stem in t and t not in theirs]
        assert theirs == mine or (not theirs and uncollected == ["failed"]), (f.name, sorted(orig))
    kept = {"test_kv_cache_full_at_max_length", "test_masked_default_is_unchanged",
            "test_pick_runtime_dtype_unchanged_when_unset", "test_pick_runtime_dtype_cpu_override_is_cpu_only",
            "test_pick_runtime_dtype_rejects_bad_override_naming_valid_ones[VOXCPM_MPS_DTYPE-mps]"}
    for test, outcome in orig.items():
        name = test.split("::")[-1]
        kept_here = name in kept or name.split("[")[0] in kept
        assert outcome == "passed" if kept_here else outcome in ("failed", "skipped"), (test, outcome)
    for f in KIT_TESTS.glob("test_*.py"):
        assert any(o == "failed" for t, o in orig.items() if f.stem in t), f.name


def test_kits_speak_upstreams_language():
    """No project names, PR numbers or private torch API in the kits' tests and patched sources."""
    from fastattn.lab.upstream import KIT_DIR, KITS, kit_sources
    tests = {p.name: p.read_text() for p in KIT_TESTS.glob("*.py")}
    sources = {f"{k}:{rel}": new for k in KITS for rel, (old, new) in kit_sources(k).items()}
    for name, text in {**tests, **sources}.items():
        assert not re.search(r"fastattn|workbook|#\d{3}|gpu-check", text), name
    for name, text in tests.items():
        assert not re.search(r"torch\._", text), name
    assert (KIT_DIR / "ruff.toml").exists()


def test_the_kits_cache_sizing_is_the_librarys():
    """One sizing policy: the right-sized kit's functions are fastattn.cache's, docstrings aside."""
    import ast
    import inspect

    from fastattn import cache
    from fastattn.lab.upstream import cache_source

    def body(tree):
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and ast.get_docstring(node):
                node.body = node.body[1:]
        return ast.dump(tree)

    kit = {n.name: n for n in ast.parse(cache_source()).body if isinstance(n, ast.FunctionDef)}
    for f in (cache.fill_capacity, cache.step_capacity, cache.window_slots):
        assert body(kit[f.__name__]) == body(ast.parse(inspect.getsource(f)).body[0]), f.__name__


def test_live_kit_imports_no_flex_attention_until_live_is_set(tmp_path):
    """``import voxcpm`` through the live diff loads no FlexAttention module; a model built with
    ``VOXCPM_DECODE_ATTENTION=live`` does."""
    from fastattn.lab.upstream import patched_copy
    root = patched_copy(tmp_path / "pkg", "decode-attention")
    flex = "torch.nn.attention.flex_attention"
    script = ("import sys, os, fastattn, voxcpm; assert voxcpm.__file__.startswith(sys.argv[1]); "
              f"print({flex!r} in sys.modules); os.environ['VOXCPM_DECODE_ATTENTION'] = 'live'; "
              "from fastattn.models import build_voxcpm2; m = build_voxcpm2('tiny', dtype='float32'); "
              f"print({flex!r} in sys.modules, m.base_lm.decode_attention, m.residual_lm.decode_attention)")
    env = {**os.environ, "PYTHONPATH": str(root)}
    r = subprocess.run([sys.executable, "-c", script, str(root)], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split()[-4:] == ["False", "True", "live", "live"], r.stdout


def test_cpu_dtype_override_reaches_the_model(tmp_path):
    """With the kit applied, VOXCPM_CPU_DTYPE=float32 makes a bf16-configured VoxCPM2Model run in float32."""
    from fastattn.lab.upstream import patched_copy
    root = patched_copy(tmp_path / "pkg", kit="cpu-dtype")
    script = ("import sys, torch; from fastattn.models import build_voxcpm2; import voxcpm; "
              "assert voxcpm.__file__.startswith(sys.argv[1]); m = build_voxcpm2('tiny', dtype='bfloat16'); "
              "print(m.config.dtype, next(m.base_lm.parameters()).dtype)")
    env = {**os.environ, "PYTHONPATH": str(root), "VOXCPM_CPU_DTYPE": "float32"}
    r = subprocess.run([sys.executable, "-c", script, str(root)], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split()[-1] == "torch.float32", r.stdout


def _needs_cpu_flash():
    """The right-sized kit's 512-slot CPU window is exact by construction only where SDPA runs the CPU flash
    kernel for this call (torch's choice, not this machine's): else the bit-identity tests skip, saying so."""
    from fastattn.exactness import CPU_FLASH_KEY_BLOCK, kernel_key_block
    block, why = kernel_key_block("cpu", torch.float32, hq=16, hkv=2, head_dim=128)
    if block != CPU_FLASH_KEY_BLOCK:
        pytest.skip(f"SDPA here is {why}: the kit's {CPU_FLASH_KEY_BLOCK}-slot windows are not exact by construction")


@pytest.mark.slow
def test_decoding_through_the_live_kit_off_is_identical_on_is_close_to_float64():
    """Notebook 04's check, the kit applied to a copy in a fresh process: the mode off decodes bit-identically to
    upstream, one attention step on is within twice off's error against float64 at every length, and the decode
    on compiles (fullgraph) into one graph per LM."""
    from fastattn.lab.upstream import live_decode_check
    r = live_decode_check("tiny", text="hello world " * 6, steps=20, dtype="float32")
    assert r["identical_off"] and r["deterministic_on"] and r["error_ratio"] <= 2, r
    assert r["rows"][-1]["unique_graphs"] == 2 and r["rows"][-1]["graph_breaks"] == 0
    assert r["max_abs_diff_on"] < 1e-3 and r["max_abs_diff_compiled"] < 1e-3


@pytest.mark.slow
def test_upstream_diff_applies_and_is_equivalent(tmp_path):
    """Decode through the right-sized diff (a patched copy, a fresh process) and compare with upstream here."""
    _needs_cpu_flash()
    from fastattn.lab.upstream import patched_copy
    root = patched_copy(tmp_path / "pkg", "right-sized")
    out = tmp_path / "out.pt"
    code = textwrap.dedent(f"""
        import torch, fastattn, voxcpm
        assert voxcpm.__file__.startswith({str(root)!r}), voxcpm.__file__
        from torch._dynamo.utils import counters
        from fastattn.models import build_voxcpm2
        text = {TEXT!r}
        res = {{}}
        for dt in ("float32", "bfloat16"):
            m = build_voxcpm2("tiny", dtype=dt)
            torch.manual_seed(1)
            res[dt] = m.generate(text, min_len={STEPS}, max_len={STEPS + 10}, inference_timesteps=2)
            res[dt + "_cap"] = m.base_lm.kv_cache.storage.shape[4]
        # upstream's optimize() path: fullgraph compile (cheap backend) over a decode crossing buckets
        m = build_voxcpm2("tiny", dtype="float32")
        m.base_lm.forward_step = torch.compile(m.base_lm.forward_step, backend="eager", fullgraph=True)
        m.residual_lm.forward_step = torch.compile(m.residual_lm.forward_step, backend="eager", fullgraph=True)
        torch.manual_seed(1)
        res["compiled"] = m.generate(text, min_len={STEPS}, max_len={STEPS + 10}, inference_timesteps=2)
        res["graphs"] = counters["stats"]["unique_graphs"]
        res["breaks"] = sum(counters["graph_break"].values())
        torch.save(res, {str(out)!r})
    """)
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = torch.load(out)
    for dt in ("float32", "bfloat16"):
        model = build_voxcpm2("tiny", dtype=dt)
        assert torch.equal(res[dt], decode(model)), dt
        assert res[dt + "_cap"] <= 1024
    assert torch.equal(res["compiled"], res["float32"])
    assert res["breaks"] == 0
    assert res["graphs"] <= 2 * 3  # two LMs, at most (windows touched + 1) graphs each


def test_cache_false_granularity_follows_each_patch_not_an_earlier_one():
    """With cache=False the layers' window over upstream's StaticKVCache is this patch's granularity:
    an earlier patch's bucket must not stay behind on the cache object."""
    from fastattn.forward import _keys_for
    model = build_voxcpm2("tiny", dtype="float32")
    lm, cache = model.base_lm, model.base_lm.kv_cache
    cache.current_length = 100
    with patch_voxcpm(model, cache=False, bucket=64):
        assert _keys_for(lm, cache, "exact", 64) == 128
    with patch_voxcpm(model, cache=False):
        calibrated = fastattn.forward.cache_granularity(lm.config, "cpu", torch.float32, cache.max_length, None)
        want = _keys_for(lm, cache, "exact", None)
        assert want == (None if calibrated >= cache.max_length else -(-100 // calibrated) * calibrated)
        assert want != 128


def test_int_bucket_is_checked_against_the_full_max_length_call(monkeypatch):
    """The patched layers only see the window, so an int bucket is checked at patch time against the
    cache's max_length call; a bucket that is not exact there warns before the decode."""
    from fastattn import exactness
    calls = []

    def fake_check(device, dtype, **kw):
        calls.append(kw)
        return {"bit_identical": False, "max_abs_diff": 1e-7, "positions_checked": 3, "first_diff_position": 17}

    monkeypatch.setattr(exactness, "check_exactness", fake_check)
    fastattn.reset_exactness_cache()
    model = build_voxcpm2("tiny", dtype="float32")
    with pytest.warns(RuntimeWarning, match="NOT bit-identical"), patch_voxcpm(model, bucket=16):
        decode(model, steps=4)
    assert {c["capacity"] for c in calls} == {model.base_lm.kv_cache.max_length} and calls[0]["bucket"] == 16
    fastattn.reset_exactness_cache()
