"""VOXCPM_CPU_DTYPE: an opt-in dtype on CPU, beside VOXCPM_MPS_DTYPE (loaded as tests/test_model_utils.py does)."""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
UTILS_PATH = ROOT / "src" / "voxcpm" / "model" / "utils.py"

transformers_stub = types.ModuleType("transformers")
transformers_stub.PreTrainedTokenizer = object
sys.modules.setdefault("transformers", transformers_stub)

spec = importlib.util.spec_from_file_location("voxcpm.model.utils", UTILS_PATH)
utils = importlib.util.module_from_spec(spec)
assert spec.loader is not None
spec.loader.exec_module(utils)


def test_pick_runtime_dtype_unchanged_when_unset(monkeypatch):
    monkeypatch.delenv("VOXCPM_CPU_DTYPE", raising=False)
    monkeypatch.delenv("VOXCPM_MPS_DTYPE", raising=False)

    assert utils.pick_runtime_dtype("cpu", "bfloat16") == "bfloat16"
    assert utils.pick_runtime_dtype("cpu", "float32") == "float32"
    assert utils.pick_runtime_dtype("cuda", "bfloat16") == "bfloat16"
    assert utils.pick_runtime_dtype("mps", "bfloat16") == "float32"


@pytest.mark.parametrize("value, expected", [("float32", "float32"), (" FP32 ", "fp32"), ("bfloat16", "bfloat16")])
def test_pick_runtime_dtype_honours_cpu_override(monkeypatch, value, expected):
    monkeypatch.setenv("VOXCPM_CPU_DTYPE", value)

    assert utils.pick_runtime_dtype("cpu", "float32" if expected == "bfloat16" else "bfloat16") == expected


def test_pick_runtime_dtype_cpu_override_is_cpu_only(monkeypatch):
    monkeypatch.setenv("VOXCPM_CPU_DTYPE", "float32")
    monkeypatch.delenv("VOXCPM_MPS_DTYPE", raising=False)

    assert utils.pick_runtime_dtype("cuda", "bfloat16") == "bfloat16"
    assert utils.pick_runtime_dtype("mps", "float16") == "float32"


@pytest.mark.parametrize("name, device", [("VOXCPM_CPU_DTYPE", "cpu"), ("VOXCPM_MPS_DTYPE", "mps")])
def test_pick_runtime_dtype_rejects_bad_override_naming_valid_ones(monkeypatch, name, device):
    monkeypatch.setenv(name, "float8")

    with pytest.raises(ValueError, match=rf"{name}='float8' is not one of .*'float32'"):
        utils.pick_runtime_dtype(device, "bfloat16")
