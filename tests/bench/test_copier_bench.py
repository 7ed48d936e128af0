"""The process-per-rank ShardCopier bench (tiered_kv/bench/copier.py) on the CPU: real rank processes, the host
engine, byte-exact round trips, a ratio per rank against a raw copy of the same bytes."""

from __future__ import annotations

import os

from tiered_kv.bench.copier import bench_copier, parse


def test_each_rank_is_its_own_process_and_every_case_is_measured():
    out = bench_copier(parse(["--engine", "host", "--world", "2", "--sizes-mib", "1", "--inflight", "1", "2",
                              "--rounds", "1"]))  # fmt: skip
    assert out["engine"] == "host" and out["world"] == 2 and out["bytes_equal"] is True
    assert out["figures_are"].startswith("CPU figures") and out["completion"].startswith("ShardCopier.wait")
    assert [(r["job_mib"], r["inflight"], r["direction"]) for r in out["cases"]] == [
        (1, 1, "store"), (1, 1, "load"), (1, 2, "store"), (1, 2, "load")]  # fmt: skip
    for row in out["cases"]:
        pids = {r["pid"] for r in row["per_rank"]}
        assert len(pids) == 2 and os.getpid() not in pids  # a process per rank, not threads of this one
        for r in row["per_rank"]:
            assert r["ours_gbps"] > 0 and r["raw_gbps"] > 0 and r["ratio"] > 0 and r["submit_us"] > 0
        assert row["min_ratio"] == min(r["ratio"] for r in row["per_rank"])
