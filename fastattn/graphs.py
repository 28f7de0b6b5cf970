"""Graph-safe decode: ``torch.compile`` (and CUDA graphs) on a patched VoxCPM model (docs/design.md).

Per-step values stay in tensors, only the bucketed window is a dynamic shape; CUDA graphs need static cache views."""

from __future__ import annotations

import functools
import logging
import re
import weakref
from typing import Optional

import torch

#: models :func:`optimize` compiled (a patch revert deoptimizes them)
OPTIMIZED: weakref.WeakSet = weakref.WeakSet()

log = logging.getLogger("fastattn")

def _guarded(compiled, eager, name: str, report: dict):
    """Call ``compiled``; on any failure but OOM, log once and run ``eager`` from then on."""

    def call(*args, **kwargs):
        if report["failed"].get(name):
            return eager(*args, **kwargs)
        try:
            return compiled(*args, **kwargs)
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:  # compile or lowering failure: keep serving, eagerly
            report["failed"][name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
            log.warning("fastattn.optimize: compiling %s failed (%s); running it eagerly from now on",
                        name, report["failed"][name])
            return eager(*args, **kwargs)

    call.__fastattn_compiled__ = True
    return call


def optimize(model, *, compile_mode: Optional[str] = None, backend: str = "inductor", fullgraph: bool = True,
             components=("base_lm", "residual_lm", "feat_encoder", "feat_decoder")):
    """Compile a patched model's decode hot paths as voxcpm's ``optimize()`` does (CUDA graphs on CUDA); a component
    that fails to compile is logged once and runs eagerly. ``model.fastattn_compiled`` says what ran."""
    device = str(getattr(model, "device", "cpu"))
    if compile_mode is None:
        compile_mode = "reduce-overhead" if device.startswith("cuda") and backend == "inductor" else None
    report = {"mode": compile_mode, "backend": backend, "fullgraph": fullgraph, "compiled": [], "failed": {}}
    for part, (obj, attr) in _parts(model).items():
        if part not in components or getattr(obj.__dict__.get(attr), "__fastattn_compiled__", False):
            continue  # not asked for, or already optimized
        obj.__dict__.pop(attr, None)  # drop any earlier instance override (e.g. voxcpm's own optimize())
        if part == "feat_encoder":  # voxcpm runs the (variable-length) prefill through the raw encoder
            model.__dict__["_feat_encoder_raw"] = functools.partial(type(obj).forward, obj)
        eager = getattr(obj, attr)
        # Compile the class function with the object as an argument: compiling the bound
        # method of a module whose instance ``forward`` is then replaced made dynamo skip it.
        compiled = torch.compile(getattr(type(obj), attr), backend=backend, fullgraph=fullgraph, mode=compile_mode)
        setattr(obj, attr, _guarded(functools.partial(compiled, obj), eager, part, report))
        report["compiled"].append(part)
    if device.startswith("cuda"):
        for lm_name in ("base_lm", "residual_lm"):
            mark_cache_static(getattr(getattr(model, lm_name, None), "kv_cache", None))
    model.fastattn_compiled = report
    OPTIMIZED.add(model)
    return model


def mark_cache_static(cache) -> None:
    """Mark a :class:`fastattn.RightSizedKVCache` (as it moves too) or a ``StaticKVCache`` static; None is ignored."""
    if hasattr(cache, "set_static_address"):
        cache.set_static_address(True)
    elif isinstance(getattr(cache, "kv_cache", None), torch.Tensor):
        torch._dynamo.mark_static_address(cache.kv_cache)


def deoptimize(model):
    """Undo :func:`optimize` (``revert()`` calls it: a compiled graph keeps running the functions it traced)."""
    for obj, attr in _parts(model).values():
        if getattr(obj.__dict__.get(attr), "__fastattn_compiled__", False):
            del obj.__dict__[attr]
    model.__dict__.pop("_feat_encoder_raw", None)
    model.__dict__.pop("fastattn_compiled", None)
    OPTIMIZED.discard(model)
    return model


def _parts(model) -> dict:
    """{component: (object, attribute)} of what upstream's ``optimize()`` compiles, replaced on the instance."""
    parts = {"base_lm": (getattr(model, "base_lm", None), "forward_step"),
             "residual_lm": (getattr(model, "residual_lm", None), "forward_step"),
             "feat_encoder": (model.__dict__.get("_modules", {}).get("feat_encoder"), "forward"),
             "feat_decoder": (getattr(getattr(model, "feat_decoder", None), "estimator", None), "forward")}
    return {name: (obj, attr) for name, (obj, attr) in parts.items() if obj is not None}


#: the logger inductor's cudagraph trees write each skip's reason to (``log_cudagraph_skip_and_bump_counter``)
CUDAGRAPH_LOG = "torch._inductor.cudagraph_utils.__cudagraphs"


class _SkipReasons(logging.Handler):
    """Collects cudagraph trees' reasons for running a compiled function without CUDA graphs."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.reasons: list = []

    def emit(self, record):
        msg = record.getMessage()
        if msg.lower().startswith(("skipping cudagraph", "disabling cudagraph")):  # not the dynamic-shape warning
            self.reasons.append(msg[:300])


_SKIPS = _SkipReasons()


def graph_counts() -> dict:
    """Compile counters since :func:`reset_graph_counts`: graphs, graph breaks, ``cudagraph_skips`` and their
    reasons; no skips under ``reduce-overhead`` is the evidence graphs were recorded. A recompile is one more
    ``unique_graphs``."""
    from torch._dynamo.utils import counters
    _watch_skips()
    return {"unique_graphs": counters["stats"].get("unique_graphs", 0),
            "calls_captured": counters["stats"].get("calls_captured", 0),
            "graph_breaks": sum(counters["graph_break"].values()),
            "cudagraph_skips": counters["inductor"].get("cudagraph_skips", 0),
            "cudagraph_skip_reasons": sorted(set(_SKIPS.reasons))}


def _watch_skips() -> None:
    logger = logging.getLogger(CUDAGRAPH_LOG)
    if _SKIPS not in logger.handlers:
        logger.addHandler(_SKIPS)


def reset_graph_counts() -> None:
    """Zero the counters :func:`graph_counts` reads and start collecting cudagraph skip reasons afresh."""
    from torch._dynamo.utils import counters
    counters.clear()
    _SKIPS.reasons.clear()
    _watch_skips()


def cudagraph_recordings(device) -> Optional[int]:
    """CUDA graphs cudagraph trees have recorded on ``device`` so far, or None where that is unknown."""
    if torch.device(device).type != "cuda":
        return None
    try:
        from torch._inductor.cudagraph_trees import get_manager
        index = torch.device(device).index
        manager = get_manager(torch.cuda.current_device() if index is None else index, create_if_none_exists=False)
        return None if manager is None else int(re.fullmatch(r"count\((\d+)\)", repr(manager.graph_counter))[1])
    except Exception:  # noqa: BLE001 - an internal that moved: say unknown, never guess
        return None
