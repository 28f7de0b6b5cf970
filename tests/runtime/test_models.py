"""fastattn.models: a real checkpoint round trip; a checkpoint that does not cover the model is refused."""

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fastattn.models import build_voxcpm2, load_voxcpm2, save_voxcpm2


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    model = build_voxcpm2("tiny", dtype="bfloat16")
    return model, save_voxcpm2(model, tmp_path_factory.mktemp("ckpt") / "tiny")


def _decode(model):
    torch.manual_seed(0)
    return model.generate("hello world", min_len=12, max_len=12, inference_timesteps=2)


def test_checkpoint_round_trip_decodes_identically(saved):
    model, path = saved
    loaded = load_voxcpm2(path)
    assert loaded.fastattn_info["weights"] == "checkpoint"
    assert torch.equal(_decode(loaded), _decode(model))


def test_save_never_overwrites(saved, tmp_path):
    model, path = saved
    with pytest.raises(FileExistsError, match="never overwritten"):
        save_voxcpm2(model, path)


def _copy_with_weights(src: Path, dst: Path, edit):
    shutil.copytree(src, dst)
    sd = load_file(str(src / "model.safetensors"))
    save_file(edit(sd), str(dst / "model.safetensors"))
    return dst


@pytest.mark.parametrize("edit,match", [
    (lambda sd: {"unrelated": torch.zeros(1)}, "missing .* key"),                       # (nearly) no tensors
    (lambda sd: dict(list(sd.items())[: len(sd) // 2]), "missing .* key"),              # half of them
    (lambda sd: {("x." + k if i == 0 else k): v for i, (k, v) in enumerate(sd.items())}, "unexpected 1"),  # renamed
])
def test_incomplete_weights_are_refused(saved, tmp_path, edit, match):
    bad = _copy_with_weights(saved[1], tmp_path / "bad", edit)
    with pytest.raises(ValueError, match=match):
        load_voxcpm2(bad)


def test_tokenizer_config_alone_is_refused(saved, tmp_path):

    bad = tmp_path / "notok"
    shutil.copytree(saved[1], bad)
    (bad / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="tokenizer.json or tokenizer.model"):
        load_voxcpm2(bad)
