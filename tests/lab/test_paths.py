"""fastattn.lab.paths: records leave machine paths behind on the way to disk; a failed write loses nothing."""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from fastattn.lab import bench
from fastattn.lab.paths import atomic_write_text, repo_root, without_machine_paths


# a failed write never leaves a cut-short file or a run marked "ok"
def test_atomic_write_leaves_nothing_on_failure(tmp_path, monkeypatch):
    target = tmp_path / "summary.json"
    atomic_write_text(target, json.dumps({"ok": 1}))

    def full_disk(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space left"):
        atomic_write_text(target, json.dumps({"ok": 2}) * 1000)
    assert json.loads(target.read_text()) == {"ok": 1}  # the earlier content, whole
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]  # no temporary left behind


def test_records_carry_no_machine_paths(tmp_path):
    """A record is shared (committed, pasted upstream): temporary folders, the checkout, the venv and the home
    folder leave it on the way to disk; the committed ones hold none."""

    where = [f"{tempfile.gettempdir()}/tmpab_12/main/src", str(repo_root() / "data"), sys.prefix, str(Path.home())]
    path = bench.save_record(bench.record("x", env={}, params={}, rows=[{"where": w} for w in where]), tmp_path)
    for text in (path.read_text(), path.with_suffix(".csv").read_text()):
        assert "<tmp>/main/src" in text and "<fastattn>/data" in text and not any(w in text for w in where), text
    root = repo_root()
    tracked = subprocess.run(["git", "ls-files", "data/results"], cwd=root, capture_output=True, text=True).stdout
    leaks = [f for f in tracked.split() if f.endswith((".json", ".csv", ".md")) and   # the writer's own scrubber
             without_machine_paths((root / f).read_text()) != (root / f).read_text()]
    assert not leaks, leaks
