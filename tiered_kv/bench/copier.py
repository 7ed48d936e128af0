"""The worker's ShardCopier as vLLM runs it (issue 46 item 1): a process per TP rank, each blocking in ``wait()``.

Every rank is a real process (multiprocessing, spawn) with its own KV tensors (on CUDA: GPU ``rank %
device_count``, so ranks share a GPU and its link only where there are fewer GPUs than ranks), its own
ShardCopier over its sub-slab of one shared segment, and its own GIL. A case is a job size (16 and 64 MiB
of this rank's bytes) and a number of jobs in flight: all ranks start together (a barrier), submit the
jobs of one step and ``wait`` for them (no polling). Stores gather scattered GPU blocks into a run of slots,
loads scatter a run of slots into other scattered blocks, as the scheduler hands them out.

Each round also times a raw copy of the same bytes in the same process, all ranks at once: one memcpy
between contiguous host buffers for the host engine, one pinned DMA per direction on CUDA. The ratio per
rank is raw time / copier time, per round, median of the rounds. Host figures are CPU figures (the host
engine's memcpy against memcpy), not a GPU claim. ``submit_us`` is the caller's thread CPU time in
``submit``, per job: the model's thread's share.

    python -m tiered_kv.bench.copier [--engine auto|host|cuda] [--world N] [--sizes-mib 16 64]
                                     [--inflight 1 2] [--rounds 7] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
import traceback
from typing import Any

SHARD = 256 << 10  # bytes per block per rank: a K region of 192 KiB and a V region of 64 KiB
BARRIER_S = 120.0


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tiered_kv.bench.copier", description=__doc__.splitlines()[0])
    p.add_argument("--engine", default="auto", choices=["auto", "host", "cuda"])
    p.add_argument("--world", type=int, default=0, help="ranks (default: the GPU count where >= 2, else 2)")
    p.add_argument("--sizes-mib", type=int, nargs="+", default=[16, 64], help="bytes per job per rank, MiB")
    p.add_argument("--inflight", type=int, nargs="+", default=[1, 2], help="jobs per direction in flight")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--json", default=None, help="write the JSON here too")
    return p.parse_args(argv)


def segment_config(shm: str, world: int, blocks: int, slots: int) -> dict:
    return {"model": {"model_id": "bench-copier", "bytes_per_block": world * SHARD}, "gpu": {"num_blocks": blocks},
            "tiers": {"cpu": {"capacity": slots * world * SHARD, "shared_path": shm}, "disk": {"enabled": False}}}


def cases(a: argparse.Namespace) -> list[tuple[int, int]]:
    return [(size << 20, k) for size in a.sizes_mib for k in a.inflight]


def rank_main(rank: int, world: int, engine: str, shm: str, plan: list[tuple[int, int]], rounds: int,
              barrier: Any, results: Any) -> None:  # fmt: skip
    """One rank's process: build, run every case with the other ranks, put its figures on ``results``."""
    try:
        results.put((rank, run_rank(rank, world, engine, shm, plan, rounds, barrier)))
    except BaseException:
        barrier.abort()  # the other ranks stop waiting for this one
        results.put((rank, {"error": traceback.format_exc()}))


def run_rank(rank: int, world: int, engine: str, shm: str, plan: list[tuple[int, int]], rounds: int,
             barrier: Any) -> dict:  # fmt: skip
    import numpy as np
    import torch

    import tiered_kv as tkv
    from tiered_kv.cross_process import LOAD, STORE, ShardCopier, ShardJob, segment_info_for

    torch.set_num_threads(1)  # a worker's copies must not lean on torch's pool
    on_cuda = engine == "cuda"
    dev = torch.device("cuda", rank % torch.cuda.device_count()) if on_cuda else torch.device("cpu")
    if on_cuda:
        torch.cuda.set_device(dev)
    most = max(size // SHARD * k for size, k in plan)  # blocks of the largest step
    blocks, slots = 2 * most, most  # stores read one half of a permutation, loads write the other
    widths = (SHARD * 3 // 4, SHARD // 4)
    gen = torch.Generator().manual_seed(rank)
    kv = {n: torch.randint(0, 256, (blocks, w), dtype=torch.uint8, generator=gen).to(dev)
          for n, w in zip("kv", widths, strict=True)}  # fmt: skip
    layout = tkv.KVLayout.from_tensors(kv, blocks)
    copier = ShardCopier(layout, rank=rank, world_size=world, engine=engine)
    copier.open(segment_info_for(segment_config(shm, world, blocks, slots), layout, world_size=world,
                                 engine_id="bench-copier"))  # fmt: skip
    raw_bytes = max(size * k for size, k in plan)
    if on_cuda:
        raw_dev = torch.empty(raw_bytes, dtype=torch.uint8, device=dev)
        raw_host = torch.empty(raw_bytes, dtype=torch.uint8).pin_memory()
    else:
        raw_dev, raw_host = np.ones(raw_bytes, dtype=np.uint8), np.zeros(raw_bytes, dtype=np.uint8)

    def raw(direction: str, nbytes: int) -> float:
        barrier.wait(BARRIER_S)
        t0 = time.perf_counter()
        if on_cuda:
            src, dst = (raw_dev, raw_host) if direction == STORE else (raw_host, raw_dev)
            dst[:nbytes].copy_(src[:nbytes], non_blocking=True)
            torch.cuda.synchronize(dev)
        else:
            src, dst = (raw_dev, raw_host) if direction == STORE else (raw_host, raw_dev)
            np.copyto(dst[:nbytes], src[:nbytes])
        return time.perf_counter() - t0

    rng = np.random.default_rng(rank)
    perm = rng.permutation(blocks)
    job_id, out, equal = 0, [], True
    try:
        for size, k in plan:
            per_job = size // SHARD
            store_ids, load_ids = perm[: per_job * k], perm[most : most + per_job * k]
            figures: dict[str, dict[str, list[float]]] = {}
            for direction in (STORE, LOAD):
                ours, raws, submit = [], [], []
                for r in range(rounds + 1):  # the first round warms up (pages, pinning, kernels)
                    jobs = []
                    for j in range(k):
                        job_id += 1
                        s = np.arange(j * per_job, (j + 1) * per_job)
                        g = (store_ids if direction == STORE else load_ids)[j * per_job : (j + 1) * per_job]
                        jobs.append(ShardJob(job_id, direction, g, s))
                    barrier.wait(BARRIER_S)
                    t0 = time.perf_counter()
                    c0 = time.thread_time()
                    copier.submit(jobs)
                    c1 = time.thread_time()
                    copier.wait([j.job_id for j in jobs], BARRIER_S)
                    took = time.perf_counter() - t0
                    ok, failed = copier.poll()
                    if failed or sorted(ok) != [j.job_id for j in jobs]:
                        raise RuntimeError(f"rank {rank}: jobs failed {failed}, finished {ok}")
                    raw_t = raw(direction, size * k)
                    if r:
                        ours.append(took)
                        raws.append(raw_t)
                        submit.append((c1 - c0) / k * 1e6)
                figures[direction] = {"ours": ours, "raw": raws, "submit_us": submit}
            if on_cuda:
                torch.cuda.synchronize(dev)
            for name in kv:  # the load put back what the store took, into other blocks
                equal &= bool(torch.equal(kv[name][torch.as_tensor(load_ids, device=dev)],
                                          kv[name][torch.as_tensor(store_ids, device=dev)]))  # fmt: skip
            out.append({"job_bytes": size, "inflight": k, "figures": figures})
        path = copier.copy_path
    finally:
        copier.close()
    return {"device": str(dev), "pid": os.getpid(), "copy_path": path, "cases": out, "bytes_equal": equal}


def summarize(per_rank: dict[int, dict], plan: list[tuple[int, int]]) -> list[dict]:
    rows = []
    for i, (size, k) in enumerate(plan):
        for direction in ("store", "load"):
            ranks = []
            for rank, res in sorted(per_rank.items()):
                f = res["cases"][i]["figures"][direction]
                nbytes = size * k
                ratios = [raw / ours for raw, ours in zip(f["raw"], f["ours"], strict=True)]
                ranks.append({"rank": rank, "device": res["device"], "pid": res["pid"],
                              "ours_gbps": round(nbytes / statistics.median(f["ours"]) / 1e9, 3),
                              "raw_gbps": round(nbytes / statistics.median(f["raw"]) / 1e9, 3),
                              "ratio": round(statistics.median(ratios), 3),
                              "submit_us": round(statistics.median(f["submit_us"]), 1)})  # fmt: skip
            rows.append({"job_mib": size >> 20, "inflight": k, "direction": direction, "per_rank": ranks,
                         "min_ratio": min(r["ratio"] for r in ranks),
                         "sum_gbps": round(sum(r["ours_gbps"] for r in ranks), 3),
                         "raw_sum_gbps": round(sum(r["raw_gbps"] for r in ranks), 3)})  # fmt: skip
    return rows


def bench_copier(a: argparse.Namespace) -> dict:
    import torch

    cuda = torch.cuda.is_available()
    engine = a.engine if a.engine != "auto" else ("cuda" if cuda else "host")
    if engine == "cuda" and not cuda:
        raise SystemExit("bench copier --engine cuda: torch.cuda.is_available() is False here")
    gpus = torch.cuda.device_count() if engine == "cuda" else 0
    world = a.world or (gpus if gpus >= 2 else 2)
    plan = cases(a)
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(world), ctx.Queue()
    # On a tmpfs: CUDA page-locks a shared mapping only there (tiers/fs_kind.py).
    shm_root = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(prefix="tkv-copier-bench-", dir=shm_root) as shm:
        procs = [ctx.Process(target=rank_main, args=(r, world, engine, shm, plan, a.rounds, barrier, results),
                             name=f"bench-rank-{r}") for r in range(world)]  # fmt: skip
        for p in procs:
            p.start()
        per_rank = dict(results.get(timeout=BARRIER_S * (len(plan) * 2 * (a.rounds + 1) + 2)) for _ in procs)
        for p in procs:
            p.join(60)
    errors = {r: res["error"] for r, res in per_rank.items() if "error" in res}
    if errors:
        raise RuntimeError("bench copier: " + "; ".join(f"rank {r}: {e}" for r, e in sorted(errors.items())))
    first = per_rank[0]
    return {
        "engine": engine, "copy_path": first["copy_path"], "world": world, "gpus": gpus,
        "process_per_rank": True, "completion": "ShardCopier.wait (no polling)", "shard_bytes": SHARD,
        "rounds": a.rounds, "bytes_equal": all(res["bytes_equal"] for res in per_rank.values()),
        "figures_are": "GPU figures (raw: one pinned DMA)" if engine == "cuda" else
                       "CPU figures (host engine; raw: one memcpy of the same bytes): not a GPU claim",
        "shared_link": engine == "cuda" and gpus < world,
        "cases": summarize(per_rank, plan),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    out = bench_copier(a)
    text = json.dumps(out, indent=1)
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text + "\n")
    return 0 if out["bytes_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
