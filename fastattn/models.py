"""Real ``voxcpm`` VoxCPM2 models: random weights from a preset, or a local checkpoint; never the network.

Presets: ``tiny`` (tests), ``small`` (real LM width, heads), ``full`` (~2.4B); longrope factors are 1.0 (not public)."""

from __future__ import annotations

import copy
import json
import os
import string
from contextlib import redirect_stderr
from io import StringIO
from pathlib import Path
from typing import Optional

import torch

from . import compat
from .devices import DTYPES, resolve_device

PRESETS = ("tiny", "small", "full")
#: voxcpm's ``max_length``: the slots every LM's cache holds, and "every position" of a claim
MAX_LENGTH = 8192


def architecture() -> dict:
    """The architecture file beside this module, as a dict (``full``, ``presets``, ``_provenance``)."""
    return json.loads((Path(__file__).with_name("voxcpm2_architecture.json")).read_text())


def _merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def voxcpm2_config(preset: str = "tiny", *, max_length: int = MAX_LENGTH, dtype: str = "bfloat16",
                   device: str = "cpu") -> dict:
    """The ``VoxCPMConfig`` dict for a preset (validated by voxcpm's pydantic model when built)."""
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {', '.join(PRESETS)}; got {preset!r}")
    arch = architecture()
    cfg = arch["full"] if preset == "full" else _merge(arch["full"], arch["presets"][preset])
    half = cfg["lm_config"]["kv_channels"] // 2
    rs = cfg["lm_config"]["rope_scaling"]
    for key in ("long_factor", "short_factor"):
        if rs[key] == "ones":
            rs[key] = [1.0] * half
    cfg.update(max_length=max_length, dtype=dtype, device=device)
    return cfg


def _tokenizer(vocab_size: int):
    """An offline LlamaTokenizerFast over single characters (ids 101-104 are VoxCPM's audio specials)."""
    from transformers import LlamaTokenizerFast

    chars = list(string.ascii_letters + string.digits + string.punctuation) + ["▁"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    reserved = {101, 102, 103, 104}
    nxt = 3
    for c in chars:
        while nxt in reserved:
            nxt += 1
        if nxt >= vocab_size:
            break
        vocab[c] = nxt
        nxt += 1
    return LlamaTokenizerFast(vocab=vocab, merges=[], unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                              add_bos_token=True, add_eos_token=False)


def build_voxcpm2(preset: str = "tiny", *, seed: int = 0, device: str = "cpu", dtype: str = "bfloat16",
                  max_length: int = MAX_LENGTH):
    """A real ``VoxCPM2Model`` with random weights from ``preset``, offline; the same preset, seed and dtype give the
    same weights (AudioVAE float32). ValueError for a bad dtype or ``max_length``."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {dtype!r}")
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 16:
        raise ValueError(f"max_length must be an int >= 16, got {max_length!r}")
    device = str(resolve_device(device))
    cfg = voxcpm2_config(preset, max_length=max_length, dtype=dtype, device=device)
    compat.ensure_torchaudio()
    from voxcpm.model.voxcpm2 import VoxCPM2Model, VoxCPMConfig
    from voxcpm.modules.audiovae import AudioVAEConfigV2, AudioVAEV2

    config = VoxCPMConfig.model_validate(cfg)
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        with redirect_stderr(StringIO()):
            vae = AudioVAEV2(config=AudioVAEConfigV2.model_validate(cfg["audio_vae_config"]))
            model = VoxCPM2Model(config, _tokenizer(cfg["lm_config"]["vocab_size"]), vae, device=device)
    finally:
        torch.random.set_rng_state(state)
    model = model.to(DTYPES[model.config.dtype])
    model.audio_vae = model.audio_vae.to(torch.float32)
    model = model.to(model.device).eval()
    model.fastattn_info = {"preset": preset, "seed": seed, "dtype": model.config.dtype, "device": device,
                           "max_length": max_length, "weights": "random", "parameters": count_parameters(model)}
    return model


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())


_WEIGHTS = ("model.safetensors", "pytorch_model.bin")
_VAE = ("audiovae.safetensors", "audiovae.pth")
#: what a checkpoint folder must hold: one file of each group
_REQUIRED = (("config.json",), _WEIGHTS, _VAE, ("tokenizer.json", "tokenizer.model"))
TEST_STRING = "hello world"


def save_voxcpm2(model, path) -> Path:
    """Write ``model`` as a voxcpm checkpoint into a new or empty folder (returned); FileExistsError otherwise."""
    from safetensors.torch import save_file

    p = Path(path).expanduser()
    if p.exists() and (not p.is_dir() or any(p.iterdir())):
        raise FileExistsError(f"path {str(p)!r} exists and is not an empty folder: a checkpoint is never overwritten")
    tok = getattr(getattr(model, "text_tokenizer", None), "tokenizer", None)
    if tok is None or not hasattr(model, "audio_vae"):
        raise TypeError(f"model must be a voxcpm VoxCPM2Model, got {type(model).__name__}")
    p.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}  # no shared storage
    vae = {k[len("audio_vae."):]: v for k, v in state.items() if k.startswith("audio_vae.")}
    lm = {k: v for k, v in state.items() if not k.startswith("audio_vae.")}
    save_file(lm, str(p / "model.safetensors"))
    save_file(vae, str(p / "audiovae.safetensors"))
    config = {"architecture": "voxcpm2", **json.loads(model.config.model_dump_json())}  # VoxCPM() reads it
    (p / "config.json").write_text(json.dumps(config, indent=1))
    tok.save_pretrained(str(p))
    return p


def _checkpoint_keys(path: Path, names) -> set:
    """The state-dict keys of the first of ``names`` in ``path`` (none: empty)."""
    for name in names:
        f = path / name
        if f.is_file() and f.suffix == ".safetensors":
            from safetensors import safe_open
            with safe_open(str(f), framework="pt") as h:
                return set(h.keys())
        if f.is_file():
            sd = torch.load(str(f), map_location="cpu", weights_only=True)
            return set(sd.get("state_dict", sd))
    return set()


def _check_coverage(model, path: Path) -> None:
    """ValueError unless the checkpoint covers the model exactly (voxcpm's ``strict=False`` keeps random weights)."""
    have = _checkpoint_keys(path, _WEIGHTS) | {f"audio_vae.{k}" for k in _checkpoint_keys(path, _VAE)}
    want = {k for k in model.state_dict() if "lora_" not in k}
    missing, unexpected = sorted(want - have), sorted(have - want)
    if missing or unexpected:
        show = lambda ks: ", ".join(ks[:8]) + (f", ... ({len(ks)} in all)" if len(ks) > 8 else "")  # noqa: E731
        raise ValueError(f"checkpoint {str(path)!r} does not match the model its config.json describes: "
                         f"missing {len(missing)} key(s) [{show(missing)}]; unexpected {len(unexpected)} "
                         f"[{show(unexpected)}]. voxcpm would load it with strict=False and keep random weights.")


def load_voxcpm2(path, *, device: Optional[str] = None):
    """Load a local checkpoint offline with ``from_local(..., optimize=False)`` (patchable). Missing files:
    FileNotFoundError; weights not covering the model exactly, or a tokenizer that encodes nothing: ValueError."""
    if path is None or str(path).strip() == "":
        raise ValueError("checkpoint path is empty: give the local directory of a VoxCPM2 checkpoint")
    p = Path(path).expanduser()
    if not p.is_dir():
        raise FileNotFoundError(f"checkpoint path {str(p)!r} is not an existing directory "
                                "(fastattn never downloads: pass a local VoxCPM2 checkpoint directory)")
    missing = [" or ".join(names) for names in _REQUIRED if not any((p / f).is_file() for f in names)]
    if missing:
        raise FileNotFoundError(f"checkpoint directory {str(p)!r} lacks: {', '.join(missing)}")
    if device is not None:
        device = str(resolve_device(device))
    compat.ensure_torchaudio()
    from voxcpm.model.voxcpm2 import VoxCPM2Model

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with redirect_stderr(StringIO()):
        model = VoxCPM2Model.from_local(str(p), optimize=False, device=device)
    _check_coverage(model, p)
    if len(model.text_tokenizer(TEST_STRING)) == 0:
        raise ValueError(f"checkpoint {str(p)!r}: its tokenizer encodes {TEST_STRING!r} as no tokens "
                         "(a tokenizer_config.json alone is not a tokenizer: expected tokenizer.json or "
                         "tokenizer.model)")
    model.fastattn_info = {"checkpoint": str(p), "weights": "checkpoint", "dtype": model.config.dtype,
                           "device": model.device, "max_length": model.config.max_length,
                           "parameters": count_parameters(model)}
    return model


def silence_progress(silent: bool = True) -> None:
    """Turn voxcpm's per-generate tqdm bar off (or back on) by rebinding ``tqdm`` in its model modules."""
    import functools

    from tqdm import tqdm

    compat.ensure_torchaudio()
    import voxcpm.model.voxcpm as v1
    import voxcpm.model.voxcpm2 as v2
    for mod in (v1, v2):
        mod.tqdm = functools.partial(tqdm, disable=True) if silent else tqdm
