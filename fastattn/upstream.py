"""The fix as a patch upstream could merge: a unified diff against the installed voxcpm sources.

Written in upstream's own style, with no dependency on fastattn. Three kits (:data:`KITS`), each separable
and applying on its own. The right-sized decode changes two files:

* ``voxcpm/modules/minicpm4/cache.py``: ``StaticKVCache`` keeps its name and
  constructor (plus ``granularity``: 512 on CPU, the CPU flash kernel's key
  block; ``max_length`` elsewhere) and sizes storage with the library's own
  policy functions (:func:`fastattn.cache.fill_capacity`, ``step_capacity``,
  ``window_slots``, copied in by :func:`cache_source`): geometric growth, a
  shorter later request shrinks it, only written slots are cleared; its
  ``kv_cache`` is a view over the live window whose size torch.compile treats
  as dynamic;
* ``voxcpm/modules/minicpm4/model.py``: ``MiniCPMAttention.forward_step`` keeps
  upstream's mask, now over that window (so O(length), shapes change only at
  bucket edges, bit-identical to attending over the whole cache), and calls
  ``.contiguous()`` only on MPS (pytorch#163597), where it is needed.

The decode loops need no change: they already fetch ``get_layer_cache(i)`` each
step. The cpu-dtype kit adds a ``VOXCPM_CPU_DTYPE`` override to
``voxcpm/model/utils.py: pick_runtime_dtype`` in ``VOXCPM_MPS_DTYPE``'s style. The
decode-attention kit adds an opt-in ``MiniCPM4Config.decode_attention="live"`` (attention over
the live keys only: SDPA over the slice when eager, FlexAttention with a block mask under
``torch.compile``; the default ``"masked"`` is upstream's call). :func:`upstream_diff` builds a
kit's diff from the installed sources (their blocks must be the verified 2.0.3 text);
:func:`write_upstream_diff` stores it under ``data/``.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path

from . import compat
from .paths import data_dir

__all__ = ["LIVE_ERROR_BOUND", "upstream_diff", "write_upstream_diff", "DIFF_NAME", "LAYOUTS", "KITS",
           "patched_sources", "cache_source", "dtype_sources", "decode_attention_sources", "patched_copy",
           "decode_with_diff",
           "live_decode_check", "run_in_patched_copy", "upstream_decode"]

DIFF_NAME = "voxcpm-2.0.3-right-sized-decode.diff"

# The second, separable kit: ``VOXCPM_CPU_DTYPE``, in the style of ``VOXCPM_MPS_DTYPE`` (model/utils.py). The
# anchor is the same text in 2.0.3 and on upstream's main (which adds functions above it: the hunk applies with
# an offset).
_UTILS_OLD = '''    Users can override with ``VOXCPM_MPS_DTYPE`` (e.g. ``bfloat16``) when
    they want to test future MPS improvements.
    """
    if device != "mps":
        return configured_dtype
'''

_UTILS_NEW = '''    Users can override with ``VOXCPM_MPS_DTYPE`` (e.g. ``bfloat16``) when
    they want to test future MPS improvements.

    On CPU, ``VOXCPM_CPU_DTYPE`` (e.g. ``float32``) overrides the checkpoint's
    dtype. A CPU without native bfloat16 instructions (no AVX512-BF16 or AMX)
    runs bfloat16 through conversions to float32 and back, and can be several
    times slower than float32. float32 doubles the weights' memory and rounds
    differently from bfloat16, so it is opt-in; unset, nothing changes.
    """
    if device == "cpu":
        override = os.environ.get("VOXCPM_CPU_DTYPE", "").strip().lower()
        if override:
            if override not in _VALID_DTYPE_OVERRIDES:
                raise ValueError(
                    f"VOXCPM_CPU_DTYPE='{override}' is not one of "
                    f"{sorted(_VALID_DTYPE_OVERRIDES)}"
                )
            return override
        return configured_dtype

    if device != "mps":
        return configured_dtype
'''

_MODEL_OLD = '''        # Use an explicit broadcastable mask shape for SDPA. A 1D mask can
        # trigger a CPU-side dimension bug in some PyTorch versions.
        attn_mask = (torch.arange(key_cache.size(2), device=key_cache.device) <= position_id).view(1, 1, 1, -1)

        # ref: https://github.com/pytorch/pytorch/issues/163597
        # there is a bug in MPS for non-contiguous tensors, so we need to make them contiguous
        query_states = query_states.contiguous()
        key_cache = key_cache.contiguous()
        value_cache = value_cache.contiguous()
        attn_output = torch.nn.functional.scaled_dot_product_attention(
'''

_MODEL_NEW = '''        # Use an explicit broadcastable mask shape for SDPA. A 1D mask can
        # trigger a CPU-side dimension bug in some PyTorch versions.
        attn_mask = (torch.arange(key_cache.size(2), device=key_cache.device) <= position_id).view(1, 1, 1, -1)
        # The cache hands out views over the live window only: the valid length rounded
        # up to a bucket of slots (see StaticKVCache). The mask above and the attention below
        # therefore cost O(length) instead of O(max_length), their shapes change only at
        # bucket boundaries, and keeping the mask inside the window gives the same result
        # as attending over the whole cache.

        if query_states.device.type == "mps":
            # ref: https://github.com/pytorch/pytorch/issues/163597
            # there is a bug in MPS for non-contiguous tensors, so we need to make them contiguous.
            # Only there: elsewhere this would copy the (sliced) cache at every step.
            query_states = query_states.contiguous()
            key_cache = key_cache.contiguous()
            value_cache = value_cache.contiguous()
        attn_output = torch.nn.functional.scaled_dot_product_attention(
'''

# The third kit, separable from both: an opt-in decode attention that reads only the live keys, as a
# MiniCPM4Config field (``decode_attention``, default "masked": today's exact call). Its hunks touch lines
# the right-sized kit does not, so the two apply in either order.
_CONFIG_OLD = """    kv_channels: int = None
    no_rope: bool = False
"""

_CONFIG_NEW = """    kv_channels: int = None
    no_rope: bool = False
    # Decode attention (one new token per step). "masked" (default): every slot of the KV cache
    # under a mask, exactly as before. "live": only the valid keys, O(position) per step instead
    # of O(max_length): SDPA over the slice when eager; under torch.compile (optimize())
    # FlexAttention with a block mask that skips the blocks past the position, so shapes stay
    # static and one graph serves the whole decode. "live" rounds differently from "masked"
    # (within the dtype's rounding; not bit-identical), so it is opt-in. Set it in config.json's
    # lm_config, or on a loaded model before optimize(): model.base_lm.config.decode_attention
    # = "live" (and residual_lm's).
    decode_attention: Literal["masked", "live"] = "masked"
"""

_MODEL_IMPORTS_OLD = """from typing import List, Tuple
import math
from .cache import StaticKVCache
"""

_MODEL_IMPORTS_NEW = """from typing import List, Tuple
import math
from .cache import StaticKVCache

try:  # torch >= 2.5
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
except ImportError:  # pragma: no cover
    BlockMask = flex_attention = None

# FlexAttention's key block: a decode step reads blocks [0, position // FLEX_BLOCK] only.
FLEX_BLOCK = 128


def _decode_block_mask(position_id: torch.Tensor, n_keys: int) -> "BlockMask":
    # Built from tensor ops on position_id: no host sync, the same shapes at every step.
    n_blocks = (n_keys + FLEX_BLOCK - 1) // FLEX_BLOCK
    idx = torch.arange(n_blocks, device=position_id.device, dtype=torch.int32).view(1, 1, 1, -1)
    last = position_id.reshape(-1)
    length = last[0] + 1
    full = (length // FLEX_BLOCK).to(torch.int32)  # blocks every key of which is valid: no mask needed
    partial = (length % FLEX_BLOCK != 0).to(torch.int32)  # the block holding the last key, masked inside
    partial_idx = torch.where(idx == 0, full.clamp(max=n_blocks - 1), idx)

    def mask_mod(b, h, q_idx, kv_idx):
        return kv_idx <= last[0]

    return BlockMask.from_kv_blocks(
        partial.view(1, 1, 1),
        partial_idx,
        full.view(1, 1, 1),
        idx,
        BLOCK_SIZE=(FLEX_BLOCK, FLEX_BLOCK),
        mask_mod=mask_mod,
        seq_lengths=(1, n_keys),
    )


def live_decode_attention(query_states, key_cache, value_cache, position_id):
    \"\"\"Decode attention over keys [0, position_id] of the cache only (``decode_attention="live"``).

    Eager: SDPA over the slice with no mask (reads the position on the host: a sync on CUDA).
    Compiled: FlexAttention over the whole cache with a block mask built in the graph, so no
    host read, static shapes and one graph for the whole decode; blocks past the position are
    never read. query_states (B, H, 1, D); key_cache, value_cache (B, H_kv, max_length, D).
    \"\"\"
    if torch.compiler.is_compiling() and flex_attention is not None:
        block_mask = _decode_block_mask(torch.as_tensor(position_id), key_cache.size(2))
        return flex_attention(query_states, key_cache, value_cache, block_mask=block_mask, enable_gqa=True)
    length = int(position_id) + 1
    key_cache, value_cache = key_cache[:, :, :length], value_cache[:, :, :length]
    if query_states.device.type == "mps":  # ref: https://github.com/pytorch/pytorch/issues/163597
        query_states, key_cache, value_cache = (t.contiguous() for t in (query_states, key_cache, value_cache))
    return torch.nn.functional.scaled_dot_product_attention(query_states, key_cache, value_cache, enable_gqa=True)
"""

_MODEL_LIVE_OLD = """        key_cache[:, :, position_id, :] = key_states
        value_cache[:, :, position_id, :] = value_states

"""

_MODEL_LIVE_NEW = """        key_cache[:, :, position_id, :] = key_states
        value_cache[:, :, position_id, :] = value_states

        if self.config.decode_attention == "live":
            attn_output = live_decode_attention(query_states, key_cache, value_cache, position_id)
            attn_output = attn_output.transpose(1, 2).contiguous()
            attn_output = attn_output.reshape(bsz, self.num_heads * self.head_dim)
            return self.o_proj(attn_output)
        if self.config.decode_attention != "masked":
            raise ValueError(f"decode_attention must be 'masked' or 'live', got {self.config.decode_attention!r}")

"""

_CACHE_HEAD = """import sys
from typing import List, Tuple

import torch

# torch's CPU flash-attention kernel (what SDPA runs for the masked decode call on CPU) walks the keys in
# blocks of {block}. A window whose size is a multiple of {block} hands it the same blocks as the whole cache (the
# whole cache's extra blocks are fully masked and add exact zeros), so the result is bit-identical. Other
# kernels (CUDA's) give no such guarantee: there the window is the whole cache, allocated once.
CPU_KEY_BLOCK = {block}
"""

_CACHE_CLASS = '''

class StaticKVCache:
    """KV cache of the decode loop, sized to the request.

    Storage is not allocated and zero-filled for ``max_length`` tokens on every request: a
    request starts with its prefill rounded up to ``granularity`` slots, the capacity doubles
    when decoding reaches its end (so a long request moves its storage O(log n) times), and a
    later shorter request shrinks it back. Bound after every fill and step:
    ``capacity <= min(max(2 * current_length, granularity), max_length)``. Only slots an
    earlier request wrote are cleared. ``kv_cache`` is a view over the live window (the valid
    length rounded up to ``granularity``), so a decode step attends over O(length) keys; slots
    past the valid length inside the window are zeros and masked. The window's size is marked
    dynamic for torch.compile. Fetch the layer views after ``step()``: growing moves the storage.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        dim_kv_head: int,
        batch_size: int,
        device: torch.device,
        dtype: torch.dtype,
        max_length: int = 8192,
        granularity: int = None,
    ):
        self.max_length = max_length
        self.num_layers = num_layers
        self.shape = (num_layers, batch_size, num_kv_heads, dim_kv_head)
        self.device = torch.device(device)
        self.dtype = dtype
        if granularity is None:
            granularity = CPU_KEY_BLOCK if self.device.type == "cpu" else max_length
        self.granularity = granularity

        self.current_length = 0
        self.written = 0  # slots [0, written) may hold values; past it the storage is zeros
        self.storage = self._zeros(fill_capacity(0, 0, granularity, max_length))
        self._set_window()

    def _zeros(self, capacity: int) -> torch.Tensor:
        layers, batch, heads, dim = self.shape
        return torch.zeros(2, layers, batch, heads, capacity, dim, device=self.device, dtype=self.dtype)

    def _set_window(self):
        self.window = window_slots(self.current_length, self.storage.size(4), self.granularity)
        self.kv_cache = self.storage[:, :, :, :, : self.window]
        if self.granularity < self.max_length:  # a window that never changes stays static, as before
            _mark_dynamic(self.kv_cache, 4)

    def get_layer_cache(self, layer_idx: int) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.kv_cache[0, layer_idx], self.kv_cache[1, layer_idx]

    def step(self) -> int:
        if self.current_length >= self.max_length:
            raise ValueError("KV cache is full")

        ret = self.current_length
        capacity = step_capacity(ret, self.storage.size(4), self.granularity, self.max_length)
        if capacity != self.storage.size(4):
            storage = self._zeros(capacity)
            storage[:, :, :, :, :ret] = self.storage[:, :, :, :, :ret]
            self.storage = storage
            self.written = ret
        self.current_length = ret + 1
        self.written = max(self.written, ret + 1)
        self._set_window()
        return ret

    def fill_caches(self, kv_caches: List[Tuple[torch.Tensor, torch.Tensor]]):
        length = kv_caches[0][0].size(2)
        if length > self.max_length:
            raise ValueError("KV cache is full")
        capacity = fill_capacity(length, self.storage.size(4), self.granularity, self.max_length)
        if capacity != self.storage.size(4):
            self.storage = self._zeros(capacity)
        elif self.written > length:
            # only what an earlier request wrote past this one's prefix
            self.storage[:, :, :, :, length : self.written].zero_()
        for i in range(self.num_layers):
            self.storage[0, i, :, :, :length, :] = kv_caches[i][0]
            self.storage[1, i, :, :, :length, :] = kv_caches[i][1]
        self.current_length = length
        self.written = length
        self._set_window()
'''


def cache_source() -> str:
    """The diff's ``cache.py``: the library's sizing functions and window mark (one source), the CPU kernel's
    key block from :mod:`fastattn.exactness`, and upstream's class."""
    import inspect

    from . import cache as lib
    from .exactness import CPU_FLASH_KEY_BLOCK
    sizing = "\n\n\n".join(inspect.getsource(f).rstrip() for f in (lib.fill_capacity, lib.step_capacity,
                                                                    lib.window_slots, lib._mark_dynamic))
    return _CACHE_HEAD.format(block=CPU_FLASH_KEY_BLOCK) + "\n\n" + sizing + "\n" + _CACHE_CLASS


def _installed(rel: str) -> Path:
    compat.ensure_torchaudio()
    import voxcpm

    return Path(voxcpm.__file__).parent / rel


def patched_sources() -> dict:
    """``{relative path: (old text, new text)}`` for each file the upstream patch changes."""
    model_rel, cache_rel = "modules/minicpm4/model.py", "modules/minicpm4/cache.py"
    model_old = _installed(model_rel).read_text()
    model_new = _replace_once(model_old, _MODEL_OLD, _MODEL_NEW, model_rel)
    cache_old = _installed(cache_rel).read_text()
    if "self.kv_cache.zero_()" not in cache_old:
        raise RuntimeError(f"voxcpm/{cache_rel}: not the 2.0.3 StaticKVCache")
    return {
        f"voxcpm/{model_rel}": (model_old, model_new),
        f"voxcpm/{cache_rel}": (cache_old, cache_source()),
    }


def dtype_sources() -> dict:
    """``{relative path: (old text, new text)}`` of the CPU dtype override (``voxcpm/model/utils.py``)."""
    rel = "model/utils.py"
    old = _installed(rel).read_text()
    return {f"voxcpm/{rel}": (old, _replace_once(old, _UTILS_OLD, _UTILS_NEW, rel))}



def _replace_once(text: str, old: str, new: str, where: str) -> str:
    if text.count(old) != 1:
        raise RuntimeError(f"voxcpm/{where}: the block this kit replaces was not found exactly once; the installed "
                           "voxcpm is not 2.0.3")
    return text.replace(old, new)


def decode_attention_sources() -> dict:
    """``{relative path: (old text, new text)}`` of the opt-in ``decode_attention="live"`` (config and layer)."""
    config_rel, model_rel = "modules/minicpm4/config.py", "modules/minicpm4/model.py"
    config_old, model_old = _installed(config_rel).read_text(), _installed(model_rel).read_text()
    config_new = _replace_once(config_old, _CONFIG_OLD, _CONFIG_NEW, config_rel)
    config_new = _replace_once(config_new, "from typing import List\n", "from typing import List, Literal\n",
                               config_rel)
    model_new = _replace_once(model_old, _MODEL_IMPORTS_OLD, _MODEL_IMPORTS_NEW, model_rel)
    model_new = _replace_once(model_new, _MODEL_LIVE_OLD, _MODEL_LIVE_NEW, model_rel)
    return {f"voxcpm/{config_rel}": (config_old, config_new), f"voxcpm/{model_rel}": (model_old, model_new)}

#: layout -> (diff file under data/, path prefix of the package in the target tree)
LAYOUTS = {
    "wheel": (DIFF_NAME, ""),                            # site-packages/voxcpm/... (voxcpm 2.0.3 installed)
    "src": ("voxcpm-main-src-right-sized-decode.diff", "src/"),  # upstream main: src/voxcpm/...
}

#: kit -> (its sources, {layout: diff file under data/}, its upstream test file); each kit applies on its own
KITS = {
    "right-sized": (patched_sources, {k: v[0] for k, v in LAYOUTS.items()}, "test_minicpm4_right_sized_cache.py"),
    "cpu-dtype": (dtype_sources, {"wheel": "voxcpm-2.0.3-cpu-dtype-override.diff",
                                  "src": "voxcpm-main-src-cpu-dtype-override.diff"}, "test_cpu_dtype_override.py"),
    "decode-attention": (decode_attention_sources, {"wheel": "voxcpm-2.0.3-live-decode-attention.diff",
                                                    "src": "voxcpm-main-src-live-decode-attention.diff"},
                         "test_minicpm4_decode_attention.py"),
}


def upstream_diff(layout: str = "wheel", kit: str = "right-sized") -> str:
    """The unified diff of ``kit`` (:data:`KITS`; ``a/`` and ``b/`` prefixes, apply with ``patch -p1``):
    ``layout="wheel"`` inside site-packages (voxcpm 2.0.3), ``"src"`` at the root of upstream's repository
    (``src/voxcpm/``; its ``modules/minicpm4`` is unchanged since 2.0.3, and the dtype hunk's context is the same
    text there)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {sorted(LAYOUTS)}, got {layout!r}")
    if kit not in KITS:
        raise ValueError(f"kit must be one of {sorted(KITS)}, got {kit!r}")
    prefix = LAYOUTS[layout][1]
    parts = []
    for rel, (old, new) in sorted(KITS[kit][0]().items(), key=lambda kv: kv[0], reverse=True):
        parts.extend(difflib.unified_diff(old.splitlines(keepends=True), new.splitlines(keepends=True),
                                          fromfile=f"a/{prefix}{rel}", tofile=f"b/{prefix}{rel}", n=3))
    return "".join(parts)


def write_upstream_diff(path: Path | None = None, layout: str = "wheel", kit: str = "right-sized") -> Path:
    """Write :func:`upstream_diff` for ``layout`` and ``kit`` to ``data/`` (or ``path``) and return the path."""
    path = Path(path) if path else data_dir() / KITS[kit][1][layout]
    path.write_text(upstream_diff(layout, kit))
    return path


def patched_copy(dest, kit: str = "right-sized") -> Path:
    """Copy the installed voxcpm package under ``dest`` and apply ``kit``'s wheel diff to it with ``patch -p1``.
    Returns ``dest``: put it first on ``PYTHONPATH`` (in a fresh process) to import the patched package."""
    import shutil
    import subprocess

    if kit not in KITS:
        raise ValueError(f"kit must be one of {sorted(KITS)}, got {kit!r}")
    diff = data_dir() / KITS[kit][1]["wheel"]
    dest = Path(dest)
    shutil.copytree(_installed(""), dest / "voxcpm", ignore=shutil.ignore_patterns("__pycache__"))
    r = subprocess.run(["patch", "-p1", "--batch", "-i", str(diff)], cwd=dest, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"{diff.name} ({kit} kit) did not apply to a copy of the installed voxcpm: "
                           f"{r.stdout}{r.stderr}")
    return dest


def run_in_patched_copy(kit: str, script: str, *args, timeout: int = 1800, env: dict | None = None) -> dict:
    """Run ``script`` (``python -c``) in a fresh process that imports a copy of voxcpm with ``kit``'s diff applied
    (:func:`patched_copy`), with ``argv = [root, *args, out]`` and ``env`` added to this environment; return what it
    ``torch.save``-d to ``out``. A failing script raises RuntimeError with the end of its stderr."""
    import subprocess
    import sys
    import tempfile

    import torch
    with tempfile.TemporaryDirectory() as tmp:
        root = patched_copy(Path(tmp) / "pkg", kit=kit)
        out = Path(tmp) / "out.pt"
        r = subprocess.run([sys.executable, "-c", script, str(root), *map(str, args), str(out)], capture_output=True,
                           text=True, env={**os.environ, **(env or {}), "PYTHONPATH": str(root)}, timeout=timeout)
        if r.returncode:
            raise RuntimeError(f"running through the {kit} kit failed: {r.stderr[-2000:]}")
        return torch.load(out)


def upstream_decode(preset: str, *, text: str, steps: int, dtype: str, seed: int, device: str, prepare=None):
    """Upstream's decode here (unpatched), from ``seed``: the waveform every kit's decode is compared with.
    ``prepare(model)`` runs before it (e.g. voxcpm's own ``optimize()``). Returns (model, waveform on CPU)."""
    import torch

    from .models import build_voxcpm2
    model = build_voxcpm2(preset, seed=seed, dtype=dtype, device=device)
    if prepare is not None:
        prepare(model)
    torch.manual_seed(seed)
    return model, model.generate(text, min_len=steps, max_len=steps, inference_timesteps=2).cpu()


_DECODE_SCRIPT = """
import sys, torch, fastattn, voxcpm
from fastattn.models import build_voxcpm2, silence_progress
assert voxcpm.__file__.startswith(sys.argv[1]), voxcpm.__file__
silence_progress()
preset, dtype, text, device, out = sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[7], sys.argv[8]
steps, seed = int(sys.argv[5]), int(sys.argv[6])
m = build_voxcpm2(preset, seed=seed, dtype=dtype, device=device)
torch.manual_seed(seed)
wav = m.generate(text, min_len=steps, max_len=steps, inference_timesteps=2)
cache = m.base_lm.kv_cache
torch.save({"wav": wav.cpu(), "capacity": cache.storage.shape[4], "length": cache.current_length}, out)
"""


def decode_with_diff(preset: str, *, text: str, steps: int, dtype: str = "bfloat16", seed: int = 0,
                     device="cpu") -> dict:
    """Decode with the upstream diff itself applied (a patched copy of voxcpm, imported in a fresh process),
    then unpatched here from the same seed, both on ``device`` (the diff's CUDA branch keeps ``max_length``
    slots): ``{"identical", "max_abs_diff", "diff_capacity", "length", "device"}``."""
    import torch

    from .devices import resolve_device
    device = str(resolve_device(device))
    res = run_in_patched_copy("right-sized", _DECODE_SCRIPT, preset, dtype, text, steps, seed, device)
    model, ref = upstream_decode(preset, text=text, steps=steps, dtype=dtype, seed=seed, device=device)
    same = ref.shape == res["wav"].shape
    return {"identical": bool(same and torch.equal(ref, res["wav"])),
            "max_abs_diff": float((ref.double() - res["wav"].double()).abs().max()) if same else float("inf"),
            "diff_capacity": int(res["capacity"]), "upstream_capacity": int(model.base_lm.kv_cache.kv_cache.shape[4]),
            "length": int(res["length"]), "device": device}


_LIVE_SCRIPT = """
import copy, json, sys, torch, fastattn, voxcpm
from torch._dynamo.utils import counters
from fastattn.core import f64_attention
from fastattn.models import build_voxcpm2, silence_progress
from voxcpm.modules.minicpm4.model import apply_rotary_pos_emb
assert voxcpm.__file__.startswith(sys.argv[1]), voxcpm.__file__
silence_progress()
preset, dtype, text, device, lengths, out = sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[7], sys.argv[8], sys.argv[9]
steps, seed = int(sys.argv[5]), int(sys.argv[6])
m = build_voxcpm2(preset, seed=seed, dtype=dtype, device=device)
lms = (m.base_lm, m.residual_lm)
assert all(layer.self_attn.config is lm.config for lm in lms for layer in lm.layers)
res = {"rows": []}

def decode(mode):
    for lm in lms:
        lm.config.decode_attention = mode
    torch.manual_seed(seed)
    return m.generate(text, min_len=steps, max_len=steps, inference_timesteps=2).cpu()

res["masked"] = decode("masked")
res["live"] = decode("live")
res["live_again"] = decode("live")
# upstream's optimize() compiles forward_step with fullgraph=True (CUDA only); here the same compile, cheap backend
eager_steps = {lm: lm.forward_step for lm in lms}
for lm in lms:
    lm.forward_step = torch.compile(lm.forward_step, backend="eager", fullgraph=True)
counters.clear()
res["live_compiled"] = decode("live")
res["rows"].append({"mode": "live", "phase": "compiled (fullgraph, eager backend)",
                    "unique_graphs": counters["stats"]["unique_graphs"],
                    "graph_breaks": sum(counters["graph_break"].values())})
for lm in lms:
    lm.forward_step = eager_steps[lm]

@torch.no_grad()
def step_error(attn, n, mode, g):
    # layer 0 of the base LM, one decode step with n keys afterwards, in the model's dtype, against float64
    a = copy.deepcopy(attn)
    a.config = a.config.model_copy(update={"decode_attention": mode})
    dt = next(a.parameters()).dtype
    kc = torch.randn(1, a.num_key_value_heads, m.base_lm.kv_cache.max_length, a.head_dim, generator=g).to(device, dt)
    vc = torch.randn_like(kc)
    x = (torch.randn(1, a.hidden_size, generator=g) * 0.1).to(device, dt)
    pos = torch.tensor([n - 1], device=device)
    cos, sin = m.base_lm.rope_emb(pos)
    q = a.q_proj(x).view(1, 1, a.num_heads, a.head_dim).transpose(1, 2)
    k = a.k_proj(x).view(1, 1, a.num_key_value_heads, a.head_dim).transpose(1, 2)
    v = a.v_proj(x).view(1, 1, a.num_key_value_heads, a.head_dim).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    kt, vt = kc.clone(), vc.clone()
    kt[:, :, n - 1], vt[:, :, n - 1] = k[:, :, 0], v[:, :, 0]
    want = f64_attention(q, kt, vt, n).transpose(1, 2).reshape(1, -1) @ a.o_proj.weight.double().T
    got = a.forward_step(x, (cos, sin), pos, (kc, vc))
    return (got.double() - want).abs().max().item()

g = torch.Generator().manual_seed(seed)
errs = {"masked": [], "live": []}
for n in json.loads(lengths):
    state = g.get_state()
    for mode in errs:
        g.set_state(state)
        errs[mode].append(step_error(m.base_lm.layers[0].self_attn, n, mode, g))
res["step_errors"] = errs
torch.save(res, out)
"""


#: the decode-attention kit's accuracy contract: "live"'s worst step error against float64 is at most this many
#: times "masked"'s (the bound its upstream tests assert)
LIVE_ERROR_BOUND = 2


def live_decode_check(preset: str, *, text: str, steps: int, dtype: str = "float32", seed: int = 0, device="cpu",
                      lengths=(1, 127, 128, 129, 255, 256, 257, 511, 512, 513, 1000)) -> dict:
    """The ``decode-attention`` kit itself (a patched copy of voxcpm in a fresh process): a whole decode with
    ``decode_attention`` off ("masked") and on ("live"), and on under a ``fullgraph`` compile (the eager backend:
    upstream's ``optimize()`` compiles only on CUDA, where ``gpu-check`` runs it); the decode off compared
    with upstream decoding here from the same seed; one attention step of the base LM's first layer in each mode
    against float64 (the q/k/v projections and rotary in the model's dtype, then float64) at ``lengths`` keys.

    Returns ``identical_off`` (off is ``torch.equal`` to upstream), ``max_abs_diff_on`` (on vs off: a
    free-running decode may diverge within rounding), ``deterministic_on`` (two decodes on, the same bits),
    ``step_errors`` ({mode: [max abs error per length]}), ``error_ratio`` (live's worst over masked's worst),
    ``error_bound`` (:data:`LIVE_ERROR_BOUND`, what the kit's tests bound it by), ``rows`` (the compiled
    decode's graphs: one per LM) and ``max_abs_diff_compiled`` (compiled "live" vs eager "live": FlexAttention
    against the slice, within rounding)."""
    import json

    import torch

    from .devices import resolve_device
    device = str(resolve_device(device))
    res = run_in_patched_copy("decode-attention", _LIVE_SCRIPT, preset, dtype, text, steps, seed, device,
                              json.dumps(list(lengths)))
    _, ref = upstream_decode(preset, text=text, steps=steps, dtype=dtype, seed=seed, device=device)
    same = ref.shape == res["masked"].shape == res["live"].shape
    err = res["step_errors"]
    return {"identical_off": bool(same and torch.equal(ref, res["masked"])),
            "max_abs_diff_on": float((res["live"].double() - res["masked"].double()).abs().max()) if same
            else float("inf"),
            "max_abs_diff_compiled": float((res["live_compiled"].double() - res["live"].double()).abs().max())
            if res["live_compiled"].shape == res["live"].shape else float("inf"),
            "deterministic_on": bool(torch.equal(res["live"], res["live_again"])),
            "step_errors": err, "lengths": list(lengths),
            "error_ratio": max(err["live"]) / max(max(err["masked"]), 1e-300), "error_bound": LIVE_ERROR_BOUND,
            "rows": res["rows"], "device": device, "dtype": dtype, "steps": steps}


def main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="python -m fastattn diff", description="The upstream-ready diff.")
    ap.add_argument("--write", action="store_true",
                    help="write every kit's diffs under data/ (" + ", ".join(f for _, d, _ in KITS.values()
                                                                        for f in d.values()) + "), not print")
    ap.add_argument("--layout", choices=sorted(LAYOUTS), default="wheel",
                    help="print the diff for site-packages (wheel) or upstream's repository (src)")
    ap.add_argument("--kit", choices=sorted(KITS), default="right-sized",
                    help="the right-sized decode (default), the separable VOXCPM_CPU_DTYPE override, or the "
                         "opt-in decode_attention='live'")
    args = ap.parse_args(argv)
    if args.write:
        for kit in KITS:
            for layout in LAYOUTS:
                print(write_upstream_diff(layout=layout, kit=kit))
    else:
        print(upstream_diff(args.layout, args.kit), end="")
    return 0
