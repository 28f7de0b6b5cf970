"""Devices and dtypes: what a caller names, resolved and checked."""

from __future__ import annotations

import os
import sys
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
