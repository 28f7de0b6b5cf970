"""Devices, dtypes, and the facts that decide which kernels run here (CPU features, toolchain)."""

from __future__ import annotations

import os
import platform
import shutil
import sys
import sysconfig
import warnings
from contextlib import contextmanager, nullcontext
from importlib.metadata import PackageNotFoundError, version
from typing import Optional

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
_DEVICE_TYPES = ("auto", "cpu", "cuda", "mps")


def resolve_device(device, *, name: str = "device") -> torch.device:
    """A usable ``torch.device`` from ``auto``, ``cpu``, ``cuda[:N]``, ``mps``; ValueError for others or absent ones."""
    bad = f"{name} must be one of {', '.join(_DEVICE_TYPES)} (or 'cuda:N'), got {device!r}"
    if not isinstance(device, (str, torch.device)):
        raise ValueError(bad)
    text = device.strip() if isinstance(device, str) else str(device)
    if text == "auto":
        why = cuda_build_without_cuda()
        if why and not _WARNED_NO_CUDA:
            _WARNED_NO_CUDA.append(why)
            warnings.warn(f"fastattn: device='auto' runs on CPU: {why}. Pass device='cpu' to silence this, or fix "
                          "the driver to measure the GPU.", RuntimeWarning, stacklevel=2)
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    kind, _, index = text.partition(":")
    if kind not in _DEVICE_TYPES[1:] or (index and (kind != "cuda" or not index.isdigit())):
        raise ValueError(bad)
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{name}={text!r} but CUDA is not available on this machine (use 'cpu' or 'auto')")
    if kind == "cuda" and index and int(index) >= torch.cuda.device_count():
        raise ValueError(f"{name}={text!r} but this machine has {torch.cuda.device_count()} CUDA device(s)")
    if kind == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"{name}='mps' but MPS is not available on this machine (use 'cpu' or 'auto')")
    return torch.device(text)


_WARNED_NO_CUDA: list = []


def cuda_build_without_cuda() -> Optional[str]:
    """Why this CUDA build of torch cannot use CUDA here; None where it has no CUDA build or CUDA works."""
    if torch.version.cuda is None or torch.cuda.is_available():
        return None
    return (f"torch {torch.__version__} is built for CUDA {torch.version.cuda} but torch.cuda.is_available() is "
            "False (no GPU visible, or a driver older than the build needs)")


def runtime_dtype(device) -> str:
    """The dtype voxcpm 2.0.3 runs VoxCPM2 in here (its ``pick_runtime_dtype``): bfloat16, float32 on MPS."""
    return "float32" if torch.device(device).type == "mps" else "bfloat16"


def dtype_of(dtype, *, name: str = "dtype") -> torch.dtype:
    """``torch.dtype`` from a name (``"bfloat16"``) or a dtype among :data:`DTYPES`; else ValueError."""
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"{name} must be one of {', '.join(DTYPES)}, got {dtype!r}")


def dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def device_key(device) -> str:
    """A device as a cache key: ``"cpu"``, ``"cuda:0"`` (the current index filled in), ``"meta"``."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        return f"cuda:{torch.cuda.current_device()}"
    return str(device)


def package_version(dist: str) -> str:
    try:
        return version(dist)
    except PackageNotFoundError:
        return "not installed"


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


@contextmanager
def quiet_native_stderr(into=None):
    """Point fd 2 at ``into`` (a file; None: os.devnull) for a block: C++ code writes there directly, never through
    Python (kineto prints a line per profiler start/stop, c10 its warnings); restored on exceptions too."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") if into is None else nullcontext(into) as target:
            os.dup2(target.fileno(), 2)
            yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
