"""`tiered-kv bench --json` prints ratios measured side by side (quick mode; no absolute-time asserts)."""

from __future__ import annotations

import json

from tiered_kv import load_config
from tiered_kv.cli import main


def test_bench_quick_reports_ratios(capsys):
    assert main(["bench", "--quick", "--json", "--only", "lookup", "--only", "index", "--only", "cache"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["lookup"]["ratio"] > 0 and out["lookup"]["prefix"] == 1000
    assert [r["resident_blocks"] for r in out["index"]] == [10_000, 100_000]
    for row in out["index"]:
        assert 0 < row["index_bytes_per_block"] < 400
    sizes = {r["block_bytes"] for r in out["cache"]}
    assert sizes == {16 << 10, 256 << 10}
    for row in out["cache"]:
        assert row["store_ratio"] > 0 and row["load_ratio"] > 0


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
