"""One MiniCPM decode step (``MiniCPMModel.forward_step``), upstream vs patched, eager and compiled."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from fastattn.cache import RightSizedKVCache
from fastattn.core import check_positions
from fastattn.devices import dtype_name, quiet_native_stderr, resolve_device
from fastattn.devices import dtype_of as _dtype
from fastattn.forward import cache_granularity, slice_fix_functions
from fastattn.graphs import graph_counts, mark_cache_static, reset_graph_counts
from fastattn.models import voxcpm2_config
from fastattn.patch import original_functions, swapped, variant_functions
from fastattn.static import fresh_positions

from .records import env_record, record
from .timing import progress_bar, stats_ms, time_interleaved


def lm_config(preset: str, layers: Optional[int]):
    from voxcpm.modules.minicpm4 import MiniCPM4Config

    cfg = voxcpm2_config(preset)["lm_config"]
    if layers is not None:
        cfg["num_hidden_layers"] = layers
    return MiniCPM4Config.model_validate(cfg)


def lm_and_caches(preset: str, layers: Optional[int], dt, device, max_length: int, bucket, seed: int):
    """A random-weight MiniCPMModel of the preset's LM geometry, upstream's and the patched cache for it, and a
    generator seeded ``seed + 1`` with the step's input ``x`` drawn from it first."""
    from voxcpm.modules.minicpm4 import MiniCPMModel
    from voxcpm.modules.minicpm4.cache import StaticKVCache

    cfg = lm_config(preset, layers)
    with torch.random.fork_rng(devices=[]), swapped(original_functions()):  # the caller's CPU generator untouched
        torch.manual_seed(seed)
        lm = MiniCPMModel(cfg).to(device=device, dtype=dt).eval()
    D = cfg.kv_channels or cfg.hidden_size // cfg.num_attention_heads
    geo = (cfg.num_hidden_layers, cfg.num_key_value_heads, D, 1, device, dt)
    caches = {"upstream": StaticKVCache(*geo, max_length=max_length),
              "patched": RightSizedKVCache(*geo, max_length=max_length,
                                           bucket=cache_granularity(cfg, device, dt, max_length, bucket))}
    g = torch.Generator().manual_seed(seed + 1)
    return lm, cfg, D, caches, g, torch.randn(1, cfg.hidden_size, generator=g).to(device=device, dtype=dt)


def start_request(caches: dict, cfg, D: int, p: int, g, device, dt) -> None:
    """Put every cache at position ``p``: random K, V of p slots per layer (drawn from ``g``) filled, p claimed."""
    kv = [tuple(torch.randn(1, cfg.num_key_value_heads, p, D, generator=g).to(device=device, dtype=dt)
                for _ in range(2)) for _ in range(cfg.num_hidden_layers)]
    for c in caches.values():
        c.fill_caches(kv)
        if c.step() != p:
            raise RuntimeError(f"cache did not start at position {p}")


def _attention_in_step(run, layers: int, steps: int = 3) -> float:
    """ms per layer of the SDPA kernel inside a real step (CPU profiler), K/V as cold as the step leaves them."""
    from torch.profiler import ProfilerActivity, profile
    with quiet_native_stderr(), profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            run()
    us = sum(e.self_cpu_time_total for e in prof.key_averages() if "scaled_dot_product" in e.key)
    return us / 1e3 / (layers * steps)


def decode_step_sweep(positions: Sequence[int], *, preset: str = "small", layers: Optional[int] = None,
                      dtype="bfloat16", device="cpu", max_length: int = 8192, bucket: Optional[int] = None,
                      repeats: int = 7, warmup: int = 2, seed: int = 0, progress: bool = True,
                      slice_fix: bool = False) -> dict:
    """One decode step, upstream vs patched (``exact``) and optionally the slice fix, interleaved. Rows per variant
    and position: a timed row, ``per_layer_ms``, ``bit_identical``, ``attention_in_step_ms`` (None on CUDA)."""
    device, dt = resolve_device(device), _dtype(dtype)
    check_positions(positions, max_length, "max_length")
    rows, cfg, D, caches, variants = _step_sweep(positions, preset, layers, dt, device, max_length, bucket, repeats,
                                                  warmup, seed, progress, f"decode step {dtype}", slice_fix=slice_fix)
    params = {"preset": preset, "layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size,
              "heads": cfg.num_attention_heads, "kv_heads": cfg.num_key_value_heads, "head_dim": D,
              "positions": list(positions), "dtype": dtype_name(dt), "max_length": max_length, "bucket": bucket,
              "granularity": caches["patched"].granularity,
              "repeats": repeats, "warmup": warmup, "variants": list(variants),
              "fresh_key_counts": ["slice_fix"] if slice_fix else []}
    return record("decode_step", env=env_record(device, dt), params=params, rows=rows)


def compiled_step_sweep(positions: Sequence[int], *, preset: str = "tiny", layers: Optional[int] = None,
                        dtype="float32", device="cpu", backend: str = "inductor", mode: Optional[str] = None,
                        max_length: int = 8192, bucket: Optional[int] = None, repeats: int = 7, warmup: int = 3,
                        seed: int = 0, progress: bool = True) -> dict:
    """Decode step, upstream and patched, eager and compiled as ``optimize()`` does (``reduce-overhead`` on CUDA).
    ``graphs``: dynamo's counts (one per variant expected, never one per position)."""
    device, dt = resolve_device(device), _dtype(dtype)
    mode = mode if mode is not None else ("reduce-overhead" if device.type == "cuda" else None)
    opts = {"backend": backend, "fullgraph": True, **({"mode": mode} if mode else {})}
    rows, cfg, *_ = _step_sweep(positions, preset, layers, dt, device, max_length, bucket, repeats, warmup, seed,
                                progress, "compiled step", compiled=opts)
    params = {"preset": preset, "layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size, "dtype": dtype_name(dt),
              "backend": backend, "mode": mode, "positions": list(positions), "bucket": bucket, "repeats": repeats}
    return record("compiled_step", env=env_record(device, dt), params=params, rows=rows, graphs=graph_counts())


def _step_sweep(positions, preset, layers, dt, device, max_length, bucket, repeats, warmup, seed, progress, desc, *,
                slice_fix: bool = False, compiled: Optional[dict] = None) -> tuple:
    """``(rows, cfg, D, caches, variants)``; ``compiled``: compile options, each variant timed eager and compiled."""
    lm, cfg, D, caches, g, x = lm_and_caches(preset, layers, dt, device, max_length, bucket, seed)
    fns = {"upstream": original_functions(), "patched": variant_functions("exact", bucket=bucket)}
    variants = {n: (f, caches[n], None) for n, f in fns.items()}  # None: the LM's forward_step, as swapped in
    if slice_fix:  # upstream's cache: the fix slices its views
        variants["slice_fix"] = (slice_fix_functions(), caches["upstream"], None)
    if compiled is not None:
        if device.type == "cuda":  # both variants alike: the tensors each compiled step reads and writes
            mark_cache_static(caches["upstream"])
            mark_cache_static(caches["patched"])
        variants = {}
        for v, f in fns.items():
            step = f["MiniCPMModel.forward_step"]
            variants[f"eager {v}"] = (f, caches[v], step.__get__(lm))
            variants[f"compiled {v}"] = (f, caches[v], torch.compile(step.__get__(lm), **compiled))
        torch._dynamo.reset()
        reset_graph_counts()
    rows = []
    for p in progress_bar(positions, progress, desc):
        start_request(caches, cfg, D, p, g, device, dt)
        pos = torch.tensor([p], device=device)

        def call(name, pos=pos, walk=None):
            swap, cache, step = variants[name]
            at = iter((i, torch.tensor([i], device=device)) for i in walk) if walk else None

            def run():
                lm.kv_cache = cache
                if at is not None:  # a fresh key count per call, as a decode pays it (the fix reads the length)
                    i, step_pos = next(at)
                    lm.kv_cache.current_length = i + 1
                with swapped(swap), torch.inference_mode():
                    return (step or lm.forward_step)(x, pos if at is None else step_pos)
            return run

        outs = {n: call(n)() for n in variants} if compiled is None else {}
        walk = fresh_positions(p, warmup + repeats, max_length, device=device, dtype=dt) if compiled is None else None
        host: dict = {}
        times = time_interleaved({n: call(n, walk=walk if n == "slice_fix" else None) for n in variants},
                                 repeats=repeats, warmup=warmup, device=device, host=host)
        caches["upstream"].current_length = p + 1
        for n in variants:
            rows.append({"variant": n, "position": p, **stats_ms(times[n], host[n])})
            if compiled is None:
                rows[-1].update(per_layer_ms=rows[-1]["median_ms"] / cfg.num_hidden_layers,
                                attention_in_step_ms=_attention_in_step(call(n), cfg.num_hidden_layers)
                                if device.type == "cpu" else None,
                                bit_identical=bool(torch.equal(outs[n], outs["upstream"])))
    lm.kv_cache = None
    return rows, cfg, D, caches, variants


def _sliced_step(length):
    """The published fix's ``forward_step``: each layer's cache sliced to ``length(self, position_id)`` keys."""
    def forward_step(self, inputs_embeds, position_id):
        position_emb = self.rope_emb(position_id)
        h, n = inputs_embeds, length(self, position_id)
        for i, layer in enumerate(self.layers):
            k, v = self.kv_cache.get_layer_cache(i)
            h = layer.forward_step(h, position_emb, position_id, (k[:, :, :n], v[:, :, :n]))
        return self.norm(h)
    return forward_step


def compile_counts(steps: int = 500, *, preset: str = "tiny", start: int = 16, device="cpu", dtype="float32",
                   seed: int = 0, backend: str = "inductor") -> dict:
    """Dynamo's counters over ``steps`` steps of a plainly compiled step: upstream's, and the slice fix with its length
    a tensor (graph break) or a Python int (specialised on); graphs growing with steps are recompiles."""
    from torch._dynamo.utils import counters

    device, dt = resolve_device(device), _dtype(dtype)
    lm, cfg, D, caches, g, x = lm_and_caches(preset, None, dt, device, start + steps + 1, None, seed)
    up = original_functions()
    variants = {"upstream": up["MiniCPMModel.forward_step"],
                "slice fix, length a tensor": _sliced_step(lambda self, pos: pos[0] + 1),
                "slice fix, length a Python int": _sliced_step(lambda self, pos: self.kv_cache.current_length)}
    rows = []
    for name, fn in variants.items():
        torch._dynamo.reset()
        reset_graph_counts()
        start_request({"upstream": caches["upstream"]}, cfg, D, start, g, device, dt)
        lm.kv_cache = caches["upstream"]
        with swapped(up), torch.inference_mode(), quiet_native_stderr():
            step = torch.compile(fn.__get__(lm), backend=backend)
            for i in range(steps):
                step(x, torch.tensor([start + i], device=device))
                lm.kv_cache.step()
        c = graph_counts()
        rows.append({"variant": name, "unique_graphs": c["unique_graphs"], "graph_breaks": c["graph_breaks"],
                     "break_reasons": sorted(counters["graph_break"])[:3], "steps": steps})
    torch._dynamo.reset()
    return record("compile_counts", env=env_record(device, dt), rows=rows,
                  params={"preset": preset, "steps": steps, "start": start, "dtype": dtype, "backend": backend,
                          "recompile_limit": getattr(torch._dynamo.config, "recompile_limit", None)})
