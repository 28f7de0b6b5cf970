"""Decode through a patched copy of voxcpm (fastattn.lab.upstream.decode_with_diff runs this in a fresh process).

argv: root preset dtype text steps seed device [granularity] out; saves {"wav", "capacity", "length"} to out.
A granularity forces the cache's (StaticKVCache's default otherwise).
"""
import fastattn  # noqa: F401  (first: its torchaudio stand-in lets voxcpm import without torchaudio)
import sys

import torch
import voxcpm

from fastattn.models import build_voxcpm2, silence_progress

root, preset, dtype, text, steps, seed, device, out = *sys.argv[1:8], sys.argv[-1]
assert voxcpm.__file__.startswith(root), voxcpm.__file__
if len(sys.argv) > 9:
    from voxcpm.modules.minicpm4.cache import StaticKVCache

    StaticKVCache.__init__.__defaults__ = (*StaticKVCache.__init__.__defaults__[:-1], int(sys.argv[8]))
silence_progress()
m = build_voxcpm2(preset, seed=int(seed), dtype=dtype, device=device)
torch.manual_seed(int(seed))
wav = m.generate(text, min_len=int(steps), max_len=int(steps), inference_timesteps=2)
cache = m.base_lm.kv_cache
torch.save({"wav": wav.cpu(), "capacity": cache.storage.shape[4], "length": cache.current_length}, out)
