"""Which decodes are running now: a behaviour-neutral counter around voxcpm's ``_inference`` generators, so
:mod:`fastattn.patch` can refuse to patch, or defer a revert, while a request runs."""

from __future__ import annotations

import functools
import importlib
import threading
import weakref

from . import compat

LOCK = threading.RLock()
_INFLIGHT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> decodes running now
_ON_IDLE: list = []

#: (module, class, generator method) of voxcpm's decode generators
TRACKED = (("voxcpm.model.voxcpm2", "VoxCPM2Model", "_inference"), ("voxcpm.model.voxcpm", "VoxCPMModel", "_inference"))


def _tracked(fn):
    @functools.wraps(fn)
    def _inference(self, *args, **kwargs):
        with LOCK:
            _INFLIGHT[self] = _INFLIGHT.get(self, 0) + 1
        try:
            yield from fn(self, *args, **kwargs)
        finally:
            _request_ended(self)

    _inference.__fastattn_tracked__ = True
    return _inference


def track_requests() -> None:
    """Install the counter (idempotent)."""
    compat.ensure_torchaudio()
    for mod, cls_name, attr in TRACKED:
        cls = getattr(importlib.import_module(mod), cls_name)
        if not getattr(cls.__dict__[attr], "__fastattn_tracked__", False):
            setattr(cls, attr, _tracked(cls.__dict__[attr]))


def in_flight(model=None) -> int:
    """Decodes running now (on ``model``, or on any model)."""
    with LOCK:
        return _INFLIGHT.get(model, 0) if model is not None else sum(_INFLIGHT.values())


def when_idle(fn) -> None:
    """Call ``fn`` once, when the last decode in flight ends."""
    with LOCK:
        _ON_IDLE.append(fn)


def _request_ended(model) -> None:
    with LOCK:
        n = _INFLIGHT.get(model, 1) - 1
        if n > 0:
            _INFLIGHT[model] = n
        else:
            _INFLIGHT.pop(model, None)
        due = [] if any(_INFLIGHT.values()) else list(_ON_IDLE)
        if due:
            _ON_IDLE.clear()
    for fn in due:
        fn()
