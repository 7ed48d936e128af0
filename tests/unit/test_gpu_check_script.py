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
    for step in ("build", "tests", "bench", "shard-bench"):
        assert f"[{step}] skipped, no CUDA found; would run:" in out.stdout
    assert "pytest -q -p no:cacheprovider -m gpu tests" in out.stdout  # make test-gpu's set, slow ones included
    assert "bench --only gpu --json" in out.stdout and "bench_shard_copier.py --world 2 --engine cuda" in out.stdout
    doc = json.loads((tmp_path / "gpu-check.json").read_text())
    assert doc["cuda"] is False and doc["dry_run"] is True and "no CUDA found" in doc["message"]
    assert doc["steps"] == {"build": "skipped", "tests": "skipped", "bench": "skipped", "shard-bench": "skipped"}
