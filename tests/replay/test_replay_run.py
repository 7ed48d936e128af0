"""End-to-end replays through a real TieredKVCache, the CLI, corruption detection and the plot."""

from __future__ import annotations

import asyncio
import json
import socket
import urllib.request
from pathlib import Path

import pytest
import torch
from replay_helpers import BLOCK, small_config, write_config

import tiered_kv as tkv
from tiered_kv.cli import main
from tiered_kv.replay.engine import EngineEmulator, key_patterns, region_rows, run_requests
from tiered_kv.replay.gpu_cache import GpuPrefixCache
from tiered_kv.replay.instance import make_kv
from tiered_kv.replay.run import load_requests, replay_async, resolve_config, run_replay
from tiered_kv.replay.trace import Request
from tiered_kv.tiers.disk.format import DATA_FILE, HEADER_SIZE

TRACE = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "mooncake_synthetic_trace.jsonl"
def run_cli(capsys, argv: list[str]) -> tuple[int, dict]:
    rc = main(argv)
    return rc, json.loads(capsys.readouterr().out)


# -- end to end through the CLI ---------------------------------------------------------------
def test_cli_replay_all_tiers_hit_and_json_has_every_field(tmp_path, capsys):
    cfg = write_config(tmp_path, small_config(tmp_path))
    rc, rep = run_cli(capsys, ["replay", "--config", cfg, "--json", "--block-bytes", "4KiB"])
    assert rc == 0
    for field in (
        "requests", "block_refs", "hit_rate", "hit_blocks", "tokens_not_recomputed", "transfers", "latency",
        "spills", "evictions", "degraded_events", "store_skipped", "verified_blocks", "corrupt_blocks",
        "wall_s", "capacity", "simulated",
    ):  # fmt: skip
        assert field in rep, field
    assert rep["requests"] == 150
    assert rep["corrupt_blocks"] == 0 and rep["verified_blocks"] > 0
    hb = rep["hit_blocks"]
    assert hb["gpu"] > 0 and hb["cpu"] > 0 and hb["disk"] > 0, hb
    assert rep["verified_blocks"] == hb["cpu"] + hb["disk"] + hb["pending"]
    assert rep["tokens_not_recomputed"] == hb["total"] * 512
    assert 0 < rep["hit_rate"]["total"] <= rep["simulated"]["unbounded"]["hit_rate"] + 1e-9
    local = {"gpu_to_cpu", "cpu_to_gpu", "cpu_to_disk", "disk_to_cpu"}
    assert local <= set(rep["transfers"])  # a remote tier, when there is one, adds its own directions
    for name in local:
        d = rep["transfers"][name]
        assert d["bytes"] > 0 and d["gb_per_s"] > 0, name
    assert rep["latency"]["load"]["p99_ms"] >= rep["latency"]["load"]["p50_ms"] > 0
    assert rep["spills"] > 0 and rep["evictions"]["cpu"] > 0
    cap = rep["capacity"]
    assert cap["total_blocks"] == 96 + 128 + 512 == rep["simulated"]["lru"]["capacity_blocks"]
    # The run's fresh disk directory is gone afterwards.
    assert not any((tmp_path / "disk").glob("replay-*"))


def test_sequential_replay_matches_the_simulators(tmp_path):
    """With one request at a time, the GPU prefix cache is exactly an LRU of num_blocks."""
    from tiered_kv.replay.simulate import simulate_lru, simulate_unbounded

    cfg = resolve_config(small_config(tmp_path, requests=120, disk=4096), concurrency=1, drop_partial=False)
    reqs = load_requests(cfg)
    res = run_replay(cfg, reqs)
    s = res.stats
    assert s.hits_gpu == simulate_lru(reqs, 96).hit_blocks
    # CPU + disk hold every block ever stored: the total is the unbounded hit count.
    assert s.hits_gpu + s.hits_cpu + s.hits_disk + s.hits_pending == simulate_unbounded(reqs).hit_blocks
    assert s.corrupt == 0 and s.store_skipped == 0


@pytest.mark.skipif(not TRACE.exists(), reason="../shared/data/mooncake_synthetic_trace.jsonl is missing")
def test_mooncake_trace_head_replays(tmp_path, capsys):
    cfg = write_config(tmp_path, small_config(tmp_path, gpu=256, cpu=512, disk=2048))
    rc, rep = run_cli(
        capsys, ["replay", "--config", cfg, "--trace", str(TRACE), "--max-requests", "300", "--json"]
    )
    assert rc == 0
    assert rep["requests"] == 300 and rep["corrupt_blocks"] == 0
    assert rep["hit_blocks"]["total"] > 0 and rep["verified_blocks"] > 0


def test_malformed_trace_exits_2_naming_the_line(tmp_path, capsys):
    trace = tmp_path / "bad.jsonl"
    good = json.dumps({"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [1]})
    trace.write_text(f"{good}\n{good}\n{{not json\n")
    cfg = write_config(tmp_path, small_config(tmp_path))
    assert main(["replay", "--config", cfg, "--trace", str(trace), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tiered-kv: error: ") and "bad.jsonl:3" in err and err.count("\n") == 1


def test_bad_block_bytes_is_a_config_error(tmp_path, capsys):
    cfg = write_config(tmp_path, small_config(tmp_path))
    assert main(["replay", "--config", cfg, "--block-bytes", "lots"]) == 2
    assert "replay.block_bytes" in capsys.readouterr().err


# -- corruption: caught by us (CPU) or by the disk tier's checks ---------------------------------
def _reqs(*id_lists: list[int]) -> list[Request]:
    return [Request(float(i), 512 * len(ids), 1, tuple(ids)) for i, ids in enumerate(id_lists)]


async def _open(tmp_path: Path, **tiers) -> tuple[tkv.TieredKVCache, list[torch.Tensor]]:
    cfg = resolve_config(small_config(tmp_path, **tiers))
    kv = make_kv(cfg)
    layout = tkv.KVLayout.from_tensors(kv, cfg.gpu.num_blocks)
    return await tkv.TieredKVCache(cfg, layout).start(), list(layout.regions)


async def test_flipped_cpu_byte_is_counted_corrupt_and_recomputed(tmp_path):
    cache, regions = await _open(tmp_path, gpu=8, cpu=16, disk=16)
    try:
        first = EngineEmulator(cache, regions, exclusive=False)  # stores at once, not on GPU eviction
        req = _reqs([1, 2, 3, 4])[0]
        await first.run_request(req)
        first.close()
        keys = cache.keyer.keys_for_block_ids(req.hash_ids)
        slot = int(cache.manager.cpu.find_ready([keys[2]])[0])
        cache.slabs.regions[0][slot, 7] ^= 0xFF  # the CPU tier has no checksum: only the emulator can tell
        fresh = EngineEmulator(cache, regions)  # an empty GPU prefix cache over the same tensors
        await fresh.run_request(req)
        s = fresh.stats
        assert (s.verified, s.corrupt, s.hits_cpu) == (3, 1, 3)
        gid = fresh.gpu.cached[keys[2]]
        want = region_rows(key_patterns([keys[2]]), 0, regions[0].shape[1])[0]
        assert torch.equal(regions[0][gid], want)  # the GPU block was recomputed
        fresh.close()
    finally:
        await cache.aclose()


async def test_flipped_disk_byte_is_a_miss_not_corrupt_data(tmp_path):
    cache, regions = await _open(tmp_path, gpu=8, cpu=8, disk=64)
    try:
        engine = EngineEmulator(cache, regions, exclusive=False)  # stores at once, not on GPU eviction
        reqs = _reqs([1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16])
        await run_requests(engine, reqs, concurrency=1)
        engine.close()
        assert cache.stats()["disk"]["resident"] >= 4  # the first requests were spilled
        data = next((tmp_path / "disk").rglob(DATA_FILE))
        record = -(-(HEADER_SIZE + BLOCK) // 4096) * 4096
        raw = bytearray(data.read_bytes())
        for off in range(HEADER_SIZE + 100, len(raw), record):
            raw[off] ^= 0xFF
        data.write_bytes(raw)
        fresh = EngineEmulator(cache, regions)
        await fresh.run_request(reqs[0])
        fresh.close()
        assert fresh.stats.corrupt == 0 and fresh.stats.hits_disk == 0
        assert fresh.stats.computed == 4
        assert cache.metrics.snapshot()["tiered_kv_corrupt_blocks_total{disk}"] >= 1
    finally:
        await cache.aclose()


# -- pieces ----------------------------------------------------------------------------------------
async def test_gpu_prefix_cache_refs_protect_and_head_is_most_recent():
    gpu = GpuPrefixCache(4)
    grant = gpu.try_acquire([b"a", b"b", b"c"])
    assert grant is not None and grant[0] == 0
    assert gpu.try_acquire([b"x", b"y"]) is None  # 3 of 4 blocks referenced: nothing changed
    gpu.publish([b"a", b"b", b"c"], grant[1])
    gpu.finish([b"a", b"b", b"c"], grant[1], publish=3)
    assert list(gpu.lru) == [grant[1][2], grant[1][1], grant[1][0]]  # tail oldest, head newest
    n, ids, evicted = gpu.try_acquire([b"a", b"x", b"y"])
    assert n == 1 and b"c" not in gpu.cached and b"b" in gpu.cached  # evicted the tail first
    assert evicted == [(b"c", grant[1][2])]  # handed back for a store before its block is reused
    gpu.finish([b"a", b"x", b"y"], ids, publish=0)  # a failed request publishes nothing
    assert b"x" not in gpu.cached and gpu.refs == [0, 0, 0, 0]


async def test_a_block_being_computed_is_a_hit_that_waits_until_it_is_valid():
    gpu = GpuPrefixCache(8)
    _, first, _ = gpu.try_acquire([b"a", b"b"])
    n, second, _ = gpu.try_acquire([b"a", b"b", b"c"])  # a and b are still being computed
    assert n == 2 and second[:2] == first
    waiter = asyncio.ensure_future(gpu.ready(second[:n]))
    await asyncio.sleep(0)
    assert not waiter.done()
    gpu.publish([b"a", b"b"], first)  # their bytes are valid now
    await asyncio.wait_for(waiter, 1)
    # A request that fails before its blocks are valid takes them back, and its waiters fail.
    _, third, _ = gpu.try_acquire([b"z"])
    _, fourth, _ = gpu.try_acquire([b"z"])
    waiter = asyncio.ensure_future(gpu.ready(fourth[:1]))
    gpu.finish([b"z"], third, publish=0)
    with pytest.raises(RuntimeError, match="failed"):
        await waiter
    assert b"z" not in gpu.cached


async def test_metrics_port_serves_and_speed_paces(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = resolve_config(small_config(tmp_path, requests=20), speed=10.0)
    reqs = [Request(i * 20.0, 1024, 1, (i, i + 1)) for i in range(20)]  # 380 ms of trace at 10x
    scraped = {}

    async def scrape(_engine) -> None:
        url = f"http://127.0.0.1:{port}/metrics"
        scraped["body"] = await asyncio.to_thread(
            lambda: urllib.request.urlopen(url, timeout=5).read().decode()
        )

    res = await replay_async(cfg, reqs, metrics_port=port, before_close=scrape)
    assert "tiered_kv_bytes_total" in scraped["body"]
    assert res.stats.requests == 20 and res.wall_s >= 0.038


# -- issue 9: input the replay used to choke on, and what it leaves behind ----------------------------
def test_unsigned_64_bit_hash_ids_replay_end_to_end(tmp_path):
    """Ids >= 2^63 (legal 64-bit hashes) used to overflow the keyer's int64 packing."""
    cfg = resolve_config(small_config(tmp_path, requests=3), concurrency=1)
    big = [2**63, 2**64 - 1, 2**63 + 5]
    reqs = _reqs(big, big + [7], [5, 2**63 + 5])
    res = run_replay(cfg, reqs)
    assert res.stats.requests == 3 and res.stats.corrupt == 0
    assert res.stats.hits_gpu == 3  # the second request reuses the first one's three blocks
    assert res.stats.computed == 3 + 1 + 2  # 5 and 2^63 + 5 are different blocks, not wrapped onto each other


async def test_a_request_longer_than_the_gpu_is_cut_before_it_is_hashed(tmp_path):
    """A 50 MB line cut to 64 blocks took 26 s: every id was hashed first. Ids past the cut are
    never keyed now; a non-integer there (it would fail to hash) proves it."""
    cache, regions = await _open(tmp_path, gpu=8, cpu=16, disk=16)
    try:
        engine = EngineEmulator(cache, regions)
        await engine.run_request(Request(0.0, 512 * 9, 1, (*range(8), "never hashed")))  # type: ignore[arg-type]
        engine.close()
        assert (engine.stats.block_refs, engine.stats.truncated, engine.stats.computed) == (9, 1, 8)
    finally:
        await cache.aclose()


def test_pacing_that_would_wait_over_a_day_is_refused(tmp_path):
    from tiered_kv.replay.run import check_pacing

    hour = [Request(0.0, 512, 1, (1,)), Request(3_600_000.0, 512, 1, (2,))]
    with pytest.raises(tkv.ConfigError, match=r"replay\.speed: 1e-09 would pace this trace's 3600 s .* speed >= 0\.0417"):
        check_pacing(hour, 1e-9)
    check_pacing(hour, 0.05)  # 20 hours: allowed
    check_pacing(hour, 0.0)  # as fast as possible
    cfg = resolve_config(small_config(tmp_path, requests=50), speed=1e-6)
    with pytest.raises(tkv.ConfigError, match=r"replay\.speed"):  # the built-in workload is paced too
        load_requests(cfg)


def test_block_bytes_below_the_minimum_is_refused(tmp_path):
    with pytest.raises(tkv.ConfigError, match=r"replay\.block_bytes: 1 bytes is below the minimum of 512"):
        resolve_config(small_config(tmp_path), block_bytes=1)
    assert resolve_config(small_config(tmp_path), block_bytes=512).bytes_per_block == 512


def test_emulated_gpu_beyond_memory_is_refused_before_allocating(tmp_path):
    data = small_config(tmp_path)
    data["gpu"]["num_blocks"] = 2**31  # 8 TiB of 4 KiB blocks: check-config accepts it, the replay cannot
    cfg = resolve_config(data)
    with pytest.raises(tkv.ConfigError, match=r"gpu\.num_blocks: the replay's emulated KV cache of 2147483648 blocks"):
        make_kv(cfg)


def test_replay_keeps_a_configured_directory_it_did_not_create(tmp_path):
    mine = tmp_path / "users-empty-dir"
    mine.mkdir()
    data = small_config(tmp_path, requests=10)
    data["tiers"]["disk"]["path"] = str(mine)
    run_replay(resolve_config(data), load_requests(resolve_config(data)))
    assert mine.is_dir() and not any(mine.iterdir())  # its replay-<pid> is gone, the directory stays


def test_replay_removes_the_directories_it_created(tmp_path):
    data = small_config(tmp_path, requests=10)
    data["tiers"]["disk"]["path"] = str(tmp_path / "new" / "cache")
    run_replay(resolve_config(data), load_requests(resolve_config(data)))
    assert not (tmp_path / "new").exists()


def test_replay_runs_a_minimal_config_with_the_placeholder_model_id(tmp_path, capsys):
    """The replay's bytes are synthetic and its disk directory fresh, so it may use the placeholder
    id that check-config refuses for a disk tier."""
    path = tmp_path / "minimal.yaml"
    path.write_text(
        f"tiers:\n  cpu:\n    capacity: 1MiB\n  disk:\n    enabled: true\n    path: {tmp_path / 'disk'}\n"
        "    capacity: 2MiB\nreplay:\n  num_requests: 10\n"
    )
    with pytest.raises(tkv.ConfigError, match="placeholder"):
        tkv.load_config(path)
    cfg = resolve_config(str(path), block_bytes="16KiB")
    assert cfg.model.model_id == "demo-model" and cfg.model.allow_placeholder_id
    rc, rep = run_cli(capsys, ["replay", "--config", str(path), "--json", "--block-bytes", "16KiB"])
    assert rc == 0 and rep["requests"] == 10
    path.write_text("tiers:\n  cpu:\n    capacity: 1\n")
    with pytest.raises(tkv.ConfigError, match=rf"{path.name}: tiers\.cpu\.capacity: 1 bytes"):  # names the file
        resolve_config(str(path))
