"""The loops tiered_kv creates (tiered_kv/loops.py): uvloop by default when importable, off by
TIERED_KV_UVLOOP; and every loop the package starts goes through that one module."""

from __future__ import annotations

import asyncio
import re
import sys
from pathlib import Path

import pytest
import torch
import uvloop
from loop_cache import CacheThread

import tiered_kv as tkv
from tiered_kv import loops

ROOT = Path(__file__).resolve().parents[2]


async def _running_loop() -> asyncio.AbstractEventLoop:
    return asyncio.get_running_loop()


def _kind(loop: asyncio.AbstractEventLoop) -> str:
    return "uvloop" if isinstance(loop, uvloop.Loop) else "asyncio"


@pytest.mark.parametrize("value,kind", [(None, "uvloop"), ("", "uvloop"), ("auto", "uvloop"), ("1", "uvloop"),
                                        ("on", "uvloop"), ("TRUE", "uvloop"), ("yes", "uvloop"), ("0", "asyncio"),
                                        ("off", "asyncio"), ("False", "asyncio"), (" no ", "asyncio")])  # fmt: skip
def test_uvloop_by_default_and_off_by_the_env_var(monkeypatch, value, kind):
    if value is None:
        monkeypatch.delenv(loops.ENV_VAR, raising=False)
    else:
        monkeypatch.setenv(loops.ENV_VAR, value)
    assert loops.uvloop_chosen() == (kind == "uvloop")
    assert _kind(loops.run(_running_loop())) == kind
    loop = loops.new_loop()
    try:
        assert _kind(loop) == kind
    finally:
        loop.close()


def test_without_uvloop_auto_falls_back_and_on_is_refused(monkeypatch):
    monkeypatch.setitem(sys.modules, "uvloop", None)  # as on Windows, or without the package
    monkeypatch.delenv(loops.ENV_VAR, raising=False)
    assert _kind(loops.run(_running_loop())) == "asyncio"
    monkeypatch.setenv(loops.ENV_VAR, "on")
    with pytest.raises(tkv.ConfigError, match="TIERED_KV_UVLOOP='on' asks for uvloop"):
        loops.new_loop()


def test_a_bad_value_names_the_variable(monkeypatch):
    monkeypatch.setenv(loops.ENV_VAR, "fast")
    with pytest.raises(tkv.ConfigError, match=r"TIERED_KV_UVLOOP='fast': expected auto"):
        loops.run(_running_loop())


@pytest.mark.parametrize("value,kind", [(None, "uvloop"), ("0", "asyncio")])
def test_the_loop_thread_a_cache_runs_on(monkeypatch, value, kind):
    """LoopThread: the vLLM connector's scheduler half runs its cache on one."""
    if value is None:
        monkeypatch.delenv(loops.ENV_VAR, raising=False)
    else:
        monkeypatch.setenv(loops.ENV_VAR, value)
    cfg = tkv.load_config({"model": {"model_id": "loop-test", "bytes_per_block": 1024}, "gpu": {"num_blocks": 8},
                           "tiers": {"cpu": {"capacity": 16 * 1024}}})  # fmt: skip
    kv = {"k": torch.zeros(8, 1024, dtype=torch.uint8)}
    runtime = CacheThread(cfg, tkv.KVLayout.from_tensors(kv, 8))
    try:
        assert _kind(runtime.call(_running_loop())) == kind
    finally:
        runtime.close()


def test_no_loop_is_started_outside_loops_py():
    """replay, bench and the vLLM connector start their loops through tiered_kv.loops, never on their own."""
    starts = re.compile(r"\basyncio\.(run|new_event_loop|Runner)\(|\buvloop\.(run|new_event_loop|install)\(")
    found = [f"{p.relative_to(ROOT)}:{n}" for p in sorted((ROOT / "tiered_kv").rglob("*.py")) if p.name != "loops.py"
             for n, line in enumerate(p.read_text().splitlines(), 1) if starts.search(line)]  # fmt: skip
    assert found == []
