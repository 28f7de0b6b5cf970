"""The AudioVAE's streaming decode, upstream against the patch's once-a-stream weights (:mod:`fastattn.vae`)."""

from __future__ import annotations

import torch

from fastattn.devices import resolve_device
from fastattn.models import voxcpm2_config
from fastattn.patch import original_functions, swapped, variant_functions

from .records import env_record, record
from .timing import stats_ms, time_interleaved

#: the patch's functions for the VAE stream; the rest of the patch is not in this bench
STREAM = ("StreamingVAEDecoder.__enter__", "StreamingVAEDecoder.__exit__")


def build_vae(preset: str, device, seed: int = 0):
    """voxcpm's AudioVAEV2 at ``preset``'s width, random weights, float32 (as the model runs it), eval."""
    from voxcpm.modules.audiovae import AudioVAEConfigV2, AudioVAEV2

    torch.manual_seed(seed)
    cfg = AudioVAEConfigV2.model_validate(voxcpm2_config(preset)["audio_vae_config"])
    return AudioVAEV2(config=cfg).float().to(device).eval()


def vae_stream(preset: str = "full", *, chunks: int = 8, repeats: int = 7, warmup: int = 2, device="cpu") -> dict:
    """One streamed request's VAE decode (``chunks`` one-step latent patches), upstream and patched interleaved:
    ms per stream and whether the audio is bit-identical (the ratio: :func:`.metrics.vae_ratio`)."""
    device = resolve_device(device)
    vae, patch = build_vae(preset, device), voxcpm2_config(preset)["patch_size"]
    zs = torch.randn(chunks, 1, vae.latent_dim, patch, generator=torch.Generator().manual_seed(1)).to(device)
    fns = {"upstream": {n: original_functions()[n] for n in STREAM},
           "patched": {n: variant_functions()[n] for n in STREAM}}

    @torch.inference_mode()
    def stream(variant):  # (1, 1, samples): the request's audio
        with swapped(fns[variant]), vae.streaming_decode() as dec:
            return torch.cat([dec.decode_chunk(z) for z in zs], dim=-1)

    identical = torch.equal(stream("upstream"), stream("patched"))
    host: dict = {}
    times = time_interleaved({v: (lambda v=v: stream(v)) for v in fns}, repeats=repeats, warmup=warmup,
                             device=device, host=host)
    rows = [{"variant": v, **stats_ms(times[v], host[v])} for v in fns]
    convs = sum(1 for m in vae.decoder.modules() if hasattr(m, "weight_g"))
    return record("vae_stream", env=env_record(device, torch.float32), rows=rows, identical=identical,
                  params={"preset": preset, "chunks": chunks, "frames_per_chunk": patch, "repeats": repeats,
                          "warmup": warmup, "weight_norm_convs": convs, "dtype": "float32"})
