"""scripts/gpu-check.sh without CUDA: the same steps as a dry run, each skipped with a clear message, and
one JSON that says so (on a CUDA machine this test is skipped: the script then runs the real check)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA here: scripts/gpu-check.sh runs the real check")
def test_without_cuda_it_dry_runs_every_step_and_says_no_cuda_was_found(tmp_path):
    import sys

    env = dict(os.environ, PYTHON=sys.executable)
    out = subprocess.run(["bash", str(ROOT / "scripts" / "gpu-check.sh"), str(tmp_path)], capture_output=True,
                         text=True, env=env, timeout=300, cwd=tmp_path)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "no CUDA found" in out.stdout and "DRY RUN" in out.stdout
    for step in ("wheels", "build", "tests", "bench", "e2e", "compute-beside", "shard-bench", "copier-bench"):
        assert f"[{step}] skipped, no CUDA found; would run:" in out.stdout
    assert "pytest -q -p no:cacheprovider -m gpu tests" in out.stdout  # make test-gpu's set, slow ones included
    assert "bench --only gpu --json" in out.stdout and "bench_shard_copier.py --world 2 --engine cuda" in out.stdout
    doc = json.loads((tmp_path / "gpu-check.json").read_text())
    assert doc["cuda"] is False and doc["dry_run"] is True and "no CUDA found" in doc["message"]
    assert doc["steps"] == {s: "skipped" for s in ("wheels", "build", "tests", "bench", "e2e", "compute-beside", "shard-bench",
                                                   "copier-bench")}  # fmt: skip
    assert "-m tiered_kv.bench.copier --engine cuda --json" in out.stdout  # a process per rank, wait()
    assert "pip install --no-index --find-links shared/wheels pydantic" in out.stdout  # carried wheels
    assert "scripts/gpu_e2e.py --json" in out.stdout  # the end-to-end case, both geometries, every path
    assert "scripts/gpu_compute_beside.py --json" in out.stdout  # the model's compute beside the copies


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA here: the script measures")
def test_the_end_to_end_script_dry_runs_without_cuda(tmp_path):
    import sys

    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_e2e.py"), "--json", str(tmp_path / "e.json")],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    doc = json.loads((tmp_path / "e.json").read_text())
    assert doc["dry_run"] is True and doc["cuda"] is False
