"""Replay tools (issue 12): --capacity-share, --policy, --hints, --keep-partial, the yardsticks, --plot."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from replay_helpers import BLOCK, small_config, write_config

import tiered_kv as tkv
from tiered_kv.cli import main
from tiered_kv.policy import POLICIES
from tiered_kv.replay import simulate as sim
from tiered_kv.replay.plot import SHARES, sweep
from tiered_kv.replay.report import build_report
from tiered_kv.replay.run import (
    BLOCK_TOKENS,
    load_requests,
    replay_async,
    resolve_config,
    run_replay,
    simulate,
    with_capacity_share,
)
from tiered_kv.replay.sizing import longest_request, split_capacity
from tiered_kv.replay.trace import Request
from tiered_kv.replay.workload import chat_workload

YARDSTICKS = ["lru", "lru_drop_partial", *(f"{p}_drop_partial" for p in POLICIES if p != "lru"), "belady",
              "belady_drop_partial", "unbounded"]  # fmt: skip


def config(tmp_path: Path, *, requests: int = 120, **sizes: int) -> dict:
    """small_config with the disk tier off and two requests in flight: the tools turn tiers on themselves."""
    return small_config(tmp_path, requests=requests, disk_enabled=False, concurrency=2, **sizes)


def tiny_trace(path: Path, n: int = 240, seed: int = 4) -> Path:
    """Requests of 1-3 blocks over 40 shared documents and some one-offs; last blocks often partial."""
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        doc = rng.randrange(40) if rng.random() < 0.7 else 1000 + i
        blocks = 1 + doc % 3 if doc < 1000 else rng.randint(1, 3)
        tokens = 512 * (blocks - 1) + rng.choice((512, 100, 300))
        ids = [doc * 10 + k for k in range(blocks)]
        lines.append(json.dumps({"timestamp": i, "input_length": tokens, "output_length": 8, "hash_ids": ids}))
    path.write_text("\n".join(lines) + "\n")
    return path


def cli_json(capsys, argv: list[str]) -> dict:
    assert main([*argv, "--json", "--no-progress"]) == 0
    return json.loads(capsys.readouterr().out)


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("tiered-kv: error: "), err
    return err


# -- --capacity-share -------------------------------------------------------------------------
def test_capacity_share_sizes_the_tiers_exactly_and_the_replay_has_that_total(tmp_path):
    cfg = resolve_config(config(tmp_path))
    reqs = load_requests(cfg)
    sized, split = with_capacity_share(cfg, reqs, 0.25)
    assert split == split_capacity(sim.unique_blocks(reqs), longest_request(reqs), 0.25)
    assert sized.gpu.num_blocks == split.gpu
    assert sized.tiers.cpu.capacity == split.cpu * BLOCK
    assert sized.tiers.disk.enabled and sized.tiers.disk.capacity == split.disk * BLOCK  # disk was off
    res = run_replay(sized, reqs)
    assert (res.gpu_blocks, res.cpu_slots, res.disk_slots) == (split.gpu, split.cpu, split.disk)
    assert res.total_blocks == split.total == round(0.25 * sim.unique_blocks(reqs))
    assert res.stats.corrupt == 0 and res.stats.truncated == 0  # the GPU holds the longest request


def test_capacity_share_uses_the_model_geometry_when_no_block_bytes(tmp_path):
    data = config(tmp_path)
    data["model"] = {"model_id": "geo", "block_tokens": 16, "num_layers": 3, "num_kv_heads": 2, "head_dim": 40,
                     "dtype": "bfloat16"}  # fmt: skip  # 16*2*40*2 = 2560 B a tensor, 6 tensors: 15,360 B
    cfg = resolve_config(data)
    sized, split = with_capacity_share(cfg, load_requests(cfg), 0.1)
    assert cfg.bytes_per_block == 15_360
    assert sized.tiers.cpu.capacity == split.cpu * 15_360 and sized.tiers.disk.capacity == split.disk * 15_360


def test_capacity_share_still_checks_memory_and_disk_space(tmp_path):
    data = config(tmp_path)
    data["model"]["bytes_per_block"] = 1 << 30  # 1 GiB blocks: half of ~700 unique blocks fits nowhere here
    data["tiers"]["cpu"]["capacity"] = 1 << 30
    data["transfer"]["max_inflight_bytes"] = 1 << 30
    cfg = resolve_config(data)
    with pytest.raises(tkv.ConfigError, match=r"--capacity-share 0\.5: tiers\.cpu\.capacity: .* MemAvailable"):
        with_capacity_share(cfg, load_requests(cfg), 0.5)
    data["tiers"]["cpu"]["allow_overcommit"] = True
    cfg = resolve_config(data)
    with pytest.raises(tkv.ConfigError, match=r"--capacity-share 0\.5: tiers\.disk\.capacity: .* free at"):
        with_capacity_share(cfg, load_requests(cfg), 0.5)


def test_cli_capacity_share_reports_the_split(tmp_path, capsys):
    rep = cli_json(capsys, ["replay", "--config", write_config(tmp_path, config(tmp_path)), "--capacity-share", "0.25"])
    share = rep["capacity_share"]
    cap = rep["capacity"]
    assert share["share"] == 0.25 and share["unique"] == rep["unique_blocks"]
    assert share["total"] == cap["total_blocks"] == round(0.25 * rep["unique_blocks"])
    assert (cap["gpu_blocks"], cap["cpu_slots"], cap["disk_slots"]) == (share["gpu"], share["cpu"], share["disk"])
    assert all(x["capacity_blocks"] == cap["total_blocks"] for k, x in rep["simulated"].items() if k != "unbounded")


@pytest.mark.parametrize(
    ("share", "message"),
    [
        ("1.5", "--capacity-share: 1.5 is not a share: use 0 < F <= 1"),
        ("0", "--capacity-share: 0 is not a share"),
        ("nan", "--capacity-share: nan is not a share"),
        ("five", "--capacity-share: 'five' is not a number"),
        ("0.001", "--capacity-share 0.001: "),  # too small for the longest request: sizing's ConfigError
    ],
)
def test_cli_bad_capacity_share_is_one_line(tmp_path, capsys, share, message):
    argv = ["replay", "--config", write_config(tmp_path, config(tmp_path)), "--capacity-share", share, "--no-progress"]
    assert main(argv) == 2
    err = one_error_line(capsys)
    assert message in err, err
    if share == "0.001":
        assert "unique blocks" in err and "longest request" in err


# -- --policy, --hints, --keep-partial -------------------------------------------------------------
async def test_policy_override_reaches_the_cache(tmp_path):
    seen = {}

    async def record(engine) -> None:
        m = engine.cache.manager  # the last local tier runs the policy (window: LRU in the CPU above disk)
        seen["policy"] = (m.disk or m.cpu).policy.name

    for policy in POLICIES:
        cfg = resolve_config(config(tmp_path, requests=5), policy=policy)
        res = await replay_async(cfg, load_requests(cfg), before_close=record)
        assert cfg.eviction.policy == res.policy == seen["policy"] == policy


def test_unknown_policy_names_the_setting_and_the_choices(tmp_path, capsys):
    assert main(["replay", "--config", write_config(tmp_path, config(tmp_path)), "--policy", "mru", "--no-progress"]) == 2
    err = one_error_line(capsys)
    assert "eviction.policy" in err and all(repr(p) in err for p in POLICIES), err


def test_cli_flags_land_in_the_config_and_the_report(tmp_path, capsys):
    path = write_config(tmp_path, config(tmp_path, requests=20))
    rep = cli_json(capsys, ["replay", "--config", path])
    assert (rep["policy"], rep["hints"], rep["drop_partial"], rep["block_tokens"]) == ("lru", False, True, 512)
    rep = cli_json(capsys, ["replay", "--config", path, "--policy", "arc", "--hints", "--keep-partial"])
    assert (rep["policy"], rep["hints"], rep["drop_partial"]) == ("arc", True, False)
    data = config(tmp_path, requests=20)
    data["replay"]["hints"] = True
    rep = cli_json(capsys, ["replay", "--config", write_config(tmp_path, data), "--no-hints"])
    assert rep["hints"] is False
    cfg = resolve_config(data, hints=False, drop_partial=False)
    assert (cfg.replay.hints, cfg.replay.drop_partial) == (False, False)


def test_partial_last_blocks_are_dropped_unless_kept(tmp_path, capsys):
    """Each two-block request (last block partial) comes twice in a row: the repeat finds the partial
    block on the GPU only with --keep-partial."""
    trace = tmp_path / "partial.jsonl"
    trace.write_text("".join(
        json.dumps({"timestamp": i, "input_length": 512 + 100, "output_length": 1, "hash_ids": [i // 2 * 2, i // 2 * 2 + 1]})
        + "\n" for i in range(20)
    ))  # fmt: skip
    argv = ["replay", "--config", write_config(tmp_path, config(tmp_path)), "--trace", str(trace), "--concurrency", "1"]
    dropped = cli_json(capsys, argv)
    assert dropped["hit_blocks"]["gpu"] == 10 and dropped["store"]["partial_dropped"] == 20
    kept = cli_json(capsys, [*argv, "--keep-partial"])
    assert kept["hit_blocks"]["gpu"] == 20 and kept["store"]["partial_dropped"] == 0


# -- the report's yardsticks and block tokens --------------------------------------------------------
def test_report_stands_the_replay_beside_every_yardstick_at_its_total(tmp_path, capsys):
    path = write_config(tmp_path, config(tmp_path, requests=60))
    rep = cli_json(capsys, ["replay", "--config", path])
    total = rep["capacity"]["total_blocks"]
    assert list(rep["simulated"]) == YARDSTICKS
    reqs = chat_workload(60, seed=1)
    drop = {"drop_partial": True, "block_tokens": 512}
    want = {
        "lru": sim.simulate_lru(reqs, total),
        "lru_drop_partial": sim.simulate_lru(reqs, total, **drop),
        **{f"{p}_drop_partial": sim.simulate_policy(reqs, total, p, **drop) for p in POLICIES if p != "lru"},
        "belady": sim.simulate_belady(reqs, total),
        "belady_drop_partial": sim.simulate_belady(reqs, total, **drop),
    }
    for name, r in want.items():
        assert rep["simulated"][name] == {"capacity_blocks": total, "hit_rate": r.hit_rate}, name
    hr = rep["hit_rate"]
    assert hr["total"] == pytest.approx(hr["gpu"] + hr["cpu"] + hr["disk"] + hr["pending"])
    # The run's own policy's flat cache (partial blocks dropped, as the run drops them) is its yardstick.
    y = rep["yardstick"]
    assert y["name"] == "lru_drop_partial" and y["hit_rate"] == want["lru_drop_partial"].hit_rate
    # Runs of consecutive CPU slots per store plan: one plan per store that placed blocks here.
    sr = rep["slot_runs"]
    assert sr["calls"] > 0 and 1 <= sr["mean"] <= sr["max"] and 1 <= sr["p90"] <= sr["max"]
    assert sr["blocks_mean"] * sr["calls"] == pytest.approx(rep["store"]["stored"])
    assert y["gap_points"] == pytest.approx((hr["total"] - y["hit_rate"]) * 100)
    main(["replay", "--config", path, "--no-progress"])  # the table renders every row
    table = capsys.readouterr().out
    assert "this policy's yardstick" in table, table
    assert "CPU slot runs per store plan" in table, table
    for label in ("flat lru + drop partial", "flat belady + drop partial", "tiered_kv replay (lru)", "unbounded"):
        assert label in table, table


def test_block_tokens_travel_from_the_workload_to_the_report(tmp_path):
    """Blocks of 16 tokens: 32-token requests are two whole blocks (at 512 the second would be partial and
    dropped). Each comes twice in a row, so the repeat finds both blocks only if the emulator knows."""
    reqs = [Request(float(i), 32, 1, (i // 2 * 2, i // 2 * 2 + 1)) for i in range(20)]
    cfg = resolve_config(config(tmp_path), concurrency=1)
    res = run_replay(cfg, reqs, block_tokens=16)
    assert res.block_tokens == 16 and BLOCK_TOKENS == 512
    assert res.stats.partial_dropped == 0 and res.stats.hits_gpu == 20
    sims = simulate(reqs, res.total_blocks, block_tokens=16)
    assert sims["lru_drop_partial"] == sim.simulate_lru(reqs, res.total_blocks, drop_partial=True, block_tokens=16)
    assert sims["lru_drop_partial"].hit_blocks == 20  # at 512 tokens it would be 10
    rep = build_report(res, sims, workload="16-token blocks")
    assert rep["block_tokens"] == 16 and rep["tokens_not_recomputed"] == 20 * 16


# -- --plot ----------------------------------------------------------------------------------------
def test_sweep_replays_every_policy_at_each_feasible_share(tmp_path):
    reqs = load_requests(resolve_config(config(tmp_path)), tiny_trace(tmp_path / "t.jsonl"))
    cfg = resolve_config(config(tmp_path))
    unique, longest = sim.unique_blocks(reqs), longest_request(reqs)
    result = sweep(cfg, reqs, shares=(0.001, 0.1, 0.5), policies=("lru", "arc"))
    assert [s["share"] for s in result.skipped] == [0.001]
    assert "--capacity-share 0.001" in result.skipped[0]["reason"]
    assert [p.share for p in result.points] == [0.1, 0.5]
    for p in result.points:
        assert p.split == split_capacity(unique, longest, p.share)
        assert set(p.replays) == {"lru", "arc"}
        assert all(r.corrupt == 0 and 0 < r.tiered <= p.simulated["unbounded"] + 1e-9 for r in p.replays.values())
        assert p.simulated["lru_drop_partial"] == sim.simulate_lru(
            reqs, p.total_blocks, drop_partial=True, block_tokens=512
        ).hit_rate
    assert not any((tmp_path / "disk").glob("replay-*"))  # every replay's fresh directory is gone


@pytest.mark.slow  # 12 replays, ~4 s here; test_sweep_replays_every_policy_at_each_feasible_share runs by default
def test_cli_plot_writes_a_png_and_lists_the_points(tmp_path, capsys):
    trace = tiny_trace(tmp_path / "t.jsonl", n=200)
    png = tmp_path / "plot.png"
    rep = cli_json(capsys, ["replay", "--config", write_config(tmp_path, config(tmp_path)), "--trace", str(trace),
                            "--plot", str(png)])  # fmt: skip
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    plot = rep["plot"]
    done = [p["share"] for p in plot["points"]] + [s["share"] for s in plot["skipped"]]
    assert sorted(done) == list(SHARES) and len(plot["points"]) >= 2
    for p in plot["points"]:
        assert list(p["replays"]) == list(POLICIES)
        assert p["total_blocks"] == p["split"]["total"] and set(p["simulated"]) == set(YARDSTICKS)
