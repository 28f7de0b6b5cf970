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

from .helpers import no_patch_leaks  # noqa: F401  (autouse: no test leaves voxcpm patched)

MODES_TEXT = re.escape(", ".join(map(repr, fastattn.MODES)))  # the message lists the registry

ROOT = Path(__file__).resolve().parents[1]
TEXT = "hello world this is a test sentence " * 12  # ~430 tokens: max_len cap 6x + 10 is far away
STEPS = 300  # prefill ~433 + 300 steps crosses the 512 bucket edge (and 768)


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
        return model.generate(text, min_len=6, max_len=8, inference_timesteps=2)
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

    from .helpers import order_sensitive

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
    from voxcpm.modules.minicpm4 import model as M

    def class_dicts():  # read voxcpm's classes directly, not through fastattn's table
        return {n: getattr(M, n.split(".")[0]).__dict__[n.split(".")[1]] for n in patch_mod.TARGETS}

    assert set(patch_mod.TARGETS) == {"MiniCPMAttention.forward_step", "MiniCPMModel.forward_step",
                                      "MiniCPMModel.setup_cache"}
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


# ------------------------------------------------------------------ the upstream diff
def test_stored_diffs_are_current():
    from fastattn.upstream import LAYOUTS, upstream_diff
    for layout, (name, prefix) in LAYOUTS.items():
        text = (ROOT / "data" / name).read_text()
        assert text == upstream_diff(layout), f"data/{name} is stale: run python -m fastattn diff --write"
        assert f"+++ b/{prefix}voxcpm/modules/minicpm4/cache.py" in text


def test_src_layout_diff_applies_to_upstreams_tree(tmp_path):
    import shutil

    import voxcpm
    shutil.copytree(Path(voxcpm.__file__).parent, tmp_path / "src" / "voxcpm",
                    ignore=shutil.ignore_patterns("__pycache__"))
    diff = ROOT / "data" / "voxcpm-main-src-right-sized-decode.diff"
    r = subprocess.run(["patch", "-p1", "--batch", "-i", str(diff)], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    from fastattn.upstream import cache_source
    assert (tmp_path / "src/voxcpm/modules/minicpm4/cache.py").read_text() == cache_source()


UPSTREAM_TESTS = ROOT / "data" / "upstream-tests"
RUN_UPSTREAM_TESTS = (
    "import os, sys; import fastattn.compat as c; c.ensure_torchaudio(); import pytest, voxcpm; "
    "assert voxcpm.__file__.startswith(sys.argv[1]), voxcpm.__file__; "
    "sys.exit(pytest.main([sys.argv[2], '-q', '-p', 'no:cacheprovider', '--rootdir', os.path.dirname(sys.argv[2]), "
    "'-c', os.devnull]))"
)


def _run_upstream_tests(pkg_root, kit="right-sized"):
    from fastattn.upstream import KITS
    env = {**os.environ, "PYTHONPATH": str(pkg_root)}
    test_file = UPSTREAM_TESTS / KITS[kit][2]
    return subprocess.run([sys.executable, "-c", RUN_UPSTREAM_TESTS, str(pkg_root), str(test_file)],
                          capture_output=True, text=True, env=env, timeout=600)


@pytest.mark.slow
def _diff_granularity_is_this_torchs_key_block():
    """The diff's fixed CPU granularity is exact by construction only where SDPA runs the CPU flash kernel
    with that key block (torch's kernel, not this machine): check it, else the bit-identity tests skip."""
    from fastattn.exactness import CPU_FLASH_KEY_BLOCK, kernel_key_block
    block, why = kernel_key_block("cpu", torch.float32, hq=16, hkv=2, head_dim=128)
    if block != CPU_FLASH_KEY_BLOCK:
        pytest.skip(f"SDPA here is {why}: the diff's {CPU_FLASH_KEY_BLOCK}-slot windows are not exact by construction")


def test_upstream_tests_pass_on_the_diff_and_fail_on_2_0_3(tmp_path):
    """The kit's tests (torch and voxcpm only, upstream's style) against the patched copy and the original."""
    import shutil
    _diff_granularity_is_this_torchs_key_block()

    import voxcpm

    from fastattn.upstream import patched_copy
    assert "fastattn" not in "".join(p.read_text() for p in UPSTREAM_TESTS.glob("*.py"))
    patched = _run_upstream_tests(patched_copy(tmp_path / "patched"))
    assert patched.returncode == 0, patched.stdout[-3000:] + patched.stderr[-2000:]
    n_tests = (UPSTREAM_TESTS / "test_minicpm4_right_sized_cache.py").read_text().count("\ndef test_")
    assert f"{n_tests} passed" in patched.stdout
    shutil.copytree(Path(voxcpm.__file__).parent, tmp_path / "orig" / "voxcpm",
                    ignore=shutil.ignore_patterns("__pycache__"))
    original = _run_upstream_tests(tmp_path / "orig")
    assert original.returncode == 1 and " failed" in original.stdout, original.stdout[-3000:]


def test_cpu_dtype_kit_passes_patched_fails_unpatched_and_stands_alone(tmp_path):
    """The separable VOXCPM_CPU_DTYPE kit: its upstream-style tests pass on 2.0.3 with only its diff applied and
    fail on unmodified 2.0.3; the diff touches model/utils.py alone and is what ``fastattn diff`` writes."""
    import shutil

    import voxcpm

    from fastattn.upstream import KITS, patched_copy, upstream_diff
    for layout, name in KITS["cpu-dtype"][1].items():
        assert (ROOT / "data" / name).read_text() == upstream_diff(layout, "cpu-dtype"), "rerun fastattn diff --write"
    assert {line.split()[1] for line in upstream_diff("wheel", "cpu-dtype").splitlines()
            if line.startswith("--- ")} == {"a/voxcpm/model/utils.py"}
    patched = _run_upstream_tests(patched_copy(tmp_path / "patched", kit="cpu-dtype"), "cpu-dtype")
    assert patched.returncode == 0 and " passed" in patched.stdout, patched.stdout[-3000:] + patched.stderr[-2000:]
    shutil.copytree(Path(voxcpm.__file__).parent, tmp_path / "orig" / "voxcpm",
                    ignore=shutil.ignore_patterns("__pycache__"))
    original = _run_upstream_tests(tmp_path / "orig", "cpu-dtype")
    assert original.returncode == 1 and " failed" in original.stdout, original.stdout[-3000:]


def test_cpu_dtype_override_reaches_the_model(tmp_path):
    """With the kit applied, VOXCPM_CPU_DTYPE=float32 makes a bf16-configured VoxCPM2Model run in float32."""
    from fastattn.upstream import patched_copy
    root = patched_copy(tmp_path / "pkg", kit="cpu-dtype")
    script = ("import sys, torch; from fastattn.models import build_voxcpm2; import voxcpm; "
              "assert voxcpm.__file__.startswith(sys.argv[1]); m = build_voxcpm2('tiny', dtype='bfloat16'); "
              "print(m.config.dtype, next(m.base_lm.parameters()).dtype)")
    env = {**os.environ, "PYTHONPATH": str(root), "VOXCPM_CPU_DTYPE": "float32"}
    r = subprocess.run([sys.executable, "-c", script, str(root)], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split()[-1] == "torch.float32", r.stdout


def _pristine(dest: Path) -> Path:
    import shutil

    import voxcpm
    shutil.copytree(Path(voxcpm.__file__).parent, dest / "voxcpm", ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def _apply(root: Path, kit: str, layout: str = "wheel"):
    from fastattn.upstream import KITS
    return subprocess.run(["patch", "-p1", "--batch", "-i", str(ROOT / "data" / KITS[kit][1][layout])], cwd=root,
                          capture_output=True, text=True)


@pytest.mark.slow
def test_decode_attention_kit_passes_patched_fails_unpatched_and_stands_alone(tmp_path):
    """The opt-in decode_attention kit: its diffs are current and touch the MiniCPM4 config and model only; its
    upstream-style tests (float64 accuracy, one graph under an inductor fullgraph compile, the default
    bit-identical) all pass with only its diff applied, and the ones that need the new field fail on 2.0.3."""
    from fastattn.upstream import KITS, patched_copy, upstream_diff
    for layout, name in KITS["decode-attention"][1].items():
        assert (ROOT / "data" / name).read_text() == upstream_diff(layout, "decode-attention"), \
            "rerun python -m fastattn diff --write"
    assert {line.split()[1] for line in upstream_diff("wheel", "decode-attention").splitlines()
            if line.startswith("--- ")} == {"a/voxcpm/modules/minicpm4/model.py", "a/voxcpm/modules/minicpm4/config.py"}
    patched = _run_upstream_tests(patched_copy(tmp_path / "patched", kit="decode-attention"), "decode-attention")
    assert patched.returncode == 0 and " passed" in patched.stdout and " failed" not in patched.stdout, \
        patched.stdout[-3000:] + patched.stderr[-2000:]
    original = _run_upstream_tests(_pristine(tmp_path / "orig"), "decode-attention")
    assert original.returncode == 1, original.stdout[-3000:]
    failed = set(re.findall(r"FAILED \S+::(test_\w+)", original.stdout))
    assert {"test_default_is_masked", "test_bad_value_refused", "test_flex_block_mask_reads_only_live_blocks",
            "test_live_is_as_close_to_float64_as_masked", "test_live_compiles_into_one_graph_for_a_whole_decode"} \
        <= failed, original.stdout[-3000:]
    assert "test_masked_default_is_bit_identical_to_the_full_cache_call" not in failed  # 2.0.3 is what it keeps


@pytest.mark.slow
def test_the_kits_stack_in_either_order_and_both_suites_pass(tmp_path):
    """The right-sized cache and the decode_attention kit change different lines: either applies on top of the
    other (wheel layout and upstream's src/ layout), and both kits' tests pass on the stack."""
    _diff_granularity_is_this_torchs_key_block()
    for order in (("right-sized", "decode-attention"), ("decode-attention", "right-sized")):
        root = _pristine(tmp_path / "-".join(order))
        for kit in order:
            r = _apply(root, kit)
            assert r.returncode == 0 and "fuzz" not in r.stdout, (order, r.stdout + r.stderr)  # no hunk misplaced
    model = "voxcpm/modules/minicpm4/model.py"
    assert (tmp_path / "right-sized-decode-attention" / model).read_text() == \
        (tmp_path / "decode-attention-right-sized" / model).read_text()
    for kit in ("right-sized", "decode-attention"):
        r = _run_upstream_tests(tmp_path / "-".join(("right-sized", "decode-attention")), kit)
        assert r.returncode == 0 and " failed" not in r.stdout, (kit, r.stdout[-3000:] + r.stderr[-2000:])
    src = tmp_path / "upstream-main"
    _pristine(src / "src")
    for kit in ("decode-attention", "right-sized", "cpu-dtype"):
        r = _apply(src, kit, "src")
        assert r.returncode == 0 and "fuzz" not in r.stdout, (kit, r.stdout + r.stderr)


@pytest.mark.slow
def test_decoding_through_the_live_kit_off_is_identical_on_is_close_to_float64():
    """Notebook 04's check, the kit applied to a copy in a fresh process: the mode off decodes bit-identically to
    upstream, one attention step on is within twice off's error against float64 at every length, and the decode
    on compiles (fullgraph) into one graph per LM."""
    from fastattn.upstream import live_decode_check
    r = live_decode_check("tiny", text="hello world " * 6, steps=20, dtype="float32")
    assert r["identical_off"] and r["deterministic_on"] and r["error_ratio"] <= 2, r
    assert r["rows"][-1]["unique_graphs"] == 2 and r["rows"][-1]["graph_breaks"] == 0
    assert r["max_abs_diff_on"] < 1e-3 and r["max_abs_diff_compiled"] < 1e-3


@pytest.mark.slow
def test_upstream_diff_applies_and_is_equivalent(tmp_path):
    """Apply the diff to a copy of the installed voxcpm; decode there; compare with upstream here."""
    import shutil
    _diff_granularity_is_this_torchs_key_block()

    import voxcpm

    from fastattn.upstream import DIFF_NAME
    shutil.copytree(Path(voxcpm.__file__).parent, tmp_path / "voxcpm", ignore=shutil.ignore_patterns("__pycache__"))
    r = subprocess.run(["patch", "-p1", "--batch", "-i", str(ROOT / "data" / DIFF_NAME)], cwd=tmp_path,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    out = tmp_path / "out.pt"
    code = textwrap.dedent(f"""
        import torch, fastattn, voxcpm
        assert voxcpm.__file__.startswith({str(tmp_path)!r}), voxcpm.__file__
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
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
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
    from fastattn.steps import _keys_for
    model = build_voxcpm2("tiny", dtype="float32")
    lm, cache = model.base_lm, model.base_lm.kv_cache
    cache.current_length = 100
    with patch_voxcpm(model, cache=False, bucket=64):
        assert _keys_for(lm, cache, "exact", 64) == 128
    with patch_voxcpm(model, cache=False):
        calibrated = fastattn.steps.cache_granularity(lm.config, "cpu", torch.float32, cache.max_length, None)
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
