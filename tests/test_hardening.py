"""Hostile input: one regression test per item of the hardening pass (issue 14). Tiny sizes throughout."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fastattn
from fastattn import attention_step, backend_matrix
from fastattn import workbook as wb

pytestmark = pytest.mark.usefixtures("seeded_fast_choice")  # fast's probe, cheap (conftest)

ROOT = Path(__file__).resolve().parents[1]


# 2: a mask that SDPA would reject (or that would be truncated) is refused
@pytest.mark.parametrize("shape", [(1, 49), (1, 51), (2, 1, 1, 50), (1, 1, 1, 1, 50)])
def test_attention_mask_shape_must_broadcast(shape):
    q, k = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 50, 16)
    with pytest.raises(ValueError, match=r"does not broadcast to \(B, Hq, Lq, Lk\)"):
        fastattn.attention(q, k, k, mask=torch.ones(shape, dtype=torch.bool), enable_gqa=True)
    out = fastattn.attention(q, k, k, mask=torch.ones(1, 1, 1, 50, dtype=torch.bool), enable_gqa=True)
    assert out.shape == q.shape


# 4 and 7: backend_matrix names what it takes; no empty list, no KeyError
def test_backend_matrix_dtype_names_and_errors():
    rows = backend_matrix("cpu", dtype="float32", capacity=64, position=3)
    assert rows and {r["dtype"] for r in rows} == {"float32"}
    with pytest.raises(ValueError, match="dtype must be one of bfloat16, float32, float16"):
        backend_matrix("cpu", dtype=torch.float64, capacity=64, position=3)


# 6: absurd buckets are refused before any allocation, naming the argument
@pytest.mark.parametrize("bucket", [2**31, 2**70])
def test_huge_bucket_is_refused_or_harmless(bucket):
    q, k = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 64, 16)
    out = attention_step(q, k, k, 10, bucket=bucket)  # a bucket at or above capacity windows the whole cache
    assert torch.equal(out, attention_step(q, k, k, 10, mode="reference"))
    with pytest.raises(ValueError, match="bucket="):
        fastattn.check_exactness("cpu", torch.float32, hq=4, hkv=2, head_dim=16, bucket=bucket)


# 7: integer and meta tensors get a clear error / a clean result
def test_integer_tensors_are_a_clear_error():
    z = lambda *s: torch.zeros(*s, dtype=torch.int64)  # noqa: E731
    with pytest.raises(TypeError, match="must be floating point"):
        attention_step(z(1, 2, 1, 8), z(1, 1, 16, 8), z(1, 1, 16, 8), 3)


def test_meta_tensors_in_exact():
    q, k = torch.empty(1, 4, 1, 16, device="meta"), torch.empty(1, 2, 2048, 16, device="meta")
    assert attention_step(q, k, k, 100).shape == q.shape


# 8: workbook parameters: one type per name, checked before anything runs, named in the error
@pytest.mark.parametrize("params,match", [
    ({"positions": 99999}, r"parameter positions=99999: expected a non-empty list of ints"),
    ({"positions": "0:512:8"}, r"parameter positions='0:512:8': expected a non-empty list"),
    ({"device": "CPU"}, r"parameter device='CPU': device must be one of"),
    ({"seed": "abc"}, r"parameter seed='abc': expected an int"),
    ({"repeat": 1}, r"parameter 'repeat' is not declared by any selected notebook"),
    ({"positions": [0, 4000]}, r"03_causality_checks: parameter positions: 4000 is beyond capacity=2048"),
])
def test_run_parameters_checked_before_anything_runs(tmp_path, params, match):
    with pytest.raises(ValueError, match=match):
        wb.run_workbook(params, out=tmp_path, log=lambda *_: None)
    assert not any(tmp_path.iterdir())  # no run folder was made


def _cli(*args, cwd=ROOT):
    r = subprocess.run([sys.executable, "-m", "fastattn", "workbook", *args], capture_output=True, text=True,
                       cwd=cwd, timeout=300)
    return r.returncode, r.stdout + r.stderr


@pytest.mark.parametrize("make,match", [
    (lambda d: ["--out", str(d / "afile")], "exists and is not a folder"),
    (lambda d: ["--params", str(d / "missing.yaml")], "no such file"),
    (lambda d: ["--params", str(d / "list.yaml")], "expected a mapping of parameter names"),
    (lambda d: ["--params", str(d / "bad.yaml")], "not valid YAML"),
    (lambda d: ["--only", "03", "-p", "positions", "99999"], "parameter positions=99999"),
])
def test_runner_cli_errors_are_one_line_and_nonzero(tmp_path, make, match):
    (tmp_path / "afile").write_text("x")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    (tmp_path / "bad.yaml").write_text("a: [1,\n")
    code, out = _cli(*make(tmp_path))
    assert code == 2 and match in out and "Traceback" not in out, out


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")
def test_runner_cli_unwritable_out(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    code, out = _cli("--out", str(ro / "sub"))
    assert code == 2 and "cannot create" in out


# 9: the bench CLI validates before it measures or writes
def test_bench_cli_validates_first(tmp_path):
    out = tmp_path / "bench"
    r = subprocess.run([sys.executable, "-m", "fastattn", "bench", "attention", "--positions", "0,9000",
                        "--capacity", "256", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "--positions must be" in r.stderr and "Traceback" not in r.stderr
    assert not out.exists()


# 10: a failed write never leaves a cut-short file or a run marked "ok"
def test_atomic_write_leaves_nothing_on_failure(tmp_path, monkeypatch):
    from fastattn.paths import atomic_write_text
    target = tmp_path / "summary.json"
    atomic_write_text(target, json.dumps({"ok": 1}))

    def full_disk(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space left"):
        atomic_write_text(target, json.dumps({"ok": 2}) * 1000)
    assert json.loads(target.read_text()) == {"ok": 1}  # the earlier content, whole
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]  # no temporary left behind


def test_failed_html_marks_the_notebook_failed(tmp_path, monkeypatch):
    """The HTML step is under test, not 02: papermill's execution is stubbed by a copy of the source notebook."""
    import shutil

    import papermill

    def no_space(executed, *_):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(papermill, "execute_notebook", lambda src, dst, **_: shutil.copy(src, dst))
    monkeypatch.setattr(wb, "_html", no_space)
    run_dir, summary = wb.run_workbook({"capacity": 1024, "position": 100}, only=["02"], out=tmp_path, budget_s=None,
                                       log=lambda *_: None)
    nb = summary["notebooks"][0]
    assert summary["status"] == "failed" and nb["status"] == "failed" and "HTML" in nb["error"]


# 3: a real checkpoint round trip; a checkpoint that does not cover the model is refused
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    from fastattn.models import build_voxcpm2, save_voxcpm2
    model = build_voxcpm2("tiny", dtype="bfloat16")
    return model, save_voxcpm2(model, tmp_path_factory.mktemp("ckpt") / "tiny")


def _decode(model):
    torch.manual_seed(0)
    return model.generate("hello world", min_len=12, max_len=12, inference_timesteps=2)


def test_checkpoint_round_trip_decodes_identically(saved):
    from fastattn.models import load_voxcpm2
    model, path = saved
    loaded = load_voxcpm2(path)
    assert loaded.fastattn_info["weights"] == "checkpoint"
    assert torch.equal(_decode(loaded), _decode(model))


def test_save_never_overwrites(saved, tmp_path):
    from fastattn.models import save_voxcpm2
    model, path = saved
    with pytest.raises(FileExistsError, match="never overwritten"):
        save_voxcpm2(model, path)


def _copy_with_weights(src: Path, dst: Path, edit):
    import shutil

    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)
    sd = load_file(str(src / "model.safetensors"))
    save_file(edit(sd), str(dst / "model.safetensors"))
    return dst


@pytest.mark.parametrize("edit,match", [
    (lambda sd: {"unrelated": torch.zeros(1)}, "missing .* key"),                       # (nearly) no tensors
    (lambda sd: dict(list(sd.items())[: len(sd) // 2]), "missing .* key"),              # half of them
    (lambda sd: {("x." + k if i == 0 else k): v for i, (k, v) in enumerate(sd.items())}, "unexpected 1"),  # renamed
])
def test_incomplete_weights_are_refused(saved, tmp_path, edit, match):
    from fastattn.models import load_voxcpm2
    bad = _copy_with_weights(saved[1], tmp_path / "bad", edit)
    with pytest.raises(ValueError, match=match):
        load_voxcpm2(bad)


def test_tokenizer_config_alone_is_refused(saved, tmp_path):
    import shutil

    from fastattn.models import load_voxcpm2
    bad = tmp_path / "notok"
    shutil.copytree(saved[1], bad)
    (bad / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="tokenizer.json or tokenizer.model"):
        load_voxcpm2(bad)
