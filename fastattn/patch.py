"""Apply fastattn's decode attention and right-sized cache to the installed ``voxcpm``, reversibly.

What :func:`patch_voxcpm` replaces, at class level (so every MiniCPM model,
VoxCPM 1 and 2, built before or after, gets it):

* ``MiniCPMAttention.forward_step``, ``MiniCPMModel.forward_step`` and, with
  ``cache=True``, ``MiniCPMModel.setup_cache`` (the replacements live in
  :mod:`fastattn.steps`; :data:`TARGETS` is the one table of what is replaced).

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

from . import compat
from .attention import _check_bucket
from .cache import RightSizedKVCache
from .devices import package_version
from .exactness import exactness_report
from .modes import REGISTRY, mode_spec
from .steps import cache_granularity, make_attention_forward_step, make_model_forward_step, make_setup_cache

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


#: The one table of what the patch replaces: ``"Class.attr"`` -> (replacement factory(mode, bucket), only with
#: ``cache=True``). Originals, swapping, revert, status, fingerprints, notebook 04 and the tests read it.
TARGETS = {
    "MiniCPMAttention.forward_step": (make_attention_forward_step, False),
    "MiniCPMModel.forward_step": (make_model_forward_step, False),
    "MiniCPMModel.setup_cache": (lambda mode, bucket: make_setup_cache(bucket), True),
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
_ACTIVE: Optional[VoxcpmPatch] = None


def _lms(model):
    lms = [getattr(model, name, None) for name in ("base_lm", "residual_lm")]
    lms = [lm for lm in lms if lm is not None]
    if not lms:
        raise TypeError("model must be a voxcpm VoxCPM/VoxCPM2 model with base_lm/residual_lm; "
                        f"got {type(model).__name__}")
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
                             bucket=cache_granularity(lm.config, k.device, k.dtype, cache.max_length, bucket))


class VoxcpmPatch:
    """Handle of an applied patch; a context manager. ``revert()`` is idempotent."""

    def __init__(self, mode: str, cache: bool, bucket: int, verification: dict):
        self.mode, self.cache, self.bucket = mode, cache, bucket
        self.verification = verification
        self._originals: dict = {}
        self._converted: weakref.WeakSet = weakref.WeakSet()
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


