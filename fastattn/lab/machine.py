"""The machine a record was made on: its CPU (name, features, bf16 instructions), its device's name, the dtype
voxcpm runs in there, and whether torch.compile can build kernels here."""

from __future__ import annotations

import os
import platform
import shutil
import sysconfig
from typing import Optional

import torch


def runtime_dtype(device) -> str:
    """The dtype voxcpm 2.0.3 runs VoxCPM2 in here (its ``pick_runtime_dtype``): bfloat16, float32 on MPS."""
    return "float32" if torch.device(device).type == "mps" else "bfloat16"


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


#: the CPU features that give bf16 arithmetic its own instructions (x86: AVX-512 BF16, AMX; Arm: the BF16 extension)
BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")


def cpu_flags(names=("avx512f", "avx512_bf16", "amx_bf16", "avx2", "bf16")) -> dict:
    """``{feature: bool}`` from /proc/cpuinfo's ``flags`` (Arm: ``Features``); ``{}`` where it cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.split(":")[0].strip() in
                          ("flags", "Features")), [])
    except OSError:
        return {}
    return {n: n in flags for n in names}


def cpu_features(flags: Optional[dict] = None, capability: str = "?") -> str:
    """The CPU features that pick this project's kernels, in words; ``capability`` (ATen's) if flags are unknown."""
    flags = cpu_flags() if flags is None else flags
    if not flags:
        return capability
    for flag, words in (("amx_bf16", "AMX"), ("avx512_bf16", "AVX512-BF16, no AMX"), ("bf16", "Arm BF16")):
        if flags.get(flag):
            return words
    isa = "AVX512" if flags.get("avx512f") else "AVX2" if flags.get("avx2") else capability
    return f"{isa}, no bf16 instructions"


def machine_label(env: dict, flags: Optional[dict] = None) -> str:
    """A record's machine as the tables name it; ``flags`` stand in for records without ``cpu_features``."""
    torch_v = env["torch"].split("+")[0]
    if str(env.get("device", "cpu")).startswith("cuda"):
        return f"{env['device_name']} (CUDA), torch {torch_v}"
    feats = env.get("cpu_features") or (cpu_features(flags) if flags else f"ATen {env.get('cpu_capability', '?')}")
    return f"{env['threads']}-core {env['device_name']} ({feats}), torch {torch_v}"


def native_bf16(flags: Optional[dict] = None) -> Optional[bool]:
    """Whether this CPU has bf16 arithmetic (any of ``BF16_FLAGS``; else torch converts via fp32); None: unknown."""
    flags = cpu_flags() if flags is None else flags
    return any(flags.get(n) for n in BF16_FLAGS) if flags else None


def device_name(device) -> str:
    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()


def compile_toolchain(device="cpu") -> Optional[str]:
    """Why ``torch.compile`` cannot build kernels here (no C/C++ compiler or ``Python.h``), or None."""
    cuda = torch.device(device).type == "cuda"
    var, names = ("CC", ("gcc", "clang")) if cuda else ("CXX", ("g++", "clang++"))
    chosen = os.environ.get(var)
    found = shutil.which(chosen) if chosen else next(filter(None, map(shutil.which, names)), None)
    header = os.path.join(sysconfig.get_paths()["include"], "Python.h")
    missing = [] if found else [f"no {'C' if cuda else 'C++'} compiler (${var}, {' or '.join(names)})"]
    missing += [] if os.path.exists(header) else [f"no Python.h at {header} (the python3-dev package)"]
    return "; ".join(missing) + ": torch.compile cannot build here" if missing else None
