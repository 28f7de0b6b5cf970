"""Apply fastattn's decode attention and right-sized cache to the installed ``voxcpm``, reversibly.

What :func:`patch_voxcpm` replaces, at class level (so every MiniCPM model,
VoxCPM 1 and 2, built before or after, gets it):

* ``MiniCPMAttention.forward_step``: upstream's projections, rotary embedding
  and cache write, then :func:`fastattn.attention_step` in the chosen mode over
  the views the model step hands it (no ``.contiguous()`` except on MPS, where
  upstream needs it for pytorch#163597);
* ``MiniCPMModel.forward_step``: upstream's loop, handing each layer cache
  views cut to what the mode needs: the bucketed window for ``exact``, exactly
  the live length for ``fast``, the whole cache for ``reference``. The cut
  comes from the cache's own bookkeeping (a host int that, for ``exact`` with
  the right-sized cache, changes only at bucket boundaries): no device-to-host
  sync per layer or per step;
* with ``cache=True``, ``MiniCPMModel.setup_cache`` builds a
  :class:`fastattn.RightSizedKVCache` instead of an 8192-slot ``StaticKVCache``.

Granularity (``bucket=None``, the default): calibrated per model geometry,
device and dtype when a cache is built or converted
(:func:`fastattn.exactness.exact_granularity`: on CPU the flash kernel's
512-key block). The right-sized cache's windows end on that granularity, so
``exact`` stays bit-identical to upstream's 8192-slot call. Where no window is
provably exact (CUDA), the cache holds ``max_length`` slots allocated once and
cleared only where a request wrote, and ``exact`` attends over all of them:
upstream's computation without its per-request full zero-fill.
:func:`patch_status` reports each choice.

Safety: each patched function's installed source is fingerprinted and must
match a version verified here (voxcpm 2.0.3), else the patch refuses unless
``force=True``. A model whose ``forward_step`` was already wrapped by
``torch.compile`` (voxcpm's ``optimize()``) is refused: a class patch would be
silently ignored by the compiled function. ``revert()`` restores the original
function objects (identity) and gives converted models upstream caches again.
"""

from __future__ import annotations

import hashlib
import inspect
import threading
import weakref
from contextlib import contextmanager
from typing import Optional

import torch

from . import compat
from .devices import package_version
from .attention import _attend, _check_bucket
from .modes import REGISTRY, mode_spec
from .exactness import exact_granularity, exactness_report
from .fast import grouped_window
from .cache import RightSizedKVCache

__all__ = ["patch_voxcpm", "patch_status", "VoxcpmPatch", "PatchError", "fingerprints", "VERIFIED", "TARGETS",
           "installed_functions"]

#: sha256 (first 16 hex digits) of ``inspect.getsource`` of each function the patch replaces, per verified voxcpm.
VERIFIED = {
    "2.0.3": {
        "MiniCPMAttention.forward_step": "2b730666fa326000",
        "MiniCPMModel.forward_step": "c57e54736e9605d4",
        "MiniCPMModel.setup_cache": "25589fe7bc969f55",
        "StaticKVCache": "e3aa825b63d0b840",
    },
}


class PatchError(RuntimeError):
    """The patch cannot be applied as asked (unknown voxcpm source, compiled model, conflicting settings)."""


def _modules():
    compat.ensure_torchaudio()
    from voxcpm.modules.minicpm4 import cache as cache_mod
    from voxcpm.modules.minicpm4 import model as model_mod

    return model_mod, cache_mod


def _installed(name: str):
    """The class attribute ``"Class.attr"`` of voxcpm's MiniCPM model module, as installed now."""
    cls, attr = name.split(".")
    return getattr(_modules()[0], cls).__dict__[attr]


def _install(name: str, fn) -> None:
    cls, attr = name.split(".")
    setattr(getattr(_modules()[0], cls), attr, fn)


def _targets():
    """What the fingerprints cover: every patched function, and the cache class the patch stands in for."""
    return {**{name: _installed(name) for name in TARGETS}, "StaticKVCache": _modules()[1].StaticKVCache}


def fingerprints() -> dict:
    """Fingerprint of each function the patch replaces, as installed now (unpatched originals when applied)."""
    targets = _targets()
    if _ACTIVE is not None:
        for name, fn in _ACTIVE._originals.items():
            targets[name] = fn
    return {name: hashlib.sha256(inspect.getsource(obj).encode()).hexdigest()[:16] for name, obj in targets.items()}


def _voxcpm_version() -> str:
    return package_version("voxcpm")


def _verify(force: bool) -> dict:
    found = fingerprints()
    for ver, known in VERIFIED.items():
        if known == found:
            return {"verified_as": ver, "forced": False}
    changed = sorted(name for name in found if all(k.get(name) != found[name] for k in VERIFIED.values()))
    msg = (f"installed voxcpm {_voxcpm_version()} differs from the versions fastattn verified "
           f"({', '.join(VERIFIED)}): changed source in {', '.join(changed)}. The patch replaces these "
           "functions, so upstream changes there would be lost. Review them, then pass force=True "
           "to patch anyway.")
    if not force:
        raise PatchError(msg)
    return {"verified_as": None, "forced": True, "changed": changed}


# --------------------------------------------------------------------------- patched functions
_MODEL_STEP = threading.local()  # .cut: the patched model step is handing its layers views cut to the live keys


def _make_attention_forward_step(mode: str, bucket):
    from voxcpm.modules.minicpm4.model import apply_rotary_pos_emb

    spec = REGISTRY[mode]
    unmasked = not spec.masked  # such a mode attends to every key it is handed: never hand it more than live

    def forward_step(self, hidden_states, position_emb, position_id, kv_cache):
        bsz, _ = hidden_states.size()

        query_states = self.q_proj(hidden_states)
        key_states = self.k_proj(hidden_states)
        value_states = self.v_proj(hidden_states)

        query_states = query_states.view(bsz, 1, self.num_heads, self.head_dim).transpose(1, 2)
        key_states = key_states.view(bsz, 1, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        value_states = value_states.view(bsz, 1, self.num_key_value_heads, self.head_dim).transpose(1, 2)

        if position_emb is not None:
            cos, sin = position_emb
            query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

        key_cache, value_cache = kv_cache  # views cut by the model step (see _make_model_forward_step)
        graph = unmasked and torch.compiler.is_compiling()
        if unmasked and not graph and not getattr(_MODEL_STEP, "cut", False):
            # called directly (not from the patched model step, whose views hold exactly the live keys):
            # never attend past the position. Reads the position (free on CPU, a sync on CUDA).
            n = _live(position_id)
            key_cache, value_cache = key_cache[:, :, :n], value_cache[:, :, :n]
        key_cache[:, :, position_id, :] = key_states
        value_cache[:, :, position_id, :] = value_states

        if query_states.device.type == "mps":  # pytorch#163597, as upstream; a copy elsewhere
            query_states = query_states.contiguous()
            key_cache = key_cache.contiguous()
            value_cache = value_cache.contiguous()

        # fastattn.attention_step's computation without its argument checks (shapes come from the model).
        n_keys = key_cache.size(2)
        if graph:  # compiled fast: the cache's window, masked inside the grouped form (shapes change at edges only)
            attn_output = grouped_window(query_states, key_cache, value_cache, position_id + 1)
        elif unmasked:  # the views hold exactly the live keys
            attn_output = _attend(query_states, key_cache, value_cache, n_keys, mode, bucket, None)
        else:
            length = position_id + 1  # a device tensor in voxcpm's loop: no host sync
            window = n_keys if spec.windowed else None
            attn_output = _attend(query_states, key_cache, value_cache, length, mode, bucket, window)

        attn_output = attn_output.transpose(1, 2).contiguous()
        attn_output = attn_output.reshape(bsz, self.num_heads * self.head_dim)
        return self.o_proj(attn_output)

    forward_step.__fastattn__ = ("MiniCPMAttention.forward_step", mode, bucket)
    return forward_step


def _make_model_forward_step(mode: str, bucket):
    unmasked = not REGISTRY[mode].masked

    def forward_step(self, inputs_embeds, position_id):
        assert self.kv_cache is not None, "KV cache is not setup"
        position_emb = self.rope_emb(position_id) if self.rope_emb is not None else None
        hidden_states = inputs_embeds
        cache = self.kv_cache
        graph = unmasked and torch.compiler.is_compiling()  # compiled unmasked modes keep the window views
        cut = None if graph else _keys_for(self, cache, mode, bucket)
        if unmasked and not graph:  # tell the layers their views hold exactly the live keys
            _MODEL_STEP.cut = True
        try:
            for i, decoder_layer in enumerate(self.layers):
                k, v = cache.get_layer_cache(i)
                if cut is not None:
                    k, v = k[:, :, :cut], v[:, :, :cut]
                hidden_states = decoder_layer.forward_step(hidden_states, position_emb, position_id, (k, v))
        finally:
            if unmasked and not graph:
                _MODEL_STEP.cut = False
        return self.norm(hidden_states)

    forward_step.__fastattn__ = ("MiniCPMModel.forward_step", mode, bucket)
    return forward_step


def _keys_for(lm, cache, mode: str, bucket) -> Optional[int]:
    """How many keys of the cache's views the layers get (the mode's ``keys`` rule); None = the views as they are.

    Reads only the cache's host-side bookkeeping. ``current_length`` is the
    position just claimed by ``step()`` plus one.
    """
    spec = REGISTRY[mode]
    g = None
    if spec.windowed:
        if isinstance(cache, RightSizedKVCache):
            return None  # its views are already the calibrated window (changes only at granularity edges)
        g = getattr(cache, "_fastattn_granularity", False)
        if g is False:  # upstream's StaticKVCache: calibrate once for this cache's geometry
            k = cache.kv_cache
            g = bucket if bucket is not None else _granularity(lm.config, k.device, k.dtype, cache.max_length)
            cache._fastattn_granularity = g
    n = spec.keys(cache.current_length, cache.max_length, g)
    return None if n >= cache.max_length else n


def _head_dim(config) -> int:
    return config.hidden_size // config.num_attention_heads if config.kv_channels is None else config.kv_channels


def _granularity(config, device, dtype, max_length: int) -> Optional[int]:
    """Calibrated exact window granularity for one decode step (Lq = 1) of this LM's geometry."""
    return exact_granularity(torch.device(device), dtype, hq=config.num_attention_heads,
                             hkv=config.num_key_value_heads, head_dim=_head_dim(config), capacity=max_length, lq=1)


def _cache_bucket(config, device, dtype, max_length: int, bucket) -> int:
    """The right-sized cache's granularity: the caller's int, the calibrated one, or the whole
    ``max_length`` (rounded up to 16) where no window is exact."""
    if bucket is not None:
        return bucket
    g = _granularity(config, device, dtype, max_length)
    return g if g is not None else -(-max_length // 16) * 16


def _live(position_id) -> int:
    return int(position_id.reshape(-1)[-1]) + 1 if isinstance(position_id, torch.Tensor) else int(position_id) + 1


def _make_setup_cache(bucket):
    def setup_cache(self, batch_size, max_length, device, dtype):
        self.kv_cache = RightSizedKVCache(
            num_layers=self.config.num_hidden_layers,
            num_kv_heads=self.config.num_key_value_heads,
            dim_kv_head=_head_dim(self.config),
            batch_size=batch_size, device=device, dtype=dtype, max_length=max_length,
            bucket=_cache_bucket(self.config, device, dtype, max_length, bucket),
        )

    setup_cache.__fastattn__ = ("MiniCPMModel.setup_cache", bucket)
    return setup_cache


#: The one table of what the patch replaces: ``"Class.attr"`` -> (replacement factory(mode, bucket), only with
#: ``cache=True``). Originals, swapping, revert, status, fingerprints, notebook 04 and the tests read it.
TARGETS = {
    "MiniCPMAttention.forward_step": (_make_attention_forward_step, False),
    "MiniCPMModel.forward_step": (_make_model_forward_step, False),
    "MiniCPMModel.setup_cache": (lambda mode, bucket: _make_setup_cache(bucket), True),
}


def variant_functions(mode: str = "exact", *, cache: bool = True, bucket: Optional[int] = None) -> dict:
    """The class functions a patch with these settings installs, by name (for side-by-side benchmarks)."""
    _modules()
    return {name: make(mode, bucket) for name, (make, needs_cache) in TARGETS.items() if cache or not needs_cache}


def installed_functions() -> dict:
    """What voxcpm's classes hold now for every patched name (patched or not)."""
    return {name: _installed(name) for name in TARGETS}


def original_functions() -> dict:
    """Upstream's class functions (the saved originals while a patch is applied)."""
    fns = installed_functions()
    if _ACTIVE is not None:
        fns.update(_ACTIVE._originals)
    return fns


@contextmanager
def swapped(fns: dict):
    """Install class functions by name for the duration of a block, then put back what was there.

    A benchmark's tool for interleaving variants call by call; it bypasses the
    fingerprint check, so use :func:`patch_voxcpm` for anything else.
    """
    saved = {name: _installed(name) for name in fns}
    for name, fn in fns.items():
        _install(name, fn)
    try:
        yield
    finally:
        for name, fn in saved.items():
            _install(name, fn)


# --------------------------------------------------------------------------- the handle
_LOCK = threading.RLock()
_ACTIVE: Optional["VoxcpmPatch"] = None


def _lms(model):
    lms = [getattr(model, name, None) for name in ("base_lm", "residual_lm")]
    lms = [lm for lm in lms if lm is not None]
    if not lms:
        raise TypeError(f"model must be a voxcpm VoxCPM/VoxCPM2 model with base_lm/residual_lm; got {type(model).__name__}")
    return lms


def _check_not_compiled(model) -> None:
    for name in ("base_lm", "residual_lm"):
        lm = getattr(model, name, None)
        if lm is not None and "forward_step" in lm.__dict__:
            raise PatchError(
                f"model.{name}.forward_step was replaced on the instance (voxcpm's optimize() wraps it in "
                "torch.compile); a class-level patch would be silently ignored by the compiled function. "
                "Load the model with optimize=False (fastattn.load_voxcpm2 does), patch, then compile with "
                "fastattn.optimize(model)."
            )


def _static_to_rightsized(lm, cache, bucket):
    k = cache.kv_cache  # (2, layers, B, Hkv, max_length, D)
    return RightSizedKVCache(k.shape[1], k.shape[3], k.shape[5], k.shape[2], k.device, k.dtype,
                             max_length=cache.max_length,
                             bucket=_cache_bucket(lm.config, k.device, k.dtype, cache.max_length, bucket))


class VoxcpmPatch:
    """Handle of an applied patch; a context manager. ``revert()`` is idempotent."""

    def __init__(self, mode: str, cache: bool, bucket: int, verification: dict):
        self.mode, self.cache, self.bucket = mode, cache, bucket
        self.verification = verification
        self._originals: dict = {}
        self._converted: "weakref.WeakSet" = weakref.WeakSet()
        self.applied = False

    @property
    def settings(self) -> dict:
        return {"mode": self.mode, "cache": self.cache, "bucket": self.bucket}

    def _apply(self) -> None:
        fns = variant_functions(self.mode, cache=self.cache, bucket=self.bucket)
        self._originals = {name: _installed(name) for name in fns}
        for name, fn in fns.items():
            _install(name, fn)
        self.applied = True

    def convert(self, model) -> None:
        """Check ``model`` and, with ``cache=True``, give its LMs right-sized caches."""
        lms = _lms(model)
        _check_not_compiled(model)
        if not self.cache:
            return
        _, c = _modules()
        for lm in lms:
            if isinstance(lm.kv_cache, c.StaticKVCache):
                lm.kv_cache = _static_to_rightsized(lm, lm.kv_cache, self.bucket)
                self._converted.add(lm)

    def revert(self) -> None:
        """Restore the original functions (by identity) and upstream caches on converted models."""
        global _ACTIVE
        with _LOCK:
            if not self.applied:
                return
            m, c = _modules()
            for name, fn in self._originals.items():
                _install(name, fn)
            for lm in list(self._converted):
                old = lm.kv_cache
                if isinstance(old, RightSizedKVCache):
                    lm.kv_cache = c.StaticKVCache(old.num_layers, old.num_kv_heads, old.dim_kv_head, old.batch_size,
                                                  old.device, old.dtype, max_length=old.max_length)
            self._converted = weakref.WeakSet()
            self.applied = False
            if _ACTIVE is self:
                _ACTIVE = None

    def status(self) -> dict:
        return {"applied": self.applied, **self.settings, **self.verification,
                "voxcpm": _voxcpm_version(), "patched": sorted(self._originals) if self.applied else [],
                "converted_models": len(self._converted),
                "exact_default": self.mode == "exact",
                "granularity": ("calibrated" if self.bucket is None else f"int bucket {self.bucket} (self-checked)"),
                "calibrations": [{k: c[k] for k in ("device", "dtype", "hq", "hkv", "head_dim", "capacity", "kernel",
                                                    "bucket")}
                                 for c in exactness_report() if c["check"] == "calibration" and c["lq"] == 1],
                "note": REGISTRY[self.mode].note}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.revert()

    def __repr__(self):
        state = "applied" if self.applied else "reverted"
        return f"<fastattn voxcpm patch {state}: mode={self.mode!r} cache={self.cache} bucket={self.bucket}>"


def patch_voxcpm(model=None, *, mode: str = "exact", cache: bool = True, force: bool = False,
                 bucket: Optional[int] = None):
    """Patch voxcpm's MiniCPM decode step (and, with ``cache=True``, its KV cache) in place.

    Args:
        model: optional already-built VoxCPM/VoxCPM2 model: checked (not
            compiled) and, with ``cache=True``, its LMs' 8192-slot caches are
            replaced by right-sized ones. Models built after patching get them anyway.
        mode: ``"exact"`` (default: bit-identical to upstream where the device
            allows), ``"fast"`` (opt-in: within rounding) or ``"reference"``.
        cache: also right-size the KV caches.
        force: patch even if the installed voxcpm's sources are not a verified version.
        bucket: window and cache granularity. ``None`` (default): calibrated per model
            geometry, device and dtype, so ``exact`` stays bit-identical to upstream. An int
            (a positive multiple of 16): that granularity, self-checked and warned about
            where it is not bit-identical.

    Returns the :class:`VoxcpmPatch` handle (a context manager). Applying again
    with the same settings returns the same handle; different settings while
    applied raise :class:`PatchError`.
    """
    global _ACTIVE
    mode_spec(mode)
    if not isinstance(cache, bool):
        raise TypeError(f"cache must be a bool, got {type(cache).__name__}")
    _check_bucket(bucket, allow_none=True)
    with _LOCK:
        if _ACTIVE is not None:
            want = {"mode": mode, "cache": cache, "bucket": bucket}
            if _ACTIVE.settings != want:
                raise PatchError(f"voxcpm is already patched with {_ACTIVE.settings}; revert() it before "
                                 f"patching with {want}")
        else:
            if model is not None:
                _lms(model)
                _check_not_compiled(model)
            handle = VoxcpmPatch(mode, cache, bucket, _verify(force))
            handle._apply()
            _ACTIVE = handle
        if model is not None:
            _ACTIVE.convert(model)
        return _ACTIVE


def patch_status() -> dict:
    """What is patched now and how (``{"applied": False, ...}`` when nothing is)."""
    with _LOCK:
        if _ACTIVE is None:
            return {"applied": False, "voxcpm": _voxcpm_version(), "fingerprints_match": _fingerprints_known()}
        return _ACTIVE.status()


def _fingerprints_known() -> Optional[str]:
    found = fingerprints()
    return next((ver for ver, known in VERIFIED.items() if known == found), None)


def cache_bytes(model) -> dict:
    """KV storage bytes held by a model's LMs now: ``{"base_lm": n, "residual_lm": n, "total": n}``."""
    out = {}
    for name in ("base_lm", "residual_lm"):
        lm = getattr(model, name, None)
        if lm is not None and lm.kv_cache is not None:
            c = lm.kv_cache
            out[name] = c.nbytes if hasattr(c, "nbytes") else c.kv_cache.numel() * c.kv_cache.element_size()
    out["total"] = sum(out.values())
    return out


def compare_with_upstream(model, *, text: str, steps: int, mode: str = "exact", cache: bool = True,
                          streaming: bool = False, seed: int = 0, inference_timesteps: int = 2) -> dict:
    """Decode ``text`` for ``steps`` steps unpatched, then patched; compare the outputs chunk by chunk.

    Returns ``identical`` (whole output ``torch.equal``), per-chunk identity
    (streaming: one chunk per decode step), the first differing chunk, the max
    |difference| and both runs' KV bytes. The model is left unpatched.
    """
    if _ACTIVE is not None:
        raise PatchError("compare_with_upstream needs voxcpm unpatched to start; revert() the active patch first")

    def run():
        torch.manual_seed(seed)
        kw = dict(min_len=steps, max_len=steps, inference_timesteps=inference_timesteps)
        chunks = list(model.generate_streaming(text, **kw)) if streaming else [model.generate(text, **kw)]
        return chunks, cache_bytes(model)["total"], model.base_lm.kv_cache.current_length

    up, up_kv, length = run()
    with patch_voxcpm(model, mode=mode, cache=cache):
        ours, our_kv, _ = run()
    per = [bool(a.shape == b.shape and (a == b).all()) for a, b in zip(up, ours)]
    diffs = [float((a.double() - b.double()).abs().max()) if a.shape == b.shape else float("inf")
             for a, b in zip(up, ours)]
    return {"mode": mode, "cache": cache, "streaming": streaming, "steps": steps, "final_length": length,
            "identical": len(up) == len(ours) and all(per), "chunks": len(up), "chunks_identical": sum(per),
            "first_diff_chunk": next((i for i, ok in enumerate(per) if not ok), None),
            "max_abs_diff": max(diffs) if diffs else 0.0, "upstream_kv_bytes": up_kv, "patched_kv_bytes": our_kv}
