"""`tiered-kv bench --json` prints ratios measured side by side (quick mode; no absolute-time or target asserts)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tiered_kv import load_config
from tiered_kv.cli import main


def _finite_spread(s: dict) -> None:
    assert all(math.isfinite(s[k]) and s[k] > 0 for k in ("median", "q1", "q3", "lo", "hi"))
    assert s["lo"] <= s["q1"] <= s["median"] <= s["q3"] <= s["hi"]


def _check_copy_rows(rows: list[dict], ops: set[str]) -> None:
    assert {r["op"] for r in rows} == ops
    for r in rows:
        assert r["rounds"] >= 9 and r["ratio"]["n"] == r["rounds"]  # the method: at least 9 interleaved rounds
        for key in ("ratio", "raw_gbps", "ours_gbps"):
            _finite_spread(r[key])
        assert r["raw_method"] and r["blocks_per_sample"] % r["batch"] == 0


@pytest.mark.slow
def test_bench_quick_json_runs_every_section(capsys):
    assert main(["bench", "--quick", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["meta"]["quick"] is True and out["meta"]["batch_blocks"] == 64
    cache = out["cache"]
    _check_copy_rows(cache, {"store", "load"})
    assert {(r["op"], r["regions"]) for r in cache} == {(op, n) for op in ("store", "load") for n in (8, 128)}
    for r in cache:
        assert r["region_bytes"] * r["regions"] == r["block_bytes"]
        assert r["raw_method"] in r["raw_candidates_gbps"]  # the reference is the fastest candidate by median
        assert r["raw_candidates_gbps"][r["raw_method"]] == max(r["raw_candidates_gbps"].values())
    _check_copy_rows(out["disk"], {"spill", "promote warm", "promote cold"})
    lookup = out["lookup"]
    assert lookup["prefix"] == 1000 and lookup["rounds"] >= 9
    for key in ("time_ratio", "raw_us", "ours_us"):
        _finite_spread(lookup[key])
    memory = out["memory"]
    assert memory["resident_blocks"] > 0
    assert math.isfinite(memory["bytes_per_block"]) and memory["bytes_per_block"] >= memory["index_arrays_bytes_per_block"] > 0
    if torch.cuda.is_available():
        _check_copy_rows(out["gpu"]["rows"], {"store", "load"})
    else:
        assert "CUDA" in out["gpu"]["skipped"]


def test_bench_only_lookup_prints_one_section(capsys):
    assert main(["bench", "--quick", "--json", "--only", "lookup"]) == 0
    out = json.loads(capsys.readouterr().out)
    # the bookkeeping figures: lookup, store planning (CPU only, and over CPU + disk per policy)
    assert set(out) == {"meta", "targets", "lookup", "manager", "manager_hierarchy"}
    _finite_spread(out["lookup"]["time_ratio"])
    _finite_spread(out["manager"]["time_ratio"])
    assert [r["policy"] for r in out["manager_hierarchy"]] == ["lru", "arc", "window"]
    for r in out["manager_hierarchy"]:
        assert r["disk_slots"] == 2 * r["slots"]
        _finite_spread(r["time_ratio"])
    assert main(["bench", "--quick", "--only", "lookup"]) == 0  # the table form
    assert "lookup of a 1,000-block prefix" in capsys.readouterr().out


def test_bench_refuses_a_missing_dir(capsys, tmp_path):
    assert main(["bench", "--quick", "--only", "disk", "--dir", str(tmp_path / "nope")]) == 2
    assert "bench --dir" in capsys.readouterr().err


def test_plan_and_check_config_cli(capsys, tmp_path):
    assert main(["plan", "configs/default.yaml", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    cfg = load_config("configs/default.yaml")
    assert plan["bytes_per_block"] == cfg.bytes_per_block == 32768
    slots = {t["tier"]: t["slots"] for t in plan["tiers"]}
    assert slots["cpu"] == cfg.tiers.cpu.capacity // 32768
    bad = tmp_path / "bad.yaml"
    bad.write_text("tiers:\n  cpu:\n    capacity: -1\n")
    assert main(["check-config", str(bad)]) == 2
    assert "tiers.cpu.capacity" in capsys.readouterr().err
    assert main(["check-config", "configs/cpu-only.yaml", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True


@pytest.mark.slow
def test_bench_only_inflight_and_call_cost_print_their_sections(capsys):
    from rich.console import Console

    from tiered_kv.bench.render import render

    assert main(["bench", "--quick", "--json", "--only", "inflight", "--only", "call_cost"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"meta", "targets", "inflight", "call_cost"}
    inflight = out["inflight"]
    assert {(r["op"], r["inflight"]) for r in inflight} == {("store", 1), ("store", 2), ("load", 1), ("load", 2),
                                                             ("both", 2)}  # fmt: skip
    for r in inflight:
        _finite_spread(r["ratio"])
    cost = out["call_cost"]
    assert [(r["op"], r["tier"], r["policy"]) for r in cost] == [
        (op, tier, policy) for tier, policy in (("cpu", "lru"), ("disk", "lru"), ("disk", "arc"), ("disk", "window"))
        for op in ("store", "load")]  # fmt: skip
    for r in cost:
        _finite_spread(r["time_ratio"])  # the bar: a dict-insert loop of the call's 64 keys
        assert r["target_max"] == out["targets"]["call_cost_cache_us_max"] == 100
        assert r["meets_target"] == (r["cache_us"]["median"] <= 100)
    console = Console(record=True, width=160)
    render(out, console)
    text = console.export_text()
    assert "calls in flight through TieredKVCache" in text and "store 16K x8" in text and "of one way" in text
    assert "the cache's own host time per 64-block call" in text and "store disk window" in text
    assert "load cpu: " in text and "runners+loop" in text  # the parts, per case
