"""The patch's once-a-stream VAE weights: bit-identical audio, each weight computed once, recomputed when it must be."""

import pytest
import torch
from torch.nn.utils.weight_norm import WeightNorm

from fastattn.lab.bench.vae import build_vae
from fastattn.patch import patch_voxcpm
from fastattn.vae import WeightOnce

from ..helpers import no_patch_leaks  # noqa: F401  (autouse: no test leaves voxcpm patched)

pytestmark = pytest.mark.filterwarnings("ignore:`torch.nn.utils.weight_norm` is deprecated")


@pytest.fixture(scope="module")
def vae():
    return build_vae("tiny", "cpu")


def chunks(n=4, seed=1):  # one-step latent patches, (1, latent 64, 4 frames) each
    return torch.randn(n, 1, 64, 4, generator=torch.Generator().manual_seed(seed))


def stream(vae, zs, between=None):
    with vae.streaming_decode() as dec:
        out = []
        for i, z in enumerate(zs):
            out.append(dec.decode_chunk(z))
            if between:
                between(i)
        return torch.cat(out, dim=-1)


def hooks(vae, kind):
    return [h for m in vae.decoder.modules() for h in m._forward_pre_hooks.values() if isinstance(h, kind)]


@pytest.fixture
def computed(monkeypatch):
    """How many times a ``WeightNorm`` computed a weight."""
    count = [0]
    orig = WeightNorm.compute_weight

    def counting(self, module):
        count[0] += 1
        return orig(self, module)
    monkeypatch.setattr(WeightNorm, "compute_weight", counting)
    return count


@torch.inference_mode()
def test_stream_is_bit_identical_and_computes_each_weight_once(vae, computed):
    convs, zs = len(hooks(vae, WeightNorm)), chunks()
    ref = stream(vae, zs)
    assert computed[0] == convs * len(zs)  # upstream: every conv, every chunk
    computed[0] = 0
    with patch_voxcpm(cache=False):
        out = stream(vae, zs)
        assert computed[0] == convs  # once a stream
        assert not hooks(vae, WeightOnce)  # the stream ended: upstream's hooks are back
    assert torch.equal(out, ref)


def test_a_weight_written_mid_stream_is_recomputed():
    """A write in place (a new version) or a new tensor is seen at the next chunk, as upstream sees it."""
    @torch.no_grad()
    def run():
        vae = build_vae("tiny", "cpu")  # the same weights each time
        convs = [m for m in vae.decoder.modules() if hasattr(m, "weight_g")]

        def edit(i):
            if i == 1:
                convs[0].weight_g.mul_(1.5)
            if i == 2:
                convs[-1].weight_v = torch.nn.Parameter(convs[-1].weight_v * 0.5)
        return stream(vae, chunks(), between=edit)
    ref = run()
    with patch_voxcpm(cache=False):
        assert torch.equal(run(), ref)


def test_with_autograd_recording_every_chunk_recomputes(vae, computed):
    """Training keeps upstream's graph: a reused weight would tie two chunks' backward passes to one graph."""
    zs = chunks(2)
    with patch_voxcpm(cache=False), vae.streaming_decode() as dec:
        for z in zs:
            dec.decode_chunk(z).sum().backward()
    assert computed[0] == 2 * len(hooks(vae, WeightNorm))


def test_an_error_in_the_stream_restores_the_hooks(vae):
    with patch_voxcpm(cache=False), pytest.raises(RuntimeError, match="boom"):
        with vae.streaming_decode():
            assert hooks(vae, WeightOnce)
            raise RuntimeError("boom")
    assert not hooks(vae, WeightOnce) and hooks(vae, WeightNorm)
