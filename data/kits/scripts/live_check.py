"""The decode-attention kit's decodes and step errors (fastattn.lab.upstream.live_decode_check runs this in a fresh
process that imports a patched copy of voxcpm).

argv: root preset dtype text steps seed device lengths(json) out. Saves the waveforms of whole decodes "masked",
"live" (twice) and "live" under a fullgraph compile (eager backend: voxcpm's optimize() compiles only on CUDA),
the compiled decode's graph counts, and one attention step's max error against float64 per mode and length.
"""
import fastattn  # noqa: F401  (first: its torchaudio stand-in lets voxcpm import without torchaudio)
import copy
import json
import sys

import torch
import voxcpm
from torch._dynamo.utils import counters
from voxcpm.modules.minicpm4.model import apply_rotary_pos_emb

from fastattn.core import f64_attention
from fastattn.models import build_voxcpm2, silence_progress

root, preset, dtype, text, steps, seed, device, lengths, out = sys.argv[1:10]
steps, seed = int(steps), int(seed)
assert voxcpm.__file__.startswith(root), voxcpm.__file__
silence_progress()
m = build_voxcpm2(preset, seed=seed, dtype=dtype, device=device)
lms = (m.base_lm, m.residual_lm)


def decode(mode):
    for lm in lms:
        lm.set_decode_attention(mode)
    torch.manual_seed(seed)
    return m.generate(text, min_len=steps, max_len=steps, inference_timesteps=2).cpu()


res = {"masked": decode("masked"), "live": decode("live"), "live_again": decode("live"), "rows": []}
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
    """Layer 0 of the base LM, one decode step with n keys afterwards, in the model's dtype, against float64."""
    a = copy.deepcopy(attn)
    a.decode_attention = mode
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
