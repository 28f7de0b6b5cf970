"""Measuring instruments. Every function returns a record (:func:`record`: ``{"kind", "env", "params", "rows",
...}``) that :func:`save_record` writes under a name never reused and :func:`load_run` reads back. Two timers:
:func:`time_interleaved` (calls, interleaved, quiet-flagged) and ``stream.time_chunks`` (a stream's chunks).
Headline figures come from :mod:`.metrics`. Timing lives here, never in a test's assertion (tests marked
``timing`` are benchmarks, outside ``make test``)."""

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
