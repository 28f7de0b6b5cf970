#!/usr/bin/env python3
"""Time VoxCPM2's decode on this machine, for one or more voxcpm source trees side by side.

Each ``--variant NAME=DIR`` runs in its own process with DIR first on ``sys.path`` (``NAME=installed``: the
installed package). All variants load the same checkpoint (``--model``, or random weights from the real
architecture with ``--random``) and decode the same text with the same seed. Rounds alternate between the
variants, so a machine that slows down over the run slows every variant alike.

Per variant it reports:
  * ``base_lm.forward_step`` ms at each ``--positions`` (cache filled to that length; CUDA events on a GPU),
    median and a 95% interval over every timed call;
  * a ``generate_streaming`` run of ``--chunks`` chunks: per-chunk ms, the first and last sixth, the slope
    over the stream (ms per 100 chunks) with a 95% interval, real-time factor and peak memory;
  * torch.compile graphs and CUDA graphs recorded during the stream (with ``--optimize on``);
  * the waveform's sha256, and whether it equals its baseline's.

A run's baseline is the first variant in the same ``--optimize`` mode: the step ratios and the waveform compare
eager with eager and compiled with compiled.

It imports only the standard library, torch, numpy and voxcpm. To compare a branch with main, from a checkout of
main with the branch checked out beside it::

    git worktree add ../voxcpm-pr BRANCH
    python scripts/voxcpm_decode_bench.py --model /path/to/VoxCPM2 --device cuda \\
        --variant main=src --variant pr=../voxcpm-pr/src --out bench.json

``--random tiny --quick`` runs in about a minute on a CPU, with no checkpoint and no network.
"""

import argparse
import hashlib
import inspect
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SENTENCE = "The quick brown fox jumps over the lazy dog near the quiet river bank. "
# VoxCPM2's architecture (its config.json); tiny and small keep the layout with fewer, narrower layers.
FULL = {
    "lm_config": {
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "max_position_embeddings": 32768,
        "num_attention_heads": 16,
        "num_hidden_layers": 28,
        "num_key_value_heads": 2,
        "kv_channels": 128,
        "rms_norm_eps": 1e-05,
        "vocab_size": 73448,
        "use_mup": False,
        "scale_emb": 12,
        "dim_model_base": 256,
        "scale_depth": 1.4,
        "rope_theta": 10000.0,
        "rope_scaling": {
            "type": "longrope",
            "long_factor": None,
            "short_factor": None,
            "original_max_position_embeddings": 32768,
        },
    },
    "patch_size": 4,
    "feat_dim": 64,
    "residual_lm_num_layers": 8,
    "residual_lm_no_rope": True,
    "scalar_quantization_latent_dim": 512,
    "scalar_quantization_scale": 9,
    "encoder_config": {"hidden_dim": 1024, "ffn_dim": 4096, "num_heads": 16, "num_layers": 12, "kv_channels": 128},
    "dit_config": {
        "hidden_dim": 1024,
        "ffn_dim": 4096,
        "num_heads": 16,
        "num_layers": 12,
        "kv_channels": 128,
        "dit_mean_mode": False,
        "cfm_config": {},
    },
    "audio_vae_config": {
        "encoder_dim": 128,
        "encoder_rates": [2, 5, 8, 8],
        "latent_dim": 64,
        "decoder_dim": 2048,
        "decoder_rates": [8, 6, 5, 2, 2, 2],
        "sample_rate": 16000,
        "out_sample_rate": 48000,
    },
    "max_length": 8192,
}
PRESETS = {
    "full": {},
    "small": {
        "lm_config": {
            "num_hidden_layers": 4,
            "vocab_size": 512,
            "max_position_embeddings": 8192,
            "rope_scaling": {"original_max_position_embeddings": 8192},
        },
        "residual_lm_num_layers": 2,
        "encoder_config": {"hidden_dim": 256, "ffn_dim": 512, "num_heads": 2, "num_layers": 1},
        "dit_config": {"hidden_dim": 256, "ffn_dim": 512, "num_heads": 2, "num_layers": 1},
        "audio_vae_config": {"encoder_dim": 16, "decoder_dim": 128},
    },
    "tiny": {
        "lm_config": {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "kv_channels": 16,
            "num_hidden_layers": 2,
            "vocab_size": 256,
            "max_position_embeddings": 8192,
            "rope_scaling": {"original_max_position_embeddings": 8192},
        },
        "residual_lm_num_layers": 2,
        "scalar_quantization_latent_dim": 16,
        "encoder_config": {"hidden_dim": 32, "ffn_dim": 64, "num_heads": 2, "num_layers": 1, "kv_channels": 16},
        "dit_config": {"hidden_dim": 32, "ffn_dim": 64, "num_heads": 2, "num_layers": 1, "kv_channels": 16},
        "audio_vae_config": {"encoder_dim": 8, "encoder_rates": [2, 2], "decoder_dim": 16, "decoder_rates": [2, 2]},
    },
}
AUDIO_TOKENS = (101, 102, 103, 104)  # VoxCPM2's audio start/end and reference start/end ids


# ----------------------------------------------------------------------------------------------- statistics
def median_ci(xs, level=0.95):
    """The median and a distribution-free interval for it: the order statistics that leave out ``j`` samples on
    each side, ``j`` the largest with 2 P(B <= j - 1) <= 1 - level, B ~ binomial(n, 1/2); None below 6 samples."""
    from math import comb

    xs, n = sorted(xs), len(xs)
    j, tail = 0, 0.0
    while j < n // 2:
        t = tail + comb(n, j) / 2**n  # P(B <= j)
        if 2 * t > 1 - level:
            break
        tail, j = t, j + 1
    return statistics.median(xs), ([xs[j - 1], xs[n - j]] if j else None)


def slope_ci(ys, block=10, resamples=400, seed=0):
    """Least-squares slope of ``ys`` over their index, and a 95% moving-block bootstrap interval."""

    def slope(v):
        n = len(v)
        mx, my = (n - 1) / 2, sum(v) / n
        den = sum((i - mx) ** 2 for i in range(n))
        return sum((i - mx) * (y - my) for i, y in enumerate(v)) / den if den else 0.0

    n = len(ys)
    if n < 2 * block:
        return slope(ys), None
    rng, resid = random.Random(seed), [y - sum(ys) / n for y in ys]
    base, draws = slope(ys), []
    fit = [base * (i - (n - 1) / 2) for i in range(n)]
    detrended = [r - f for r, f in zip(resid, fit)]
    for _ in range(resamples):
        starts = [rng.randrange(n - block + 1) for _ in range(-(-n // block))]
        noise = [detrended[s + j] for s in starts for j in range(block)][:n]
        draws.append(slope([f + e for f, e in zip(fit, noise)]))
    draws.sort()
    return base, [draws[int(0.025 * resamples)], draws[int(0.975 * resamples) - 1]]


def sixths(ys):
    k = max(1, len(ys) // 6)
    return statistics.median(ys[:k]), statistics.median(ys[-k:])


# --------------------------------------------------------------------------------------------------- worker
def _torchaudio_or_stand_in():
    """voxcpm imports torchaudio at module level although VoxCPM2's decode never calls it; where it cannot be
    imported, register a module that raises on use. Returns why, or None."""
    try:
        import torchaudio  # noqa: F401

        return None
    except Exception as exc:  # noqa: BLE001 - absent, or built for another torch
        import importlib.machinery
        import types

        why = f"{type(exc).__name__}: {exc}"
        mod = types.ModuleType("torchaudio")
        mod.__spec__ = importlib.machinery.ModuleSpec("torchaudio", None)

        def missing(name):
            if name.startswith("__"):
                raise AttributeError(name)
            raise RuntimeError(f"torchaudio is unavailable here ({why}); this bench loads no audio file")

        mod.__getattr__ = missing
        sys.modules["torchaudio"] = mod
        return why


def _merge(base, over):
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def make_random_checkpoint(folder, preset, dtype, seed):
    """Write random weights for ``preset`` in voxcpm's checkpoint layout (config, tokenizer, weights)."""
    import torch
    from voxcpm.model.voxcpm2 import LlamaTokenizerFast, VoxCPM2Model, VoxCPMConfig
    from voxcpm.modules.audiovae import AudioVAEConfigV2, AudioVAEV2

    cfg = _merge(FULL, PRESETS[preset])
    half = cfg["lm_config"]["kv_channels"] // 2
    cfg["lm_config"]["rope_scaling"] = dict(
        cfg["lm_config"]["rope_scaling"], long_factor=[1.0] * half, short_factor=[1.0] * half
    )
    cfg.update(dtype=dtype, device="cpu")
    config = VoxCPMConfig.model_validate(cfg)
    chars = [chr(c) for c in range(33, 127)] + ["\u2581"]
    ids = [i for i in range(3, cfg["lm_config"]["vocab_size"]) if i not in AUDIO_TOKENS]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **dict(zip(chars, ids))}
    tok = LlamaTokenizerFast(vocab=vocab, merges=[], unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    torch.manual_seed(seed)
    vae = AudioVAEV2(config=AudioVAEConfigV2.model_validate(cfg["audio_vae_config"]))
    model = VoxCPM2Model(config, tok, vae)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    folder = Path(folder)
    torch.save(
        {k[len("audio_vae.") :]: v for k, v in state.items() if k.startswith("audio_vae.")}, folder / "audiovae.pth"
    )
    torch.save({k: v for k, v in state.items() if not k.startswith("audio_vae.")}, folder / "pytorch_model.bin")
    (folder / "config.json").write_text(config.model_dump_json(indent=1))
    tok.save_pretrained(str(folder))
    return {"preset": preset, "seed": seed, "parameters": sum(p.numel() for p in model.parameters())}


class Worker:
    """One variant's model, driven by the parent over stdin/stdout (one JSON object per line)."""

    def __init__(self, ckpt, device, optimize):
        import torch
        import voxcpm
        from voxcpm.model.voxcpm2 import VoxCPM2Model

        self.torch, self.device = torch, device
        t0 = time.perf_counter()
        try:
            self.model = VoxCPM2Model.from_local(ckpt, optimize=optimize, device=device)
        except TypeError:  # a voxcpm whose from_local takes no device
            self.model = VoxCPM2Model.from_local(ckpt, optimize=optimize)
        self.info = {
            "voxcpm_file": voxcpm.__file__,
            "voxcpm_version": _version(voxcpm),
            "load_s": time.perf_counter() - t0,
            "optimize": optimize,
            "cache": type(self.model.base_lm.kv_cache).__name__,
            "dtype": str(next(self.model.base_lm.parameters()).dtype).replace("torch.", ""),
        }
        if device.startswith("cuda"):
            self.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))

    def _timed(self, fn):
        if self.device.startswith("cuda"):
            start, end = self.events
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        t0 = time.perf_counter_ns()
        fn()
        return (time.perf_counter_ns() - t0) / 1e6

    def steps(self, positions, calls, warmup, seed):
        """ms of ``calls`` decode steps (``step()`` + ``forward_step``) at each position, after ``warmup``."""
        torch, lm = self.torch, self.model.base_lm
        cfg, cache = lm.config, lm.kv_cache
        d = cfg.kv_channels or cfg.hidden_size // cfg.num_attention_heads
        dt = next(lm.parameters()).dtype
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(1, cfg.hidden_size, generator=g).to(self.device, dt)
        out = {}
        with torch.inference_mode():
            for p in positions:
                kv = torch.randn(1, cfg.num_key_value_heads, p, d, generator=g).to(self.device, dt)
                cache.fill_caches([(kv, kv)] * cfg.num_hidden_layers)

                def call(p=p):
                    cache.current_length = p
                    lm.forward_step(x, torch.tensor([cache.step()], device=self.device))

                for _ in range(warmup):
                    call()
                out[str(p)] = [self._timed(call) for _ in range(calls)]
        return {"ms": out}

    def stream(self, chunks, timesteps, seed):
        """One ``generate_streaming`` run: per-chunk ms, audio, peak memory, compile and CUDA-graph counts."""
        torch, cuda = self.torch, self.device.startswith("cuda")
        graphs0, cg0 = _graph_counts(torch, self.device)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        torch.manual_seed(seed)
        seeding = self._seed_arg(seed)
        gen = self.model.generate_streaming(
            SENTENCE * max(1, chunks // 50 + 1),
            min_len=chunks,
            max_len=chunks,
            inference_timesteps=timesteps,
            **seeding,
        )
        wav, ms, t_start = [], [], time.perf_counter()
        t = t_start
        for chunk in gen:
            if cuda:
                torch.cuda.synchronize()
            now = time.perf_counter()
            ms.append((now - t) * 1e3)
            t = now
            wav.append(chunk.detach().float().reshape(-1).cpu())
        wall = time.perf_counter() - t_start
        audio = torch.cat(wav) if wav else torch.zeros(0)
        graphs1, cg1 = _graph_counts(torch, self.device)
        peak = torch.cuda.max_memory_allocated() if cuda else _max_rss_bytes()
        return {
            "chunk_ms": ms,
            "wall_s": wall,
            "audio_s": audio.numel() / self.model.sample_rate,
            "sha256": hashlib.sha256(audio.numpy().tobytes()).hexdigest(),
            "samples": audio.numel(),
            "peak_bytes": peak,
            "peak_kind": "CUDA allocated" if cuda else "process max RSS",
            "graphs_compiled": None if graphs0 is None else graphs1 - graphs0,
            "cuda_graphs_recorded": None if cg0 is None or cg1 is None else cg1 - cg0,
            "seeding": "generate_streaming(seed=...)" if seeding else "torch.manual_seed",
        }

    def _seed_arg(self, seed):
        """``{"seed": seed}`` where this tree's generate takes a seed: voxcpm after 2.0.3 reseeds the generator from
        ``torch.seed()`` when none is given, so a ``torch.manual_seed`` before the call would not repeat the decode."""
        generate = getattr(self.model, "_generate", self.model.generate_streaming)
        return {"seed": seed} if "seed" in inspect.signature(generate).parameters else {}


def _max_rss_bytes():
    """This process's peak resident memory in bytes; None where the platform does not report it (Windows)."""
    try:
        import resource
    except ImportError:
        return None
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # bytes on macOS, KiB on Linux


def _version(voxcpm):
    """The voxcpm version: its ``__version__``, a checkout's pyproject.toml, or the metadata of an installed package
    (only where the package imported is the installed one); else None."""
    if getattr(voxcpm, "__version__", None):
        return voxcpm.__version__
    pkg = Path(voxcpm.__file__).resolve().parent
    pyproject = pkg.parents[1] / "pyproject.toml"
    if pyproject.is_file():
        for line in pyproject.read_text().splitlines():
            if line.replace(" ", "").startswith('version="'):
                return line.split('"')[1]
    dist = sorted(pkg.parent.glob("voxcpm-*.dist-info"))
    return dist[0].name[len("voxcpm-") : -len(".dist-info")] if dist else None


def _graph_counts(torch, device):
    """(dynamo graphs compiled so far, CUDA graphs recorded so far); None where this torch does not say."""
    try:
        from torch._dynamo.utils import counters

        graphs = counters["stats"].get("unique_graphs", 0)
    except Exception:  # noqa: BLE001 - a private counter that moved
        graphs = None
    recorded = None
    if device.startswith("cuda"):
        try:
            import re

            from torch._inductor.cudagraph_trees import get_manager

            manager = get_manager(torch.cuda.current_device(), create_if_none_exists=False)
            recorded = 0 if manager is None else int(re.fullmatch(r"count\((\d+)\)", repr(manager.graph_counter))[1])
        except Exception:  # noqa: BLE001
            recorded = None
    return graphs, recorded


def worker_main():
    """The child: answer the parent's requests until it says quit."""
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # anything voxcpm or torch prints goes to stderr, never into the protocol
    stand_in = _torchaudio_or_stand_in()
    worker = None
    for line in sys.stdin:
        req = json.loads(line)
        try:
            if req["op"] == "make":
                reply = make_random_checkpoint(req["folder"], req["preset"], req["dtype"], req["seed"])
            elif req["op"] == "load":
                worker = Worker(req["ckpt"], req["device"], req["optimize"])
                reply = dict(worker.info, torchaudio_stand_in=stand_in)
            elif req["op"] == "steps":
                reply = worker.steps(req["positions"], req["calls"], req["warmup"], req["seed"])
            elif req["op"] == "stream":
                reply = worker.stream(req["chunks"], req["timesteps"], req["seed"])
            else:
                break
        except Exception as exc:  # noqa: BLE001 - the parent reports it with the variant's name
            import traceback

            reply = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
        proto.write(json.dumps(reply) + "\n")
        proto.flush()


# --------------------------------------------------------------------------------------------------- parent
class Child:
    """A worker process with ``tree`` first on its path."""

    def __init__(self, name, tree):
        env = dict(os.environ, TQDM_DISABLE="1")  # voxcpm's progress bars would flood the log
        if tree is not None:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tree), env.get("PYTHONPATH")) if p)
        self.name, self.tree = name, tree
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--worker"],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def ask(self, **req):
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"variant {self.name}: its process ended (exit {self.proc.wait()}); see stderr above")
        reply = json.loads(line)
        if "error" in reply:
            sys.stderr.write(reply.get("traceback", ""))
            raise SystemExit(f"variant {self.name}: {req['op']} failed: {reply['error']}")
        return reply

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


def source_tree(spec):
    """``NAME=DIR`` -> (name, the folder holding ``voxcpm/``, or None for the installed package)."""
    name, sep, where = spec.partition("=")
    if not sep or not name:
        raise SystemExit(f"--variant {spec!r}: expected NAME=DIR or NAME=installed")
    if where == "installed":
        return name, None
    d = Path(where).expanduser().resolve()
    for cand in (d, d / "src"):
        if (cand / "voxcpm" / "__init__.py").is_file():
            return name, cand
    raise SystemExit(f"--variant {spec!r}: {d} holds neither voxcpm/ nor src/voxcpm/")


def git_commit(tree):
    if tree is None:
        return None
    try:
        head = subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(
            ["git", "-C", str(tree), "status", "--porcelain", "--", "."], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if head.returncode:
        return None
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


#: the CPU flags that pick the CPU kernels (native bf16 or not, AMX tiles): they decide the bf16 step's cost
KERNEL_FLAGS = ("avx512f", "avx512_bf16", "amx_bf16", "avx2", "bf16")


def cpu_flags():
    """``{flag: bool}`` of :data:`KERNEL_FLAGS` from /proc/cpuinfo (Arm: ``Features``); ``{}`` where unreadable."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next(
                (line.split(":", 1)[1].split() for line in f if line.split(":")[0].strip() in ("flags", "Features")), []
            )
    except OSError:
        return {}
    return {n: n in flags for n in KERNEL_FLAGS}


def machine_line(env, weights):
    """What ran, for the top of a pasted table: the GPU and driver, or the CPU and its kernel flags."""
    if env.get("gpu"):
        where = f"{env['gpu']} (CUDA {env.get('cuda')}, driver {env.get('driver', '?')})"
    else:
        flags = [n for n, on in env.get("cpu_flags", {}).items() if on]
        where = f"{env.get('cpu') or '?'} ({', '.join(flags) or 'flags unknown'}; ATen {env.get('cpu_capability')})"
    what = "random weights" if weights.get("weights") == "random" else "checkpoint"
    return f"{where}, {env['threads']} threads, torch {env['torch']}, Python {env['python']}; {what}" + (
        f" ({weights['preset']})" if weights.get("preset") else ""
    )


def environment(device):
    import platform

    import torch

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": device,
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
    }
    try:
        env["cpu"] = next(
            line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")
        )
    except (OSError, StopIteration):
        env["cpu"] = platform.processor()
    env["cpu_flags"] = cpu_flags()
    capability = getattr(getattr(torch.backends, "cpu", None), "get_cpu_capability", None)
    env["cpu_capability"] = capability() if capability else None
    if device.startswith("cuda") and torch.cuda.is_available():
        env.update(
            gpu=torch.cuda.get_device_name(),
            cuda=torch.version.cuda,
            capability=".".join(map(str, torch.cuda.get_device_capability())),
        )
        try:
            smi = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
            )
            env["driver"] = smi.stdout.strip().splitlines()[0] if smi.returncode == 0 else None
        except (OSError, subprocess.TimeoutExpired, IndexError):
            env["driver"] = None
    return env


def prepared_checkpoint(args, folder, first_tree):
    """A folder every variant loads: the checkpoint's files linked, its config with ``--dtype``; or random weights."""
    folder.mkdir()
    if args.random:
        maker = Child("random-weights", first_tree)
        try:
            made = maker.ask(
                op="make", folder=str(folder), preset=args.random, dtype=args.dtype or "bfloat16", seed=args.seed
            )
        finally:
            maker.close()
        return dict(made, weights="random")
    src = Path(args.model).expanduser().resolve()
    if not (src / "config.json").is_file():
        raise SystemExit(f"--model {src}: no config.json there (a local VoxCPM2 checkpoint folder is expected)")
    for f in src.iterdir():
        if f.name != "config.json":
            (folder / f.name).symlink_to(f)
    cfg = json.loads((src / "config.json").read_text())
    if args.dtype:
        cfg["dtype"] = args.dtype
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    return {"weights": "checkpoint", "model": src.name}


def ratio_ci(num, den, resamples=1000, seed=0):
    """median(num) / median(den) and a 95% bootstrap interval (each side resampled on its own)."""
    rng = random.Random(seed)
    draws = sorted(
        statistics.median(rng.choices(num, k=len(num))) / statistics.median(rng.choices(den, k=len(den)))
        for _ in range(resamples)
    )
    return statistics.median(num) / statistics.median(den), [
        draws[int(0.025 * resamples)],
        draws[int(0.975 * resamples) - 1],
    ]


def summarize(name, info, steps, stream, first):
    """One variant's figures; ``first``: its baseline's name, step samples and stream."""
    row = {"variant": name, **info, "baseline": first["name"], "steps": {}}
    for p, xs in steps.items():
        med, ci = median_ci(xs)
        ratio, rci = ratio_ci(xs, first["steps"][p])
        row["steps"][p] = {
            "median_ms": med,
            "ci_ms": ci,
            "n": len(xs),
            "samples_ms": xs,
            "ratio_to_first": ratio,
            "ratio_ci": rci,
        }
    ms = stream["chunk_ms"][2:]  # the prefill's chunk and the first decode's are not the steady state
    slope, ci = slope_ci(ms) if len(ms) >= 6 else (None, None)
    head, tail = sixths(ms) if ms else (None, None)
    row["stream"] = {k: v for k, v in stream.items() if k != "chunk_ms"}
    row["stream"].update(
        chunk_ms=stream["chunk_ms"],
        chunks=len(stream["chunk_ms"]),
        first_sixth_ms=head,
        last_sixth_ms=tail,
        slope_ms_per_100=None if slope is None else slope * 100,
        slope_ci_ms_per_100=None if ci is None else [c * 100 for c in ci],
        rtf=stream["wall_s"] / stream["audio_s"] if stream["audio_s"] else None,
        equal_to_first=stream["sha256"] == first["stream"]["sha256"],
    )
    return row


def table(rows, positions):
    head = [
        "variant",
        *[f"step @{p} ms" for p in positions],
        "chunk first/last sixth ms",
        "slope ms/100 chunks",
        "RTF",
        "peak MB",
        "graphs / CUDA graphs",
        "waveform = first",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        s = r["stream"]
        cells = [r["variant"]]
        for p in positions:
            st = r["steps"][str(p)]
            ci = st["ci_ms"]
            cells.append(
                f"{st['median_ms']:.3g}"
                + (f" [{ci[0]:.3g}, {ci[1]:.3g}]" if ci else "")
                + (f" ({st['ratio_to_first']:.2f}x)" if r["baseline"] != r["variant"] else "")
            )
        slope = (
            "n/a"
            if s["slope_ms_per_100"] is None
            else f"{s['slope_ms_per_100']:+.3g}"
            + (
                f" [{s['slope_ci_ms_per_100'][0]:+.3g}, {s['slope_ci_ms_per_100'][1]:+.3g}]"
                if s["slope_ci_ms_per_100"]
                else ""
            )
        )
        cells += [
            f"{s['first_sixth_ms']:.3g} / {s['last_sixth_ms']:.3g}" if s["first_sixth_ms"] else "n/a",
            slope,
            f"{s['rtf']:.3g}" if s["rtf"] else "n/a",
            "n/a" if s["peak_bytes"] is None else f"{s['peak_bytes'] / 1e6:.0f}",
            f"{s['graphs_compiled']} / {s['cuda_graphs_recorded']}",
            "yes" if s["equal_to_first"] else "no",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv):
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    ap.add_argument(
        "--variant",
        action="append",
        required=True,
        metavar="NAME=DIR",
        help="a voxcpm source tree (a checkout's src/, or a folder holding voxcpm/); NAME=installed: "
        "the installed package; repeatable, the first is the baseline",
    )
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a local VoxCPM2 checkpoint folder")
    src.add_argument("--random", choices=sorted(PRESETS), help="random weights of the real architecture")
    ap.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N | mps")
    ap.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), help="default: the checkpoint's")
    ap.add_argument(
        "--optimize",
        choices=("on", "off", "both"),
        help="voxcpm's optimize() (torch.compile); default both on CUDA, off elsewhere",
    )
    ap.add_argument("--chunks", type=int, help="chunks of the stream (default 480 on a GPU, a long stream; 120 else)")
    ap.add_argument(
        "--positions",
        type=lambda s: [int(x) for x in s.split(",")],
        metavar="P,P,...",
        help="decode positions of the step timing (default 0,256,1024,4096,8000)",
    )
    ap.add_argument("--rounds", type=int, default=5, help="rounds of step timing, alternating variants")
    ap.add_argument("--calls", type=int, default=10, help="timed calls per position and round")
    ap.add_argument("--timesteps", type=int, default=10, help="inference_timesteps of the stream (voxcpm's 10)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="small sizes: about a minute on a CPU with --random tiny")
    ap.add_argument("--out", help="write the JSON here (never over an existing file)")
    args = ap.parse_args(argv)
    gpu = args.device.startswith(("cuda", "mps"))
    if args.quick:
        args.positions = args.positions or [0, 256, 1024]
        args.chunks = args.chunks or 24
        args.rounds, args.calls, args.timesteps = min(args.rounds, 3), min(args.calls, 5), min(args.timesteps, 2)
    args.positions = args.positions or [0, 256, 1024, 4096, 8000]
    args.chunks = args.chunks or (480 if gpu else 120)
    args.optimize = args.optimize or ("both" if args.device.startswith("cuda") else "off")
    if args.out and Path(args.out).exists():
        ap.error(f"--out {args.out} exists: an earlier run is never overwritten")
    if min(args.positions) < 0 or args.chunks < 1 or args.rounds < 1 or args.calls < 1:
        ap.error("positions must be >= 0; chunks, rounds and calls >= 1")
    return args


def plan_runs(variants, optimize):
    """``(label, name, tree, optimize)`` per run: every tree in each optimize mode, eager first."""
    modes = {"on": [True], "off": [False], "both": [False, True]}[optimize]
    return [
        (f"{n}" + (f" optimize={'on' if o else 'off'}" if len(modes) > 1 else ""), n, tree, o)
        for o in modes
        for n, tree in variants
    ]


def baselines(runs):
    """``{label: its baseline's label}``: the first tree in the same optimize mode (compiled is not eager's)."""
    first = {}
    return {label: first.setdefault(o, label) for label, _, _, o in runs}


def main(argv=None):
    args = parse_args(argv)
    variants = [source_tree(v) for v in args.variant]
    if len({n for n, _ in variants}) != len(variants):
        raise SystemExit("--variant: each NAME once")
    runs = plan_runs(variants, args.optimize)
    with tempfile.TemporaryDirectory(prefix="voxcpm-bench-") as tmp:
        weights = prepared_checkpoint(args, Path(tmp) / "ckpt", variants[0][1])
        children = [Child(label, tree) for label, _, tree, _ in runs]
        try:
            info = {
                c.name: c.ask(op="load", ckpt=str(Path(tmp) / "ckpt"), device=args.device, optimize=o)
                for c, (_, _, _, o) in zip(children, runs)
            }
            for c, (_, _, tree, _) in zip(children, runs):
                where = Path(info[c.name]["voxcpm_file"]).resolve()
                if tree is not None and tree not in where.parents:
                    raise SystemExit(f"variant {c.name}: imported voxcpm from {where}, not from {tree}")
                info[c.name]["tree"], info[c.name]["commit"] = str(tree or "installed"), git_commit(tree)
            steps = {c.name: {str(p): [] for p in args.positions} for c in children}
            for r in range(args.rounds):
                for c in children if r % 2 == 0 else children[::-1]:
                    got = c.ask(
                        op="steps",
                        positions=args.positions,
                        calls=args.calls,
                        warmup=3 if r == 0 else 1,
                        seed=args.seed,
                    )["ms"]
                    for p, xs in got.items():
                        steps[c.name][p] += xs
            streams = {
                c.name: c.ask(op="stream", chunks=args.chunks, timesteps=args.timesteps, seed=args.seed)
                for c in children
            }
        finally:
            for c in children:
                c.close()
    base = baselines(runs)
    rows = [
        summarize(
            c.name,
            info[c.name],
            steps[c.name],
            streams[c.name],
            {"name": base[c.name], "steps": steps[base[c.name]], "stream": streams[base[c.name]]},
        )
        for c in children
    ]
    out = {
        "kind": "voxcpm_decode_bench",
        "version": 1,
        "env": environment(args.device),
        "weights": weights,
        "params": {
            k: getattr(args, k)
            for k in (
                "device",
                "dtype",
                "optimize",
                "chunks",
                "positions",
                "rounds",
                "calls",
                "timesteps",
                "seed",
                "quick",
            )
        },
        "variants": rows,
    }
    print(machine_line(out["env"], weights) + "\n")
    print(table(rows, args.positions))
    if args.optimize == "both":
        print("(each run's ratios and waveform against the first tree in the same optimize mode)")
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.out}")
    return out


if __name__ == "__main__":
    if sys.argv[1:] == ["--worker"]:
        worker_main()
    else:
        main()
