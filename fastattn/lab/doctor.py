"""``python -m fastattn doctor``: the environment that decides which attention kernel runs."""

from __future__ import annotations

import json
import platform
from typing import Optional

import torch

from fastattn import compat
from fastattn.devices import cuda_build_without_cuda, package_version
from fastattn.exactness import exact_granularity

from .bench.metrics import dtype_recommendation
from .bench.records import git_commit, load_run
from .machine import compile_toolchain, cpu_features, cpu_name, native_bf16
from .paths import reports_dir

__all__ = ["doctor", "format_doctor", "git_commit"]


def doctor(calibrate: bool = True) -> dict:
    """A dict of what decides SDPA's choices here: versions, device, capability, backends, threads, ISA, shim.
    ``calibrate`` adds ``exact_granularity``: ``exact``'s bucket per dtype for VoxCPM2's step (None: whole cache)."""
    info = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "voxcpm": package_version("voxcpm"),
        "fastattn": package_version("fastattn"),
        "git_commit": git_commit(),
        "threads": torch.get_num_threads(),
        "interop_threads": torch.get_num_interop_threads(),
        "cpu_capability": getattr(torch.backends.cpu, "get_cpu_capability", lambda: "unknown")(),
        "cpu_native_bf16": native_bf16(),
        "cpu_features": cpu_features(),
        "fastest_dtype_measured": fastest_dtype_measured(),
        "mkldnn": torch.backends.mkldnn.is_available(),
        "torchaudio_placeholder": compat.shim_engaged() or compat.ensure_torchaudio(),
        "torchaudio_reason": compat.shim_reason(),
        "cuda_available": torch.cuda.is_available(),
        "cuda_version": torch.version.cuda,
        "cuda_unusable": cuda_build_without_cuda(),
        "device": "cpu",
        "device_name": cpu_name(),
        "compute_capability": None,
        "cudnn_version": None,
        "cpu_backends": ["FLASH_ATTENTION", "MATH"],
        "cuda_backends_enabled": None,
        "triton": package_version("triton"),
    }
    if torch.cuda.is_available():
        idx = torch.cuda.current_device()
        info["sdp_priority_order"] = sdp_priority_order(torch.device("cuda", idx))
        cb = torch.backends.cuda
        info.update({
            "device": f"cuda:{idx}",
            "device_name": torch.cuda.get_device_name(idx),
            "compute_capability": "sm_{}{}".format(*torch.cuda.get_device_capability(idx)),
            "cudnn_version": torch.backends.cudnn.version(),
            "gpu_memory_gib": round(torch.cuda.get_device_properties(idx).total_memory / 2**30, 1),
            "cuda_backends_enabled": {name: getattr(cb, f"{fn}_sdp_enabled", lambda: False)() for name, fn in (
                ("FLASH_ATTENTION", "flash"), ("EFFICIENT_ATTENTION", "mem_efficient"), ("CUDNN_ATTENTION", "cudnn"),
                ("MATH", "math"))},
        })
    info["compile_toolchain"] = compile_toolchain(info["device"]) or "ok"
    if calibrate:
        dev = torch.device(info["device"])
        info["exact_granularity"] = {name: exact_granularity(dev, getattr(torch, name), hq=16, hkv=2, head_dim=128,
                                                             capacity=8192, lq=1) for name in ("float32", "bfloat16")}
    return info


def fastest_dtype_measured() -> Optional[str]:
    """The newest 05 run's fastest dtype on this machine, with its ratio and run name; None where none compared."""
    runs = reports_dir()
    for folder in sorted((p for p in runs.iterdir() if p.is_dir()) if runs.is_dir() else [], reverse=True):
        rec = load_run(folder / "05_profiling").get("dtype_decode")  # the latest save first
        env = (rec or {}).get("env", {})
        if rec is None or (env.get("device_name") != cpu_name() and str(env.get("device")) == "cpu"):
            continue  # none, or another machine's run (a copied report)
        r = dtype_recommendation(rec, rec.get("flags"))
        cfg = r["dtype"] + (" with the patch" if r["patched"] else "")
        ratio = r.get("ratio_text") or f"{r['ratio']:.2f}x"
        return (f"{cfg}: {ratio} of voxcpm's default step ({r['default']}) in run "
                f"{folder.name}" + ("" if r["decided"] else " (no faster configuration)"))
    return None


def priority_names(order) -> list:
    """SDPA backend names for ``torch._C._get_sdp_priority_order()``'s integers (SDPBackend's values)."""
    from torch.nn.attention import SDPBackend
    names = {int(b.value) if hasattr(b, "value") else int(b): b.name for b in SDPBackend.__members__.values()}
    return [names.get(int(i), f"unknown({int(i)})") for i in order]


def sdp_priority_order(device) -> Optional[list]:
    """SDPA's CUDA backend order after one selection on ``device`` (which installs it); None where torch cannot tell."""
    getter = getattr(torch._C, "_get_sdp_priority_order", None)
    if getter is None:
        return None
    q = torch.zeros(1, 2, 1, 64, device=device, dtype=torch.bfloat16)
    torch.nn.functional.scaled_dot_product_attention(q, q, q)  # the first selection installs the order
    return priority_names(getter())


def format_doctor(info: dict) -> str:
    width = max(map(len, info))
    return "\n".join(["fastattn doctor"] + [f"  {k:<{width}}  {v}" for k, v in info.items()])


def main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="python -m fastattn doctor", description=__doc__)
    ap.add_argument("--json", action="store_true", help="print JSON")
    ap.add_argument("--no-calibrate", action="store_true", help="skip exact's granularity (seconds on a CPU)")
    args = ap.parse_args(argv)
    info = doctor(calibrate=not args.no_calibrate)
    print(json.dumps(info, indent=2, default=str) if args.json else format_doctor(info))
    return 0
