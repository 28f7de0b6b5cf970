"""The exactness contract on this torch, as one record: scripts/torch-matrix.sh runs it in each side venv.

    python scripts/exactness_matrix.py --out data/results/torch-matrix

Checks, each in float32 and bfloat16 where it has a dtype: which kernel SDPA runs for upstream's masked decode call
(VoxCPM2's 16 query heads, 2 KV heads, 128 dims); windows of 512-slot multiples against the whole 8192-slot cache
(the right-sized diff's CPU granularity); a whole decode through the right-sized diff (as is, and with 512-slot
windows forced whatever the torch) and through fastattn's
``exact`` patch against upstream's (tiny preset, ~430 prefill tokens + 120 steps: crosses 512); the three kits'
upstream-style tests on the three diffs stacked; whether the slice to ``position + 1`` (issue #293's and PR #395's fix)
compiles under ``fullgraph=True`` (what voxcpm's ``optimize()`` uses). A check that raises is recorded with its error.
"""
import argparse
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

import fastattn
from fastattn.lab.bench.records import env_record, record, save_record

ROOT = Path(__file__).resolve().parents[1]
TEXT = "hello world this is a test sentence " * 12
STEPS = 120  # ~430 prefill tokens + 120 steps: the window crosses 512
DTYPES = ("float32", "bfloat16")


def kernel(dtype):
    from fastattn.exactness import kernel_key_block
    return {"kernel": kernel_key_block("cpu", getattr(torch, dtype), hq=16, hkv=2, head_dim=128)[1]}


def windows(dtype):
    from fastattn.exactness import check_exactness
    r = check_exactness("cpu", getattr(torch, dtype), bucket=512, capacity=8192)
    return {"identical": r["bit_identical"], "max_abs_diff": r["max_abs_diff"], "n": r["positions_checked"]}


def through_diff(dtype, granularity=None):
    from fastattn.lab.upstream import decode_with_diff
    r = decode_with_diff("tiny", text=TEXT, steps=STEPS, dtype=dtype, seed=1, granularity=granularity)
    return {"identical": r["identical"], "max_abs_diff": r["max_abs_diff"], "capacity": r["diff_capacity"]}


def forced_windows(dtype):
    """The diff with 512-slot windows whatever this torch's kernel: what the version gate keeps away."""
    return through_diff(dtype, granularity=512)


def exact_patch(dtype):
    from fastattn.models import build_voxcpm2
    from fastattn.patch import patch_voxcpm
    model = build_voxcpm2("tiny", dtype=dtype)
    decode = lambda: (torch.manual_seed(1), model.generate(TEXT, min_len=STEPS, max_len=STEPS))[1]  # noqa: E731
    ref = decode()
    with patch_voxcpm(model, mode="exact"):
        got = decode()
    return {"identical": bool(torch.equal(ref, got)), "max_abs_diff": float((ref.double() - got.double()).abs().max())}


def kit_tests(_):
    import shutil

    from fastattn.lab.upstream import KITS, patched_copy
    with tempfile.TemporaryDirectory() as tmp:
        root = patched_copy(Path(tmp), list(KITS), layout="src")
        shutil.copytree(ROOT / "data" / "upstream-tests", root / "tests")
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--junitxml=r.xml", "tests"],
                       cwd=root, capture_output=True, timeout=900)
        cases = list(ET.parse(root / "r.xml").getroot().iter("testcase"))
    bad = [c.get("name") for c in cases if c.find("failure") is not None or c.find("error") is not None]
    return {"passed": len(cases) - len(bad) - sum(c.find("skipped") is not None for c in cases),
            "failed": len(bad), "failed_tests": bad}


def slice_fullgraph(_):
    """The slice fix's attention, position a tensor as in voxcpm's decode loop, under a fullgraph compile."""
    def step(q, key_cache, value_cache, position_id):
        key_cache, value_cache = key_cache[:, :, : position_id + 1], value_cache[:, :, : position_id + 1]
        return torch.nn.functional.scaled_dot_product_attention(q, key_cache, value_cache, enable_gqa=True)

    q, kv = torch.randn(1, 16, 1, 128), torch.randn(1, 2, 1024, 128)
    torch._dynamo.reset()
    backend = "eager"  # a Dynamo trace: what fullgraph refuses, not what inductor or CUDA would do
    try:
        torch.compile(step, backend=backend, fullgraph=True)(q, kv, kv, torch.tensor([300]))
    except Exception as exc:  # noqa: BLE001 - the outcome under test
        return {"compiles": False, "backend": backend,
                "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
    return {"compiles": True, "backend": backend}


CHECKS = {"sdpa kernel": (kernel, DTYPES), "windows vs whole cache": (windows, DTYPES),
          "decode through the diff": (through_diff, DTYPES),
          "decode, 512-slot windows forced": (forced_windows, DTYPES), "decode, exact patch": (exact_patch, DTYPES),
          "kit tests, diffs stacked": (kit_tests, (None,)), "slice fix under fullgraph": (slice_fullgraph, (None,))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder of the records (one per run, never overwritten)")
    args = ap.parse_args()
    fastattn.compat.ensure_torchaudio()
    torch.set_num_threads(2)
    rows = []
    for check, (fn, dtypes) in CHECKS.items():
        for dtype in dtypes:
            t0 = time.perf_counter()
            try:
                row = fn(dtype)
            except Exception as exc:  # noqa: BLE001 - a torch that fails a check is a finding, recorded
                row = {"failed": True, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            rows.append({"check": check, "dtype": dtype, **row, "seconds": round(time.perf_counter() - t0, 1)})
            print(rows[-1], flush=True)
    env = env_record("cpu")
    rec = record("torch_matrix", env=env, params={"preset": "tiny", "steps": STEPS, "text_chars": len(TEXT)},
                 rows=rows)
    ver = torch.__version__.split("+")[0]
    print(save_record(rec, args.out, f"exactness-torch{ver}-py{sys.version_info[0]}.{sys.version_info[1]}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
