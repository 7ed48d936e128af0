"""Host copy engine vs the raw torch operation, measured side by side in one run.

Raw: ``torch.index_select(src, 0, idx, out=dst)`` of the same bytes into a
contiguous destination, called inline on the loop thread. Engine:
``HostCopyEngine`` batches, i.e. everything a caller pays (validation, plan,
worker hand-off, loop wake-up). Store copies random GPU ids into contiguous
CPU slots; load copies contiguous CPU slots into random GPU ids.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from tiered_kv.transfer.host import HostCopyEngine

_ROUNDS = 3
_WORKING_SET = 64 * 1024 * 1024


def bench_transfer(
    block_sizes: Sequence[int] = (16 * 1024, 256 * 1024, 2 * 1024 * 1024),
    batch: int = 64,
    repeats: int = 20,
) -> list[dict]:
    """One dict per (block size, direction) comparing the engine with the raw op.

    Keys: direction, block_bytes, batch, nbytes (per batch), raw_gbps
    (``repeats`` raw batches back to back on the loop thread), raw_thread_gbps
    (the same, on another thread: isolates thread/OpenMP effects from the
    engine's own overhead), engine_gbps (``repeats`` batches
    submitted back to back, then awaited: throughput), engine_serial_gbps (each
    batch awaited before the next: latency-bound, pays the thread hand-off
    every time), ratio = engine/raw, ratio_serial = engine_serial/raw. Medians
    of 3 alternating rounds. Synchronous: it runs its own event loop, so call
    it from outside any running loop (e.g. the CLI).
    """
    return asyncio.run(_bench(tuple(block_sizes), batch, repeats))


async def _bench(block_sizes: tuple[int, ...], batch: int, repeats: int) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    results: list[dict] = []
    for block_bytes in block_sizes:
        results += await _bench_size(block_bytes, batch, repeats, gen)
    return results


async def _bench_size(block_bytes: int, batch: int, repeats: int, gen: torch.Generator) -> list[dict]:
    # Both tiers span at least _WORKING_SET bytes and every batch uses fresh ids
    # and slots, so neither side gets cache-hot data a real KV cache never has.
    rows = max(2 * batch, _WORKING_SET // block_bytes)
    gpu = torch.randint(0, 256, (rows, block_bytes), dtype=torch.uint8, generator=gen)
    cpu = torch.zeros((rows, block_bytes), dtype=torch.uint8)
    cpu.fill_(1)  # fault every page in now: otherwise the first (raw) pass pays the page faults alone
    starts = [(i * batch) % (rows - batch + 1) for i in range(repeats)]
    slots = [list(range(a, a + batch)) for a in starts]
    slot_idx = [torch.tensor(s) for s in slots]
    store_ids = [torch.randperm(rows, generator=gen)[:batch] for _ in range(repeats)]
    load_ids = [torch.randperm(rows, generator=gen)[:batch] for _ in range(repeats)]

    def raw_store(i: int) -> None:
        torch.index_select(gpu, 0, store_ids[i], out=cpu[starts[i] : starts[i] + batch])

    def raw_load(i: int) -> None:  # same bytes, into a contiguous run of gpu blocks
        torch.index_select(cpu, 0, slot_idx[i], out=gpu[starts[i] : starts[i] + batch])

    async with HostCopyEngine([gpu], [cpu]) as engine:
        store = await _measure(
            "store", block_bytes, batch, repeats, raw_store,
            lambda i: engine.submit_store(store_ids[i].tolist(), slots[i]),
        )  # fmt: skip
        load = await _measure(
            "load", block_bytes, batch, repeats, raw_load,
            lambda i: engine.submit_load(slots[i], load_ids[i].tolist()),
        )  # fmt: skip
    return [store, load]


async def _measure(direction: str, block_bytes: int, batch: int, repeats: int, raw, submit) -> dict:
    raw(0)  # warm-up: first touch of the destination pages, worker start-up
    await submit(0)
    rates: dict[str, list[float]] = {"raw": [], "raw_thread": [], "engine": [], "serial": []}
    nbytes = batch * block_bytes
    loop = asyncio.get_running_loop()

    def raw_all() -> float:
        start = time.perf_counter()
        for i in range(repeats):
            raw(i)
        return time.perf_counter() - start

    with ThreadPoolExecutor(max_workers=1) as other_thread:
        await loop.run_in_executor(other_thread, raw, 0)
        for _ in range(_ROUNDS):  # modes alternate so machine noise hits each alike
            rates["raw"].append(repeats * nbytes / raw_all() / 1e9)
            rates["raw_thread"].append(
                repeats * nbytes / await loop.run_in_executor(other_thread, raw_all) / 1e9
            )
            await _engine_round(submit, repeats, nbytes, rates)
    raw_gbps, thread_gbps, engine_gbps, serial_gbps = (
        statistics.median(rates[m]) for m in ("raw", "raw_thread", "engine", "serial")
    )
    return {
        "direction": direction,
        "block_bytes": block_bytes,
        "batch": batch,
        "nbytes": nbytes,
        "raw_gbps": raw_gbps,
        "raw_thread_gbps": thread_gbps,
        "engine_gbps": engine_gbps,
        "engine_serial_gbps": serial_gbps,
        "ratio": engine_gbps / raw_gbps,
        "ratio_serial": serial_gbps / raw_gbps,
    }


async def _engine_round(submit, repeats: int, nbytes: int, rates: dict[str, list[float]]) -> None:
    t0 = time.perf_counter()
    handles = [submit(i) for i in range(repeats)]
    for handle in handles:
        await handle
    t1 = time.perf_counter()
    for i in range(repeats):
        await submit(i)
    t2 = time.perf_counter()
    rates["engine"].append(repeats * nbytes / (t1 - t0) / 1e9)
    rates["serial"].append(repeats * nbytes / (t2 - t1) / 1e9)


if __name__ == "__main__":  # python -m tiered_kv.transfer.bench
    for row in bench_transfer():
        print(
            f"{row['direction']:5s} {row['block_bytes'] // 1024:5d} KiB  raw {row['raw_gbps']:6.2f} GB/s  "
            f"(on a worker thread {row['raw_thread_gbps']:6.2f})  "
            f"engine {row['engine_gbps']:6.2f} GB/s ({row['ratio']:.2f}x)  "
            f"one-at-a-time {row['engine_serial_gbps']:6.2f} GB/s ({row['ratio_serial']:.2f}x)"
        )
