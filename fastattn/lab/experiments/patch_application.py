"""Notebook 04's experiments: whole decodes against upstream, and the ``torch.compile`` trap of the slice fix."""

from __future__ import annotations

from contextlib import nullcontext

import torch

from fastattn.graphs import graph_counts, reset_graph_counts
from fastattn.models import build_voxcpm2, silence_progress
from fastattn.patch import PatchError, cache_bytes, original_functions, patch_status, patch_voxcpm, swapped

from ..upstream import max_abs_diff


def compare_with_upstream(model, *, text: str, steps: int, mode: str = "exact", cache: bool = True,
                          streaming: bool = False, seed: int = 0, inference_timesteps: int = 2) -> dict:
    """Decode ``text`` unpatched, then patched (left unpatched): ``identical``, ``chunks_identical``,
    ``first_diff_chunk``, ``max_abs_diff``, both runs' KV bytes. PatchError if a patch is already applied."""
    if patch_status()["applied"]:
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
    diffs = [max_abs_diff(a, b) for a, b in zip(up, ours)]
    return {"mode": mode, "cache": cache, "streaming": streaming, "steps": steps, "final_length": length,
            "identical": len(up) == len(ours) and all(per), "chunks": len(up), "chunks_identical": sum(per),
            "first_diff_chunk": next((i for i, ok in enumerate(per) if not ok), None),
            "max_abs_diff": max(diffs) if diffs else 0.0, "upstream_kv_bytes": up_kv, "patched_kv_bytes": our_kv}


def naive_slice_forward_step(self, hidden_states, position_emb, position_id, kv_cache):
    """Seed 000's (PR #199's) fix, for show: a slice by the tensor position, right eagerly, fails fullgraph compile."""
    from voxcpm.modules.minicpm4.model import apply_rotary_pos_emb
    bsz, _ = hidden_states.size()
    q = self.q_proj(hidden_states).view(bsz, 1, self.num_heads, self.head_dim).transpose(1, 2)
    k = self.k_proj(hidden_states).view(bsz, 1, self.num_key_value_heads, self.head_dim).transpose(1, 2)
    v = self.v_proj(hidden_states).view(bsz, 1, self.num_key_value_heads, self.head_dim).transpose(1, 2)
    if position_emb is not None:
        q, k = apply_rotary_pos_emb(q, k, *position_emb)
    key_cache, value_cache = kv_cache
    key_cache[:, :, position_id, :] = k
    value_cache[:, :, position_id, :] = v
    out = torch.nn.functional.scaled_dot_product_attention(
        q, key_cache[:, :, :position_id + 1, :], value_cache[:, :, :position_id + 1, :], enable_gqa=True)
    return self.o_proj(out.transpose(1, 2).contiguous().reshape(bsz, self.num_heads * self.head_dim))


def compile_demo(variant: str, *, steps: int = 160, bucket: int = 16, text: str = "hello world " * 4,
                 seed: int = 0) -> dict:
    """A fresh tiny model's base LM step compiled like optimize() (fullgraph, eager backend), decoded: graph counts,
    ``error`` (or None), ``equal_to_eager``. ``variant``: upstream, naive_slice or patched (``bucket``-slot cache)."""
    if variant not in ("upstream", "naive_slice", "patched"):
        raise ValueError(f"variant must be 'upstream', 'naive_slice' or 'patched'; got {variant!r}")
    silence_progress()
    fns = dict(original_functions())
    if variant == "naive_slice":
        fns["MiniCPMAttention.forward_step"] = naive_slice_forward_step
    with swapped(fns if variant != "patched" else {}):
        model = build_voxcpm2("tiny", dtype="float32", seed=seed)
        try:
            with patch_voxcpm(model, bucket=bucket) if variant == "patched" else nullcontext():
                def run():
                    torch.manual_seed(seed)
                    return model.generate(text, min_len=steps, max_len=steps, inference_timesteps=1)
                eager = run()
                torch._dynamo.reset()
                reset_graph_counts()
                model.base_lm.forward_step = torch.compile(model.base_lm.forward_step, backend="eager",
                                                           fullgraph=True)
                error, equal = None, None
                try:
                    equal = bool(torch.equal(run(), eager))
                except Exception as exc:
                    error = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
                length = model.base_lm.kv_cache.current_length
        finally:
            torch._dynamo.reset()
    return {"variant": variant, **graph_counts(), "error": error, "equal_to_eager": equal, "final_length": length,
            "buckets_touched": -(-length // bucket) if variant == "patched" else None}


#: the findings 04 puts first (the runner's key findings)
KEY_FINDINGS = (
    "decode through the upstream diff: torch.equal to upstream",
    "exact patch, generate(): waveform torch.equal to upstream",
    "KV of this request, upstream / patched (MB)",
    "revert restores originals by identity",
    "decode-attention kit, mode off: torch.equal to upstream",
    "compiled decode forms: fastest accepted here",
)


def findings(results: dict, fast: dict, trap: dict, through_diff: dict, restored: bool, live: dict,
             choice: dict) -> dict:
    """04's findings, keyed by claim, from its results."""
    gen, stream = results["generate, exact, cache=True"], results["generate_streaming, exact, cache=True"]
    return {
        "decode through the upstream diff: torch.equal to upstream": through_diff["identical"],
        "exact patch, generate(): waveform torch.equal to upstream": gen["identical"],
        "exact patch without right-sized cache: torch.equal": results["generate, exact, cache=False"]["identical"],
        "exact patch, streaming: chunks identical": f"{stream['chunks_identical']}/{stream['chunks']}",
        "KV of this request, upstream / patched (MB)":
            f"{gen['upstream_kv_bytes'] / 1e6:.3g} / {gen['patched_kv_bytes'] / 1e6:.3g}",
        "fast mode: first differing streamed chunk": fast["first_diff_chunk"],
        "naive slice fix under fullgraph compile": trap["naive_slice"]["error"] or "compiled",
        "patched exact step under fullgraph compile: graphs / buckets touched":
            f"{trap['patched']['unique_graphs']} / {trap['patched']['buckets_touched']}",
        "revert restores originals by identity": restored,
        "decode-attention kit, mode off: torch.equal to upstream": live["identical_off"],
        "decode-attention kit, mode on: step error vs float64 over masked's":
            f"{live['error_ratio']:.2f}x (bound {live['error_bound']})",
        "decode-attention kit, mode on under fullgraph compile: graphs": live["rows"][-1]["unique_graphs"],
        "compiled decode forms: fastest accepted here": (
            f"{choice['winner']} at this model's geometry ({choice['hq']}/{choice['hkv']} heads, "
            f"d {choice['head_dim']}, {choice['capacity']} slots; {choice['device']}, {choice['dtype']}; medians, "
            "no interval: 05 and the decode_forms records time VoxCPM2's geometry)"),
    }
