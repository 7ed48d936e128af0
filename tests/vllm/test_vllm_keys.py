"""Keys and config of the vLLM connector: no vLLM needed, so these run in every venv."""

from __future__ import annotations

import subprocess
import sys

import pytest

import tiered_kv as tkv
from tiered_kv.integrations.vllm.extra_config import resolve_config
from tiered_kv.scheduler.request_keys import request_block_keys, request_salt

BS = 32


def keyer(model_id: str = "m") -> tkv.BlockKeyer:
    layout = tkv.KVLayout.from_block_bytes([BS * 64 * 2] * 4, 16)
    cfg = tkv.load_config({"model": {"model_id": model_id, "bytes_per_block": layout.bytes_per_block,
                                     "block_tokens": BS}})  # fmt: skip
    return tkv.make_keyer(cfg, layout)


PROMPT = list(range(3, 3 + 3 * BS + 7))


def test_unsalted_keys_are_the_librarys_token_keys():
    k = keyer()
    assert request_block_keys(k, PROMPT, BS) == k.keys_for_tokens(PROMPT)
    assert len(request_block_keys(k, PROMPT, BS, n_blocks=2)) == 2


def test_extra_keys_change_every_block_key():
    k = keyer()
    plain = request_block_keys(k, PROMPT, BS)
    variants = [request_salt(cache_salt="tenant-a"), request_salt(cache_salt="tenant-b"),
                request_salt(lora_name="sql", lora_id=1), request_salt(mm_items=[("img-hash", 4, 16)])]  # fmt: skip
    seen = {tuple(plain)}
    for salt in variants:
        assert len(salt) == 4
        keys = request_block_keys(k, PROMPT, BS, salt)
        assert all(a != b for a, b in zip(keys, plain, strict=True))
        seen.add(tuple(keys))
    assert len(seen) == 1 + len(variants)
    assert request_salt() == () and request_salt(cache_salt="") == ()


def test_keys_are_stable_across_processes_and_hash_seeds():
    salt = request_salt(cache_salt="s", lora_name="a", lora_id=2)
    here = [key.hex() for key in request_block_keys(keyer(), PROMPT, BS, salt)]
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); from test_vllm_keys import *; "
        "print(' '.join(k.hex() for k in request_block_keys(keyer(), PROMPT, BS, "
        "request_salt(cache_salt='s', lora_name='a', lora_id=2))))"
    )
    for seed in ("1", "2"):
        env = {"PYTHONHASHSEED": seed, "PATH": "/usr/bin:/bin"}
        out = subprocess.run([sys.executable, "-c", code, str(__import__("pathlib").Path(__file__).parent)],
                             capture_output=True, text=True, env=env, check=True)  # fmt: skip
        assert out.stdout.split() == here


def test_model_namespace_changes_keys():
    assert request_block_keys(keyer("a"), PROMPT, BS) != request_block_keys(keyer("b"), PROMPT, BS)


def test_resolve_config_fills_model_id_and_geometry_from_vllm(tmp_path):
    cfg = resolve_config({"tiers": {"cpu": {"capacity": "1MiB"}}}, "/models/llama", "v2", 32768)
    assert cfg.model.model_id == "/models/llama" and cfg.model.revision == "v2"
    assert cfg.bytes_per_block == 32768
    path = tmp_path / "tkv.yaml"
    path.write_text("model:\n  model_id: mine\ntiers:\n  cpu:\n    capacity: 1MiB\n")
    cfg = resolve_config(str(path), "/models/llama", None, 32768)
    assert cfg.model.model_id == "mine"


@pytest.mark.parametrize(
    ("raw", "needle"),
    [(42, "YAML path or a dict"), ("/nonexistent/tkv.yaml", "/nonexistent/tkv.yaml"),
     ({"tiers": {"cpu": {"capacity": "lots"}}}, "tiers.cpu.capacity")],  # fmt: skip
)
def test_resolve_config_errors_name_the_problem(raw, needle):
    with pytest.raises(tkv.ConfigError, match=needle.replace(".", r"\.")):
        resolve_config(raw, "m", None, 32768)
