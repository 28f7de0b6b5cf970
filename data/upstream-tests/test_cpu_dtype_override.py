"""VOXCPM_CPU_DTYPE: an opt-in dtype override on CPU, in the style of VOXCPM_MPS_DTYPE (voxcpm.model.utils).

torch and voxcpm only. The override tests pass on the patched package and fail on unmodified voxcpm 2.0.3,
which keeps the checkpoint's dtype on CPU whatever the environment says.
"""

import pytest
from voxcpm.model.utils import pick_runtime_dtype


def test_default_unchanged_when_unset(monkeypatch):
    monkeypatch.delenv("VOXCPM_CPU_DTYPE", raising=False)
    monkeypatch.delenv("VOXCPM_MPS_DTYPE", raising=False)

    assert pick_runtime_dtype("cpu", "bfloat16") == "bfloat16"
    assert pick_runtime_dtype("cpu", "float32") == "float32"
    assert pick_runtime_dtype("cuda", "bfloat16") == "bfloat16"
    assert pick_runtime_dtype("mps", "bfloat16") == "float32"


@pytest.mark.parametrize("value, expected", [("float32", "float32"), (" FP32 ", "fp32"), ("bfloat16", "bfloat16")])
def test_override_honoured_on_cpu(monkeypatch, value, expected):
    monkeypatch.setenv("VOXCPM_CPU_DTYPE", value)

    assert pick_runtime_dtype("cpu", "bfloat16" if expected != "bfloat16" else "float32") == expected


def test_override_is_cpu_only(monkeypatch):
    monkeypatch.setenv("VOXCPM_CPU_DTYPE", "float32")
    monkeypatch.delenv("VOXCPM_MPS_DTYPE", raising=False)

    assert pick_runtime_dtype("cuda", "bfloat16") == "bfloat16"
    assert pick_runtime_dtype("mps", "float16") == "float32"


def test_bad_value_refused_naming_the_valid_ones(monkeypatch):
    monkeypatch.setenv("VOXCPM_CPU_DTYPE", "float8")

    with pytest.raises(ValueError, match=r"VOXCPM_CPU_DTYPE='float8' is not one of .*'float32'"):
        pick_runtime_dtype("cpu", "bfloat16")
