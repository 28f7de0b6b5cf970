"""Peak memory, the one home: a process's RSS and high-water mark (Linux) or CUDA's allocator peak, and handing
retained memory back. ``python -m fastattn.lab.bench.rss_probe PRESET DTYPE VARIANT STEPS`` (a fresh process, run by
``peak_rss``) prints ``built resting trimmed peak cache`` bytes: RSS after building, after patch and warm-up, after
``malloc_trim`` (retention gone), the request's VmHWM, KV bytes."""

import ctypes
import gc
import sys

import torch

from fastattn.models import build_voxcpm2, silence_progress
from fastattn.patch import cache_bytes, patch_voxcpm


def status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


#: resolved at import, before any RSS is read: loading it inside the measurement touched new pages, so a trim with
#: nothing to hand back read a few KB *above* the RSS before it
try:
    MALLOC_TRIM = ctypes.CDLL("libc.so.6").malloc_trim
except (OSError, AttributeError):  # not glibc: nothing to hand back this way
    MALLOC_TRIM = None


def trim(device="cpu") -> None:
    """Hand retained memory back: reference cycles, then glibc's free lists, and CUDA's cache on a CUDA ``device``."""
    gc.collect()  # tensors held only by reference cycles go first
    if MALLOC_TRIM is not None:
        MALLOC_TRIM(0)
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def reset_peak(device="cpu") -> bool:
    """Reset CUDA's allocator peak, or the process's VmHWM (Linux); False where the CPU peak cannot be reset."""
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        with open("/proc/self/clear_refs", "w") as f:  # the high-water mark (VmHWM) drops to the current RSS
            f.write("5")
        return True
    except OSError:
        return False


def peak(device="cpu"):
    """Bytes: CUDA's allocator peak, or the process's VmHWM where Linux reports it (else None)."""
    if torch.device(device).type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        return status("VmHWM:")
    except (OSError, KeyError):
        return None


def main(preset: str, dtype: str, variant: str, steps: int) -> None:
    m = build_voxcpm2(preset, dtype=dtype)
    silence_progress()
    built = status("VmRSS:")
    if variant == "patched":
        patch_voxcpm(m)
    torch.manual_seed(0)
    m.generate("Warm up.", min_len=2, max_len=2, inference_timesteps=2)  # first-touch costs out of the way
    resting = status("VmRSS:")
    trim()
    trimmed = status("VmRSS:")
    if not reset_peak():
        raise SystemExit("cannot reset the peak RSS (/proc/self/clear_refs): the peak would include the build")
    torch.manual_seed(0)
    m.generate("The quick brown fox jumps over the lazy dog.", min_len=steps, max_len=steps, inference_timesteps=2)
    print(built, resting, trimmed, status("VmHWM:"), cache_bytes(m)["total"])


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
