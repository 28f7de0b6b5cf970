"""Peak RSS of one request above a built model's resting RSS (run in a fresh process by ``peak_rss``).

``python -m fastattn.bench.rss_probe PRESET DTYPE VARIANT STEPS`` prints ``resting_bytes peak_bytes``.
Linux only: the high-water mark (VmHWM) is reset after building and a warm-up request.
"""

import sys

import torch

from fastattn.models import build_voxcpm2, silence_progress
from fastattn.patch import patch_voxcpm


def status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def main(preset: str, dtype: str, variant: str, steps: int) -> None:
    m = build_voxcpm2(preset, dtype=dtype)
    silence_progress()
    if variant == "patched":
        patch_voxcpm(m)
    torch.manual_seed(0)
    m.generate("Warm up.", min_len=2, max_len=2, inference_timesteps=2)  # first-touch costs out of the way
    built = status("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:  # reset the high-water mark (VmHWM) to the current RSS
        f.write("5")
    torch.manual_seed(0)
    m.generate("The quick brown fox jumps over the lazy dog.", min_len=steps, max_len=steps, inference_timesteps=2)
    print(built, status("VmHWM:"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
