"""Apply fastattn's decode attention, right-sized cache and once-a-stream VAE weights to ``voxcpm``, reversibly.

:data:`TARGETS` are replaced at class level; ``revert()`` restores the originals by identity (docs/design.md)."""

from __future__ import annotations

import hashlib
import inspect
import logging
import weakref
from contextlib import contextmanager
from typing import Optional

from . import compat, inflight
from .cache import RightSizedKVCache
from .core import check_bucket
from .devices import package_version
from .exactness import exactness_report
from .forward import BUILT, cache_granularity, make_attention_forward_step, make_model_forward_step, make_setup_cache
from .graphs import OPTIMIZED, deoptimize
from .inflight import in_flight
from .modes import REGISTRY, mode_spec
from .vae import stream_enter, stream_exit

log = logging.getLogger("fastattn")

#: sha256 (first 16 hex digits) of ``inspect.getsource`` of each function the patch replaces, per verified voxcpm.
VERIFIED = {
    "2.0.3": {
        "MiniCPMAttention.forward_step": "2b730666fa326000",
        "MiniCPMModel.forward_step": "c57e54736e9605d4",
        "MiniCPMModel.setup_cache": "25589fe7bc969f55",
        "StreamingVAEDecoder.__enter__": "4bd68b18c9d698c5",
        "StreamingVAEDecoder.__exit__": "463500420e188d3b",
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


def _class(name: str):
    """The voxcpm class that holds ``"Class.attr"``."""
    from voxcpm.modules.audiovae import audio_vae_v2

    cls = name.split(".")[0]
    return getattr(audio_vae_v2 if cls == "StreamingVAEDecoder" else _modules()[0], cls)


def _installed(name: str):
    return _class(name).__dict__[name.split(".")[1]]


def _swap(fns: dict) -> dict:
    """Install class functions by name; returns the ones they replaced."""
    saved = {name: _installed(name) for name in fns}
    for name, fn in fns.items():
        setattr(_class(name), name.split(".")[1], fn)
    return saved


def fingerprints() -> dict:
    """Fingerprints of the functions the patch replaces (upstream's while applied) and of ``StaticKVCache``."""
    targets = {**original_functions(), "StaticKVCache": _modules()[1].StaticKVCache}
    return {name: hashlib.sha256(inspect.getsource(obj).encode()).hexdigest()[:16] for name, obj in targets.items()}


def _verified_as(found: dict) -> Optional[str]:
    return next((ver for ver, known in VERIFIED.items() if known == found), None)


def _verify(force: bool) -> dict:
    found = fingerprints()
    if (ver := _verified_as(found)) is not None:
        return {"verified_as": ver, "forced": False}
    changed = sorted(name for name in found if all(k.get(name) != found[name] for k in VERIFIED.values()))
    msg = (f"installed voxcpm {package_version('voxcpm')} differs from the versions fastattn verified "
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
    "StreamingVAEDecoder.__enter__": (lambda mode, bucket: stream_enter, False),
    "StreamingVAEDecoder.__exit__": (lambda mode, bucket: stream_exit, False),
}


def variant_functions(mode: str = "exact", *, cache: bool = True, bucket: Optional[int] = None) -> dict:
    """The class functions a patch with these settings installs, by name (for side-by-side benchmarks)."""
    _modules()
    return {name: make(mode, bucket) for name, (make, needs_cache) in TARGETS.items() if cache or not needs_cache}


def installed_functions() -> dict:
    return {name: _installed(name) for name in TARGETS}


def original_functions() -> dict:
    """Upstream's class functions (the saved originals while a patch is applied)."""
    fns = installed_functions()
    if _STATE is not None:
        fns.update(_STATE.originals)
    return fns


@contextmanager
def swapped(fns: dict):
    """Install class functions by name for a block, then restore (benchmarks: no fingerprint check)."""
    saved = _swap(fns)
    try:
        yield
    finally:
        _swap(saved)


_LOCK = inflight.LOCK


# --------------------------------------------------------------------------- the applied patch and its holders
def _lms(model) -> list:
    """``model``'s LMs: TypeError if it has none, PatchError if voxcpm's optimize() compiled their step."""
    lms = {name: getattr(model, name, None) for name in ("base_lm", "residual_lm")}
    lms = {name: lm for name, lm in lms.items() if lm is not None}
    if not lms:
        raise TypeError("model must be a voxcpm VoxCPM/VoxCPM2 model with base_lm/residual_lm; "
                        f"got {type(model).__name__}")
    for name, lm in lms.items():
        # fastattn.optimize's wrappers are fine: they compile whatever the class holds when first called
        if model not in OPTIMIZED and "forward_step" in lm.__dict__:
            raise PatchError(
                f"model.{name}.forward_step was replaced on the instance (voxcpm's optimize() wraps it in "
                "torch.compile); a class-level patch would be silently ignored by the compiled function. "
                "Load the model with optimize=False (fastattn.load_voxcpm2 does), patch, then compile with "
                "fastattn.optimize(model)."
            )
    return list(lms.values())


class _Applied:
    """The one patch applied to voxcpm's classes, shared by every handle holding it."""

    @property
    def settings(self) -> dict:
        return {"mode": self.mode, "cache": self.cache, "bucket": self.bucket}

    def __init__(self, mode: str, cache: bool, bucket, verification: dict):
        self.mode, self.cache, self.bucket, self.verification = mode, cache, bucket, verification
        self.holders: set = set()
        self.converted: weakref.WeakSet = weakref.WeakSet()
        self.pending_revert = False
        self.originals = _swap(variant_functions(mode, cache=cache, bucket=bucket))

    def convert(self, model) -> None:
        lms = _lms(model)
        if not self.cache:
            return
        _, c = _modules()
        for lm in lms:
            if isinstance(lm.kv_cache, c.StaticKVCache):
                k, n = lm.kv_cache.kv_cache, lm.kv_cache.max_length  # (2, layers, B, Hkv, max_length, D)
                g = cache_granularity(lm.config, k.device, k.dtype, n, self.bucket)
                lm.kv_cache = RightSizedKVCache(k.shape[1], k.shape[3], k.shape[5], k.shape[2], k.device, k.dtype,
                                                max_length=n, bucket=g)
                self.converted.add(lm)

    def release(self, holder) -> None:
        """``holder`` lets go; the last one reverts, after any decode in flight has ended."""
        with _LOCK:
            self.holders.discard(id(holder))
            if self.holders or self.pending_revert:
                return
            if in_flight():
                self.pending_revert = True
                inflight.when_idle(self.undo)
                log.warning("fastattn: revert() deferred: %d decode(s) in flight keep the patched functions "
                            "and caches until they end", in_flight())
                return
        self.undo()

    def undo(self) -> None:
        global _STATE
        with _LOCK:
            if _STATE is not self:
                return
            _swap(self.originals)
            _, c = _modules()
            for lm in list(self.converted) + list(BUILT):
                old = lm.kv_cache
                if isinstance(old, RightSizedKVCache):
                    lm.kv_cache = c.StaticKVCache(old.num_layers, old.num_kv_heads, old.dim_kv_head, old.batch_size,
                                                  old.device, old.dtype, max_length=old.max_length)
            BUILT.clear()
            for model in list(OPTIMIZED):
                deoptimize(model)
                log.warning("fastattn: revert() dropped fastattn.optimize's compiled steps of a %s (they ran the "
                            "patched functions); it runs eagerly now", type(model).__name__)
            _STATE = None

    def models(self) -> list:
        lms = {id(lm): lm for lm in [*self.converted, *BUILT]}  # each LM once, in first-seen order
        return [{"lm": f"{type(lm).__name__}@{id(lm):x}", "cache": type(lm.kv_cache).__name__,
                 "converted": lm in self.converted} for lm in lms.values()]


_STATE: Optional[_Applied] = None


class VoxcpmPatch:
    """A holder of the applied patch (a context manager); the last to let go reverts it, after decodes in flight."""

    def __init__(self, state: _Applied):
        self._state = state
        state.holders.add(id(self))
        self._held = True

    mode = property(lambda self: self._state.mode)
    cache = property(lambda self: self._state.cache)
    bucket = property(lambda self: self._state.bucket)
    verification = property(lambda self: self._state.verification)

    @property
    def applied(self) -> bool:
        return self._held and _STATE is self._state

    @property
    def settings(self) -> dict:
        return dict(self._state.settings)

    def convert(self, model) -> None:
        """Check ``model`` and, with ``cache=True``, give its LMs right-sized caches."""
        self._state.convert(model)

    def revert(self) -> None:
        with _LOCK:
            if not self._held:
                return
            self._held = False
        self._state.release(self)

    def status(self) -> dict:
        return _status(self._state)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.revert()

    def __repr__(self):
        state = "applied" if self.applied else "released"
        return f"<fastattn voxcpm patch {state}: mode={self.mode!r} cache={self.cache} bucket={self.bucket}>"


def _status(state: _Applied) -> dict:
    return {"applied": _STATE is state, **state.settings, **state.verification,
            "voxcpm": package_version("voxcpm"), "patched": sorted(state.originals) if _STATE is state else [],
            "holders": len(state.holders), "decodes_in_flight": in_flight(),
            "revert_pending": state.pending_revert, "models": state.models(),
            "converted_models": len(state.converted), "exact_default": state.mode == "exact",
            "granularity": "calibrated" if state.bucket is None else f"int bucket {state.bucket} (self-checked)",
            "calibrations": [{k: c[k] for k in ("device", "dtype", "hq", "hkv", "head_dim", "capacity", "kernel",
                                                "bucket")}
                             for c in exactness_report() if c["check"] == "calibration" and c["lq"] == 1],
            "note": REGISTRY[state.mode].note}


def patch_voxcpm(model=None, *, mode: str = "exact", cache: bool = True, force: bool = False,
                 bucket: Optional[int] = None):
    """Patch voxcpm's MiniCPM decode step (and, with ``cache=True``, its KV caches); a :class:`VoxcpmPatch`. ``mode``:
    ``"exact"`` (default) is bit-identical to ``"reference"`` (upstream's computation); ``"fast"`` is opt-in and changes
    bits (within twice reference's error vs float64). ``model``: a built model to check and convert. ``force``: accept
    an unverified voxcpm source. ``bucket``: as in :func:`fastattn.attention_step`. A compiled model, other settings
    while applied, or a decode in flight raise :class:`PatchError`; the same settings add a holder."""
    global _STATE
    mode_spec(mode)
    if not isinstance(cache, bool):
        raise TypeError(f"cache must be a bool, got {type(cache).__name__}")
    check_bucket(bucket, allow_none=True)
    if model is not None:
        _lms(model)  # checks it
    with _LOCK:
        inflight.track_requests()
        want = {"mode": mode, "cache": cache, "bucket": bucket}
        if _STATE is not None and (_STATE.settings != want or _STATE.pending_revert):
            why = ("its revert is pending until the decodes in flight end" if _STATE.pending_revert
                   else f"with {_STATE.settings}")
            raise PatchError(f"voxcpm is already patched {why}; revert() it before patching with {want}")
        if model is not None and in_flight(model):
            raise PatchError("a decode is in flight on this model; patch before it starts or after it ends "
                             "(patching now would change a running request)")
        if _STATE is None:
            if in_flight():
                raise PatchError(f"{in_flight()} decode(s) are in flight; patch when they have ended (a class-level "
                                 "patch would change running requests)")
            _STATE = _Applied(mode, cache, bucket, _verify(force))
        handle = VoxcpmPatch(_STATE)
        if model is not None:
            _STATE.convert(model)
        return handle


def patch_status() -> dict:
    """What is patched and how, which models hold what, decodes in flight (``applied`` False if none)."""
    with _LOCK:
        if _STATE is None:
            return {"applied": False, "voxcpm": package_version("voxcpm"),
                    "fingerprints_match": _verified_as(fingerprints()), "decodes_in_flight": in_flight()}
        return _status(_STATE)


def cache_nbytes(cache) -> int:
    """KV storage bytes one cache holds now: a patched cache's ``nbytes``, upstream's whole preallocated tensor."""
    return cache.nbytes if hasattr(cache, "nbytes") else cache.kv_cache.numel() * cache.kv_cache.element_size()


def cache_bytes(model) -> dict:
    """KV storage bytes held by a model's LMs now: ``{"base_lm": n, "residual_lm": n, "total": n}``."""
    out = {}
    for name in ("base_lm", "residual_lm"):
        lm = getattr(model, name, None)
        if lm is not None and lm.kv_cache is not None:
            out[name] = cache_nbytes(lm.kv_cache)
    out["total"] = sum(out.values())
    return out


