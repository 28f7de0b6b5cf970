"""scripts/voxcpm_decode_bench.py, the bench a maintainer runs on their own machine, and ``tools.ingest``, which
reads its JSON back: the bench imports no fastattn, compares two voxcpm trees (installed 2.0.3 and the right-sized
diff) side by side on random weights and on a saved checkpoint, and its CUDA branches are read from a GPU-shaped
record."""

import ast
import copy
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from fastattn.lab.machine import cpu_features, cpu_flags
from tools import ingest as ing

pytestmark = pytest.mark.usefixtures("seeded_fast_choice")  # fast's probe, cheap (conftest)

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "scripts" / "voxcpm_decode_bench.py"


def _bench(*args, timeout=600):
    r = subprocess.run([sys.executable, str(BENCH), *map(str, args)], capture_output=True, text=True, timeout=timeout)
    return r


def test_the_bench_imports_only_the_standard_library_torch_numpy_and_voxcpm():
    tree = ast.parse(BENCH.read_text())
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    # torchaudio only probed (voxcpm's own dependency; a stand-in where it cannot load)
    assert names - set(sys.stdlib_module_names) <= {"torch", "numpy", "voxcpm", "torchaudio"}, names
    assert "fastattn" not in BENCH.read_text()


def test_the_bench_pr_carries_this_file_in_upstreams_style():
    """The bench PR's diff (one for main and 2.0.3: it only adds files) adds this very file and its upstream-style
    test; the file names nothing of this repository and is formatted as upstream's black (line length 120) leaves
    it."""
    import re

    from fastattn.lab.upstream import KITS, upstream_diff
    text = BENCH.read_text()
    assert not re.search(r"fastattn|data/|\bkits?\b|\.diff\b|workbook", text)
    diff = upstream_diff("src", "bench")
    assert diff == upstream_diff("wheel", "bench") and KITS["bench"][1]["src"] == KITS["bench"][1]["wheel"]
    files = dict(re.findall(r"\+\+\+ b/(\S+)\n@@[^\n]*\n((?:\+[^\n]*\n)*)", diff))
    assert set(files) == {"scripts/voxcpm_decode_bench.py", f"tests/{KITS['bench'][2]}"}
    assert "".join(line[1:] + "\n" for line in files["scripts/voxcpm_decode_bench.py"].splitlines()) == text
    ruff = Path(sys.executable).with_name("ruff")
    if not ruff.exists():
        pytest.skip("no ruff beside this Python")
    r = subprocess.run([str(ruff), "format", "--isolated", "--line-length", "120", "--check", str(BENCH)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.fixture(scope="module")
def two_trees(tmp_path_factory):
    """--random tiny --quick over the installed 2.0.3 and the right-sized tree made from data/kits."""
    from fastattn.lab.upstream import patched_copy
    base = tmp_path_factory.mktemp("bench")
    tree = patched_copy(base / "right-sized", "right-sized", layout="src")
    out = base / "bench.json"
    r = _bench("--random", "tiny", "--quick", "--variant", "main=installed", "--variant", f"pr={tree}",
               "--out", out)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(out.read_text()), r.stdout, tree


@pytest.mark.slow
def test_two_trees_side_by_side_one_json_equal_waveforms(two_trees):
    rec, printed, tree = two_trees
    main, pr = rec["variants"]
    assert main["tree"] == "installed" and Path(pr["tree"]) == (tree / "src").resolve()  # the checkout's src/
    assert main["cache"] == pr["cache"] == "StaticKVCache" and main["voxcpm_version"] == "2.0.3"
    for v in (main, pr):
        assert set(v["steps"]) == {"0", "256", "1024"}
        st = v["steps"]["256"]
        assert st["n"] == 15 and st["ci_ms"][0] <= st["median_ms"] <= st["ci_ms"][1]
        assert v["stream"]["chunks"] == 24 and v["stream"]["rtf"] > 0 and v["stream"]["peak_bytes"] > 0
    assert main["steps"]["256"]["ratio_to_first"] == 1.0
    assert pr["stream"]["equal_to_first"] is True, "the right-sized cache is bit-identical by design on CPU"
    assert rec["weights"]["weights"] == "random" and rec["weights"]["preset"] == "tiny"
    assert "| pr |" in printed and "waveform = first" in printed
    assert printed.splitlines()[0].endswith("; random weights (tiny)") and " threads, torch " in printed  # what ran


@pytest.mark.slow
def test_a_saved_checkpoint_is_read_by_model(tmp_path):
    from fastattn.models import build_voxcpm2, save_voxcpm2
    ckpt = save_voxcpm2(build_voxcpm2("tiny", dtype="float32"), tmp_path / "ckpt")
    out = tmp_path / "one.json"
    r = _bench("--model", ckpt, "--variant", "main=installed", "--positions", "0,64", "--chunks", 8, "--rounds", 1,
               "--calls", 3, "--timesteps", 2, "--out", out)
    assert r.returncode == 0, r.stderr[-3000:]
    rec = json.loads(out.read_text())
    assert rec["weights"] == {"weights": "checkpoint", "model": "ckpt"} and rec["variants"][0]["dtype"] == "float32"
    again = _bench("--model", ckpt, "--variant", "main=installed", "--out", out)
    assert again.returncode == 2 and "never overwritten" in again.stderr


def _reseeding_tree(dest: Path) -> Path:
    """The installed 2.0.3 with upstream main's seeding (after 2.0.3): ``_generate`` takes ``seed=`` and, without
    one, reseeds the generator from ``torch.seed()``."""
    from fastattn.lab.upstream import pristine_copy
    tree = pristine_copy(dest, "src")
    f = tree / "src" / "voxcpm" / "model" / "voxcpm2.py"
    text = f.read_text()
    sig = "        streaming_prefix_len: int = 4,\n    ) -> Generator[torch.Tensor, None, None]:\n"
    loop = "        retry_badcase_times = 0\n"
    assert text.count(sig) == 1 and text.index(loop) > text.index(sig)
    text = text.replace(sig, sig.replace("int = 4,\n", "int = 4,\n        seed: Optional[int] = None,\n"))
    reseed = "        torch.manual_seed(seed) if seed is not None else torch.seed()\n"
    f.write_text(text.replace(loop, reseed + loop, 1))
    return tree


@pytest.mark.slow
def test_a_tree_that_reseeds_itself_is_given_the_seed(tmp_path):
    """Upstream main reseeds each request unless ``seed=`` is passed: the bench passes it, so one tree run twice
    decodes the same waveform (with ``torch.manual_seed`` alone it would not)."""
    tree = _reseeding_tree(tmp_path / "main")
    out = tmp_path / "same.json"
    r = _bench("--random", "tiny", "--variant", f"a={tree}", "--variant", f"b={tree}", "--positions", "0",
               "--chunks", 6, "--rounds", 1, "--calls", 1, "--timesteps", 2, "--out", out)
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = json.loads(out.read_text())["variants"]
    assert b["stream"]["equal_to_first"] is True and b["baseline"] == "a"
    assert a["stream"]["seeding"] == b["stream"]["seeding"] == "generate_streaming(seed=...)"


def _bench_module():
    spec = importlib.util.spec_from_file_location("voxcpm_decode_bench", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_each_optimize_mode_has_its_own_baseline():
    """``--optimize both`` (CUDA's default): eager runs against eager main, compiled against compiled main."""
    bench = _bench_module()
    runs = bench.plan_runs([("main", None), ("pr", "/x/src")], "both")
    assert [r[0] for r in runs] == ["main optimize=off", "pr optimize=off", "main optimize=on", "pr optimize=on"]
    assert bench.baselines(runs) == {"main optimize=off": "main optimize=off", "pr optimize=off": "main optimize=off",
                                     "main optimize=on": "main optimize=on", "pr optimize=on": "main optimize=on"}
    assert bench.baselines(bench.plan_runs([("main", None), ("pr", "/x")], "off")) == {"main": "main", "pr": "main"}


def test_bad_variants_are_refused_before_anything_runs(tmp_path):
    r = _bench("--random", "tiny", "--variant", "nothing")
    assert r.returncode != 0 and "expected NAME=DIR" in r.stderr
    r = _bench("--random", "tiny", "--variant", f"x={tmp_path}")
    assert r.returncode != 0 and "holds neither voxcpm/ nor src/voxcpm/" in r.stderr


@pytest.mark.slow
def test_ingest_reads_the_json_back_as_a_machine_row(two_trees, tmp_path, capsys):
    rec, _, _ = two_trees
    f = tmp_path / "bench.json"
    f.write_text(json.dumps(rec))
    assert ing.main([str(f), "--dry-run"]) == 0
    row = capsys.readouterr().out
    assert "| pr / main |" in row and "random tiny, bfloat16" in row and "identical" in row and "256: " in row
    assert f"({cpu_features(cpu_flags())}), torch" in row, "the machine named by the CPU features the bench read"
    lines, where = ing.ingest(f, into=tmp_path / "bench")
    assert where.parent == tmp_path / "bench" and json.loads(where.read_text())["kind"] == ing.KIND
    assert ing.ingest(f, into=tmp_path / "bench")[1] != where, "a second ingest never overwrites the first"
    table = ing.bench_table(tmp_path / "bench")
    assert table.startswith(ing.HEADER[0]) and table.count("| pr / main |") == 2


def _gpu_shaped() -> dict:
    """What the bench writes on an H200 with the real checkpoint, optimize on and off (a GPU-shaped record)."""
    def variant(name, ms, equal, graphs, baseline):
        steps = {p: {"median_ms": ms, "ci_ms": [ms * 0.98, ms * 1.02], "n": 50, "samples_ms": [ms] * 50,
                     "ratio_to_first": ms / 0.9, "ratio_ci": [ms / 0.9 * 0.97, ms / 0.9 * 1.03]}
                 for p in ("0", "256", "1024", "4096", "8000")}
        stream = {"chunks": 480, "first_sixth_ms": 31.0, "last_sixth_ms": 33.0, "rtf": 0.21, "peak_bytes": 6.1e9,
                  "peak_kind": "CUDA allocated", "graphs_compiled": graphs, "cuda_graphs_recorded": graphs,
                  "sha256": "ab", "equal_to_first": equal, "slope_ms_per_100": 0.4, "slope_ci_ms_per_100": [0.1, 0.7]}
        return {"variant": name, "baseline": baseline, "tree": "src", "commit": "75cfa3e", "voxcpm_version": "2.0.3",
                "dtype": "bfloat16",
                "cache": "StaticKVCache", "optimize": True, "load_s": 40.0, "steps": steps, "stream": stream}
    return {"kind": ing.KIND, "version": 1, "weights": {"weights": "checkpoint", "model": "VoxCPM2"},
            "env": {"device": "cuda", "gpu": "NVIDIA H200", "driver": "570.86", "torch": "2.11.0+cu128",
                    "cuda": "12.8", "python": "3.12.3", "threads": 16},
            "params": {"device": "cuda", "chunks": 480, "positions": [0, 256, 1024, 4096, 8000], "optimize": "both"},
            "variants": [variant("main optimize=off", 0.95, True, 0, "main optimize=off"),  # --optimize both
                         variant("pr optimize=off", 0.9, True, 0, "main optimize=off"),
                         variant("main optimize=on", 0.9, True, 3, "main optimize=on"),
                         variant("pr optimize=on", 0.85, True, 3, "main optimize=on")]}


def test_the_printed_machine_line_names_the_gpu_or_the_cpu_flags():
    bench = _bench_module()
    gpu = {"gpu": "NVIDIA H200", "cuda": "12.8", "driver": "570.86", "threads": 16, "torch": "2.11.0+cu128",
           "python": "3.12.3"}
    assert bench.machine_line(gpu, {"weights": "checkpoint"}) == \
        "NVIDIA H200 (CUDA 12.8, driver 570.86), 16 threads, torch 2.11.0+cu128, Python 3.12.3; checkpoint"
    cpu = {"cpu": "AMD EPYC", "cpu_flags": {"avx512_bf16": True, "amx_bf16": False}, "cpu_capability": "AVX512",
           "threads": 2, "torch": "2.13.0+cpu", "python": "3.11.7"}
    assert bench.machine_line(cpu, {"weights": "random", "preset": "tiny"}).startswith(
        "AMD EPYC (avx512_bf16; ATen AVX512), 2 threads") and bench.cpu_flags().keys() <= set(bench.KERNEL_FLAGS)


def test_the_pasted_table_gives_a_ratio_only_against_a_baseline():
    """Each optimize mode's own baseline row prints no ratio; the others print theirs against it."""
    rec = _gpu_shaped()
    lines = _bench_module().table(rec["variants"], rec["params"]["positions"]).splitlines()[2:]
    assert [("x)" in line) for line in lines] == [False, True, False, True]


def test_a_cpu_is_named_by_the_features_that_pick_its_kernels():
    env = {"device": "cpu", "cpu": "Intel(R) Xeon(R) Processor", "torch": "2.13.0+cpu", "cpu_capability": "AVX512",
           "threads": 2}
    amx = dict.fromkeys(("avx512f", "avx512_bf16", "amx_bf16", "avx2"), True)
    assert ing._machine({**env, "cpu_flags": amx}) == "2-core Intel(R) Xeon(R) Processor (AMX), torch 2.13.0"
    no_amx = {**amx, "amx_bf16": False}
    assert ing._machine({**env, "cpu_flags": no_amx}).endswith("(AVX512-BF16, no AMX), torch 2.13.0")
    assert ing._machine({**env, "cpu_flags": {"avx2": True}}).endswith("(AVX2, no bf16 instructions), torch 2.13.0")
    assert ing._machine(env).endswith("(ATen AVX512), torch 2.13.0"), "a JSON without flags: ATen's capability"


def test_a_gpu_shaped_record_names_the_gpu_driver_and_weights(tmp_path):
    rec = _gpu_shaped()
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "bench-cuda.json").write_text(json.dumps(rec))
    table = ing.bench_table(tmp_path / "b")
    assert "NVIDIA H200 (cuda, driver 570.86), torch 2.11.0" in table and "checkpoint, bfloat16" in table
    assert "pr optimize=on / main optimize=on" in table and "4096: 0.94x [0.92, 0.97]" in table
    assert "pr optimize=off / main optimize=off" in table and "main optimize=on /" not in table  # each mode's own
    assert "480 chunks: 31 -> 33 ms, RTF 0.21" in table
    assert "No run of" in ing.bench_table(tmp_path / "none")


def test_ingest_is_a_command_of_this_repository(tmp_path):
    """``python -m tools.ingest FILE --dry-run`` from the repository root prints the row, stores nothing; a
    malformed file exits 2 naming what is wrong."""
    f = tmp_path / "gpu.json"
    f.write_text(json.dumps(_gpu_shaped()))
    r = subprocess.run([sys.executable, "-m", "tools.ingest", str(f), "--dry-run"], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.startswith(ing.HEADER[0]) and "H200" in r.stdout, r.stderr[-2000:]
    f.write_text("{not json")
    r = subprocess.run([sys.executable, "-m", "tools.ingest", str(f)], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 2 and "not JSON" in r.stdout


@pytest.mark.parametrize("breaks, says", [
    (lambda r: r.update(kind="stream_profile"), "not a voxcpm_decode_bench record"),
    (lambda r: r.update(version=7), "version 7"),
    (lambda r: r.pop("env"), "lacks 'env'"),
    (lambda r: r.update(variants=[]), "holds no variant"),
    (lambda r: r["variants"][1]["steps"].pop("256"), "no step timing at position 256"),
])
def test_a_malformed_file_is_refused_with_what_is_wrong(breaks, says, tmp_path):
    rec = copy.deepcopy(_gpu_shaped())
    breaks(rec)
    f = tmp_path / "bad.json"
    f.write_text(json.dumps(rec))
    with pytest.raises(ValueError, match=says):
        ing.ingest(f, dry_run=True)
    assert not (tmp_path / "bench").exists()
    f.write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        ing.ingest(f, dry_run=True)
