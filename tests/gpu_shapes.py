"""Records shaped like three GPU runs, built from the committed CPU reference run and torch's SDPA selection rules.

No GPU has run the workbook yet, so every consumer of records (targets, claims ledger, findings, index/summary,
``compare``, README findings) is fed what a GPU run would write. The kernels follow torch's CUDA selection
(``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``; ``shared/RESEARCH.md`` section 12) for VoxCPM2's
decode call (q 1x16x1x128, K/V 1x2xNx128, GQA 8):

* ``a100-torch2.13`` (A100 / RTX 4090): masked bf16 -> MATH (flash takes no mask, efficient has no GQA in 2.13),
  the same mask without GQA -> EFFICIENT, the bf16 slice -> FLASH, fp32 -> MATH;
* ``h200-cudnn9.19-torch2.13`` (sm90, runtime cuDNN > 9.15: cuDNN first): bf16 -> CUDNN (masked and sliced),
  fp32 -> MATH;
* ``a100-torch2.14`` (efficient gains GQA): masked -> EFFICIENT in both dtypes, the bf16 slice -> FLASH.

Everywhere: no key window is exact (``exact_granularity`` None, ``exact`` timed equal to ``reference``: it is the
same call), the patched cache holds all ``max_length`` slots, and the last-level cache size is unknown.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

from fastattn.lab.bench.memory import kv_memory
from fastattn.lab.bench.records import find_row, save_record
from fastattn.lab.bench.targets import check_targets

REF = Path(__file__).resolve().parents[1] / "data" / "results" / "cpu-epyc-avx512-2threads-torch2.13.0"

OPS = {"FLASH_ATTENTION": "aten::_scaled_dot_product_flash_attention",
       "EFFICIENT_ATTENTION": "aten::_scaled_dot_product_efficient_attention",
       "CUDNN_ATTENTION": "aten::_scaled_dot_product_cudnn_attention",
       "MATH": "aten::_scaled_dot_product_attention_math"}

_A100 = {"upstream": ("MATH", "MATH"), "float additive": ("MATH", "MATH"),
         "bool mask, no enable_gqa": ("EFFICIENT_ATTENTION", "EFFICIENT_ATTENTION"), "exact": ("MATH", "MATH"),
         "fast": ("FLASH_ATTENTION", "MATH"), "is_causal": ("MATH", "MATH")}
_H200 = {"upstream": ("CUDNN_ATTENTION", "MATH"), "float additive": ("CUDNN_ATTENTION", "MATH"),
         "bool mask, no enable_gqa": ("CUDNN_ATTENTION", "EFFICIENT_ATTENTION"), "exact": ("CUDNN_ATTENTION", "MATH"),
         "fast": ("CUDNN_ATTENTION", "MATH"), "is_causal": ("CUDNN_ATTENTION", "MATH")}
_T214 = {"upstream": ("EFFICIENT_ATTENTION",) * 2, "float additive": ("EFFICIENT_ATTENTION",) * 2,
         "bool mask, no enable_gqa": ("EFFICIENT_ATTENTION",) * 2, "exact": ("EFFICIENT_ATTENTION",) * 2,
         "fast": ("FLASH_ATTENTION", "EFFICIENT_ATTENTION"), "is_causal": ("EFFICIENT_ATTENTION",) * 2}

#: profile -> (device name, torch version, {case prefix: (bf16/fp16 backend, fp32 backend)})
PROFILES = {"a100-torch2.13": ("NVIDIA A100-SXM4-80GB", "2.13.0+cu128", _A100),
            "h200-cudnn9.19-torch2.13": ("NVIDIA H200", "2.13.0+cu130", _H200),
            "a100-torch2.14": ("NVIDIA A100-SXM4-80GB", "2.14.1+cu128", _T214)}


def _env(env: dict, profile: str) -> dict:
    name, version, _ = PROFILES[profile]
    return {**env, "device": "cuda", "device_name": name, "torch": version, "cpu_capability": None}


def _matrix_row(row: dict, rules: dict, capacity: int) -> dict:
    prefix = next(p for p in rules if row["case"].startswith(p))
    backend = "MATH" if row["head_dim"] > 256 else rules[prefix][row["dtype"] == "float32"]
    row = copy.deepcopy(row)
    if prefix == "exact":  # no window is exact on a GPU kernel: exact is the whole capacity
        row["case"], row["keys"] = f"exact: window {capacity} keys, mask sliced", capacity
    helpers = ["aten::where"] if backend in ("MATH", "EFFICIENT_ATTENTION") and "bool" in row["mask"] else []
    row.update(backend=backend, kernel=OPS[backend], helpers=helpers, eligible=[backend, "MATH"],
               forced={b: OPS[b] if b in (backend, "MATH") else "error" for b in OPS})
    row["report"].update(backend=backend, ops=[*helpers, OPS[backend]])
    return row


def _same_timing(dst: dict, src: dict) -> None:
    for k in ("median_ms", "p10_ms", "p90_ms", "min_ms", "n", "samples_ms"):
        dst[k] = src[k]


def _attention(rec: dict) -> dict:
    rec["params"]["exact_granularity"] = None
    rec["bandwidth"] = {**rec["bandwidth"], "llc_bytes": None}
    for r in rec["rows"]:
        r["floor_meaningful"] = None
        if r["mode"] == "exact":
            _same_timing(r, find_row(rec["rows"], mode="reference", position=r["position"]))
            r["window"] = rec["params"]["capacity"]
    return rec


def _decode_step(rec: dict) -> dict:
    rec["params"].update(granularity=None, variants=["upstream", "patched", "slice_fix"])
    rows = []
    for r in rec["rows"]:
        r["attention_in_step_ms"] = None
        if r["variant"] == "patched":  # the CPU's windowed step stands in for the slice fix's figures
            rows.append({**copy.deepcopy(r), "variant": "slice_fix", "bit_identical": False})
            _same_timing(r, find_row(rec["rows"], variant="upstream", position=r["position"]))
        rows.append(r)
    rec["rows"] = rows
    return rec


def _kv(rec: dict, dtype=None) -> dict:
    """The KV record a GPU run writes, measured, not edited: ``kv_memory`` with the patched cache at ``max_length``
    slots, as on a device with no exact window."""
    p = rec["params"]
    kv = kv_memory(p["preset"], prefill=p["prefill"], steps=p["steps"], dtype=dtype or p["dtype"],
                   max_length=p["max_length"], bucket=p["max_length"])
    return {**kv, "env": rec["env"]}


def _growth(rec: dict) -> dict:
    rec["rows"] = []
    rec["params"]["granularity"] = rec["params"]["max_length"]
    rec["summary"].update(moves=0, step_total_s=0.004, max_step_ms=0.01, final_capacity=rec["params"]["max_length"],
                          right_sized=False)
    return rec


def _whole(rec: dict) -> dict:
    ups = [r for r in rec["rows"] if r["variant"] == "upstream"]
    for r in rec["rows"]:
        if r["variant"] == "patched":
            twin = next(u for u in ups if u["repeat"] == r["repeat"])
            r.update({k: v for k, v in twin.items() if k.endswith("_s")})
    rec["median_wall_s"]["patched"] = rec["median_wall_s"]["upstream"]
    rec.update(ratio=1.0, identical=True, patched_granularity=None)
    return rec


def _transform(name: str, rec: dict, profile: str) -> dict:
    rec = copy.deepcopy(rec)
    rec["env"] = _env(rec["env"], profile)
    kind = rec["kind"]
    if kind == "backend_matrix":
        rec["rows"] = [_matrix_row(r, PROFILES[profile][2], rec["params"].get("capacity", 8192)) for r in rec["rows"]]
    elif kind == "attention":
        rec = _attention(rec)
    elif kind == "decode_step":
        rec = _decode_step(rec)
    elif kind == "kv_memory":
        rec = _kv(rec)
    elif kind == "cache_growth":
        rec = _growth(rec)
    elif kind == "whole_decode":
        rec = _whole(rec)
    elif kind == "exactness_calibration":
        for r in rec["rows"]:
            r.update(eligible=False, chosen=None, kernel=f"cuda {r['kernel'].split()[-1]}")
    elif kind in ("dtype_costs", "dtype_decode"):  # no CPU feature flags on a GPU run
        rec["flags"] = {}
    elif kind == "bandwidth":
        rec["llc_bytes"] = None
        rec["rows"][0]["llc_bytes"] = None
    elif kind == "fill_cost":
        rec["params"]["granularity"] = rec["params"]["max_length"]
    elif kind == "compiled_step":
        rec["graphs"] = {k: v for k, v in rec["graphs"].items() if k != "recompiles"} | {"cudagraph_skips": 0}
    return rec


def gpu_records(profile: str, ref: Path = REF) -> dict:
    """``{file stem: record}``: the reference run as the GPU ``profile`` would have written it, targets judged
    afresh by ``check_targets`` from those records."""
    recs = {p.stem: _transform(p.stem, json.loads(p.read_text()), profile) for p in sorted(ref.glob("*.json"))
            if p.stem != "targets"}
    recs["kv_memory_float32"] = _kv(recs["kv_memory_full"], "float32")  # 01's fp32 record: the ledger's KV claim
    recs["targets"] = {**copy.deepcopy(json.loads((ref / "targets.json").read_text())),
                       "env": _env(recs["backend_matrix"]["env"], profile)}
    recs["targets"]["rows"] = check_targets({
        "attention_fp32": recs["attention_float32"], "attention_bf16": recs["attention_bfloat16"],
        "attention_fp32_cold": recs["attention_float32_cold"], "decode_bf16": recs["decode_step_bfloat16"],
        "decode_fp32": recs["decode_step_float32"], "kv": recs["kv_memory_full"], "growth": recs["cache_growth_full"],
        "whole": recs["whole_decode_full"]})
    return recs


def write_reference_folder(recs: dict, folder: Path) -> Path:
    """The records as a flat folder, as ``data/results/<machine>/`` holds them."""
    for stem, rec in recs.items():
        save_record(rec, folder, stem)
    return folder


def write_run_folder(recs: dict, run: Path) -> Path:
    """The records as a workbook run folder (``<run>/<notebook>/records/*.json``), as the ledger reads them."""
    for stem, rec in recs.items():
        save_record(rec, run / "05_profiling" / "records", stem)
    return run
