"""Measuring instruments: attention sweep, decode-step sweep, whole decode, memory, bandwidth floor, targets.

Every function returns a *record* built by :func:`record`: ``{"kind", "env",
"params", "rows", ...}`` that plots and target checks read and :func:`save_record`
writes as JSON (+ CSV of the rows) under a name that is never reused. Timing is
honest on a shared, noisy box: variants are interleaved call by call (rotating
their order afresh each repeat, seeded), after warm-up, several repeats, and reported as median
with p10/p90 spread; on CUDA every sample is bracketed by CUDA events and one
synchronisation. No test asserts a time; :func:`check_targets` compares records
with the workbook's targets and says pass or fail with the measured figure.

Layout: ``timing`` (interleaving, statistics), ``floor`` (bandwidth, live bytes),
``attention`` (one call per mode, fast's choice), ``steps`` (one decode step,
eager and compiled), ``decode`` (a whole generate, split by component, and per dtype),
``memory`` (KV bytes, allocations, fill and growth, peak RSS), ``stream`` (time per streamed chunk, per component),
``consumers`` (what a caller that reprocesses the whole clip pays as it grows), ``prompts`` (calls whose prompt
grows), ``forms`` (the static-shape decode forms of a compiled decode, side by side),
``records``,
``targets``, ``cli``.
"""

from importlib import import_module

#: public name -> the submodule that owns it (imported on first use: ``fastattn.fast`` uses the timer without
#: importing every instrument, and the instruments import the core)
_OWNERS = {
    "attention": ("attention_sweep", "dtype_costs", "fast_choices"),
    "cli": ("main", "reference_run"),
    "consumers": ("consumer_contention", "consumer_matrix", "consumer_table", "stream_audio"),
    "decode": ("dtype_decode", "whole_decode"),
    "metrics": ("HEADLINES", "Figure", "dtype_recommendation", "dtype_table", "headlines", "time_shares"),
    "forms": ("form_sweep",),
    "floor": ("bandwidth", "bandwidth_line", "floor_ms", "live_kv_bytes", "llc_bytes"),
    "memory": ("cache_growth", "fill_cost", "kv_memory", "peak_rss", "step_allocations"),
    "prompts": ("prompt_growth", "prompt_table"),
    "records": ("env_record", "load_record", "load_run", "record", "save_record"),
    "stats": ("ratio_ci", "scaled_ci"),
    "steps": ("compile_counts", "compiled_step_sweep", "decode_step_sweep"),
    "stream": ("COMPONENTS", "component_table", "stream_profile", "stream_table"),
    "targets": ("GOALS", "check_targets", "target_goals"),
    "timing": ("time_interleaved",),
}
_LAZY = {name: mod for mod, names in _OWNERS.items() for name in names} | {"DTYPES": "..devices",
                                                                         "resolve_device": "..devices",
                                                                         "cpu_flags": "..devices"}

__all__ = sorted(_LAZY)


def __getattr__(name):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'fastattn.bench' has no attribute {name!r}")
    value = getattr(import_module(mod if mod.startswith("..") else f".{mod}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
