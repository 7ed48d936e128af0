#!/usr/bin/env python3
"""A vLLM-free TP bench of the cross-process copies: every rank's ShardCopier, and the scheduler's disk I/O of whole blocks.

* copies: ``--world`` ranks (threads of this process, each with its own ShardCopier and KV tensors; on
  CUDA rank r uses GPU r % device_count) store a batch of scattered GPU blocks into a run of CPU slots and
  load it back, all ranks at once, as a TP step does. Reported per rank and direction: GB/s of that rank's
  bytes over the time from submit until its copier had nothing pending (median of ``--rounds``).
* disk: the scheduler's spill (CPU -> disk) and promote (disk -> CPU) of whole TP blocks straight from the
  segment through DiskStore's vectored I/O, GB/s of whole blocks (page cache: the I/O path's own cost).

It uses only APIs the split has had from the start, so the same script measures an older checkout
(``PYTHONPATH=<checkout> python scripts/bench_shard_copier.py``) beside this one. One JSON object goes to
``--json`` (and stdout): the device's name, the engine, and the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--engine", default="auto", choices=["auto", "host", "cuda"])
    p.add_argument("--shard-kib", type=int, default=256, help="bytes per block per rank, in KiB")
    p.add_argument("--blocks", type=int, default=128, help="GPU blocks per rank (a batch is half of them)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--disk", default=None, help="directory for the disk bench (default: a temp dir); 'off' skips it")
    p.add_argument("--json", default=None, help="write the JSON here too")
    return p.parse_args()


def config(shm: str, world: int, shard: int, slots: int) -> dict:
    return {"model": {"model_id": "bench-split", "bytes_per_block": world * shard}, "gpu": {"num_blocks": 64},
            "tiers": {"cpu": {"capacity": slots * world * shard, "shared_path": shm}, "disk": {"enabled": False}}}


def bench_copies(a: argparse.Namespace, shm: str) -> dict:
    import tiered_kv as tkv

    try:
        from tiered_kv.cross_process import LOAD, STORE, ShardCopier, ShardJob, segment_info_for
    except ImportError:  # a checkout from before tiered_kv.cross_process (then tiered_kv.split)
        from tiered_kv.split import LOAD, STORE, ShardJob
        from tiered_kv.split.scheduler import segment_info_for
        from tiered_kv.split.worker import ShardCopier

    shard, n = a.shard_kib * 1024, a.blocks
    widths = (shard * 3 // 4, shard - shard * 3 // 4)  # a K and a V region
    on_cuda = a.engine != "host" and torch.cuda.is_available()
    ranks = []
    for r in range(a.world):
        dev = torch.device("cuda", r % torch.cuda.device_count()) if on_cuda else torch.device("cpu")
        kv = {name: torch.randint(0, 256, (n, w), dtype=torch.uint8).to(dev) for name, w in zip("kv", widths)}
        layout = tkv.KVLayout.from_tensors(kv, n)
        c = ShardCopier(layout, rank=r, world_size=a.world, engine=a.engine)
        c.open(segment_info_for(config(shm, a.world, shard, n), layout, world_size=a.world, engine_id="bench"))
        ranks.append((c, kv))
    batch = n // 2
    rng = np.random.default_rng(0)
    gpu_ids, slots = rng.permutation(n)[:batch], np.arange(3, 3 + batch)  # scattered blocks, a run of slots
    times = {d: [[] for _ in ranks] for d in ("store", "load")}
    job = 0
    try:
        for _ in range(a.rounds + 1):  # the first round warms up (pages, pinning, kernels)
            for direction, kind in (("store", STORE), ("load", LOAD)):
                job += 1
                ids = gpu_ids if kind == STORE else np.roll(gpu_ids, 1)
                barrier = threading.Barrier(len(ranks))
                took = [0.0] * len(ranks)

                def run(i: int, c=None, kind=kind, ids=ids, job=job, barrier=barrier, took=took) -> None:
                    c = ranks[i][0]
                    barrier.wait()
                    t0 = time.perf_counter()
                    c.submit([ShardJob(job, kind, ids, slots)])
                    while c.pending:
                        time.sleep(0.0002)
                    took[i] = time.perf_counter() - t0
                    assert c.poll() == ([job], []), f"rank {i}: job {job} failed"

                threads = [threading.Thread(target=run, args=(i,)) for i in range(len(ranks))]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                for i, t in enumerate(took):
                    times[direction][i].append(t)
    finally:
        kind_used = ranks[0][0].kind
        for c, _ in ranks:
            c.close()
    nbytes = batch * shard
    per_rank = {d: [round(nbytes / statistics.median(ts[1:]) / 1e9, 3) for ts in times[d]] for d in times}
    return {"engine": kind_used, "batch_blocks": batch, "shard_bytes": shard, "gbps_per_rank": per_rank}


def bench_disk(a: argparse.Namespace, shm: str, root: str) -> dict:
    import tiered_kv as tkv

    try:
        from tiered_kv.cross_process import group_layout, segment_info_for
    except ImportError:  # a checkout from before tiered_kv.cross_process (then tiered_kv.split)
        from tiered_kv.split.scheduler import group_layout, segment_info_for
    from tiered_kv.tiers.disk import DiskNamespace, DiskStore
    from tiered_kv.tiers.shared_cpu import SharedSegment
    from tiered_kv.tiers.shared_slabs import SharedCpuSlabs

    shard, slots = a.shard_kib * 1024, 2 * a.blocks
    shard_layout = tkv.KVLayout.from_block_bytes([shard * 3 // 4, shard - shard * 3 // 4], 64)
    info = segment_info_for(config(shm, a.world, shard, slots), shard_layout, world_size=a.world, engine_id="disk")
    seg = SharedSegment.open(info, scheduler=True)
    slabs = SharedCpuSlabs(seg, group_layout(shard_layout, a.world).region_block_bytes)
    slab = slabs.slab_np
    slab[:] = np.random.default_rng(1).integers(0, 256, slab.shape, dtype=np.uint8)
    bpb, batch = a.world * shard, a.blocks
    ns = DiskNamespace("bench-split", "float16", "bench-disk", bpb, 32)
    keys = np.frombuffer(b"".join(hashlib.sha256(b"%d" % i).digest() for i in range(batch)), np.uint8)
    keys = keys.reshape(batch, 32).copy()
    spill, promote = [], []

    async def run() -> None:
        async with DiskStore(Path(root) / "disk", ns, 2 * batch) as store:
            for r in range(a.rounds + 1):
                disk = np.arange(batch) + (r % 2) * batch
                t0 = time.perf_counter()
                assert (await store.write_many(disk, keys, slab, np.arange(batch))).all()
                spill.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                assert (await store.read_many(disk, keys, slab, np.arange(batch, 2 * batch))).all()
                promote.append(time.perf_counter() - t0)
        assert np.array_equal(slab[batch : 2 * batch], slab[:batch]), "promoted blocks differ from the spilled ones"

    try:
        asyncio.run(run())
    finally:
        slabs.release()
    gb = batch * bpb / 1e9
    return {"batch_blocks": batch, "block_bytes": bpb, "spill_gbps": round(gb / statistics.median(spill[1:]), 3),
            "promote_gbps": round(gb / statistics.median(promote[1:]), 3)}


def main() -> int:
    a = parse()
    import tiered_kv

    out = {"tiered_kv": str(Path(tiered_kv.__file__).parent), "world": a.world,
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}  # fmt: skip
    # The segment goes on a tmpfs: CUDA page-locks a shared mapping only there (tiers/fs_kind.py).
    shm_root = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(prefix="tkv-bench-") as tmp, \
            tempfile.TemporaryDirectory(prefix="tkv-bench-shm-", dir=shm_root) as shm:
        out["copies"] = bench_copies(a, str(shm))
        if a.disk != "off":
            out["disk"] = bench_disk(a, str(shm), a.disk or tmp)
    text = json.dumps(out, indent=1)
    print(text)
    if a.json:
        Path(a.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
