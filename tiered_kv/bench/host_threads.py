"""What background host copies cost the engine's own compute, from a copy engine's own thread.

A vLLM worker's forward pass runs torch CPU ops on its thread; a copy engine's thread that runs torch ops
too (index_select, copy_) starts torch's intra-op pool for itself, and both pools then fight over the
cores. This times a torch matmul loop on the main thread (the "forward pass") while a copy engine stores
batches of blocks at a fixed rate from its own thread, for: no copies, HostCopyEngine ("torch": it ran
torch ops until issue 28) and NumpyRowEngine; both now copy with the core's single-threaded native rows
(native/rows.hpp), so the two modes should agree. Modes are interleaved, medians reported.

    python -m tiered_kv.bench.host_threads [--rounds 3] [--iters 150] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import threading
import time

import numpy as np
import torch

from ..loops import run as run_loop
from ..transfer.engines.host import HostCopyEngine
from ..transfer.engines.numpy_rows import NumpyRowEngine

MODES = ("none", "torch", "numpy")


class Copier:
    """A loop thread storing ``batch`` scattered blocks every ``period_s`` through an engine."""

    def __init__(self, mode: str, *, blocks: int = 512, block_bytes: int = 64 << 10, batch: int = 64,
                 period_s: float = 0.005) -> None:  # fmt: skip
        self.mode, self.batch, self.period_s = mode, batch, period_s
        half = block_bytes // 2
        self.gpu = [torch.randint(0, 255, (blocks, half), dtype=torch.uint8) for _ in range(2)]
        slab = torch.zeros(blocks, block_bytes, dtype=torch.uint8)
        self.cpu = [slab[:, :half], slab[:, half:]]
        self.copied = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Copier:
        if self.mode != "none":
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        run_loop(self._drive())

    async def _drive(self) -> None:
        cls = HostCopyEngine if self.mode == "torch" else NumpyRowEngine
        engine = cls(self.gpu, self.cpu, inline_bytes=0)  # every batch on the engine's own thread
        rng = np.random.default_rng(0)
        n = self.gpu[0].shape[0]
        while not self._stop.is_set():
            t0 = time.perf_counter()
            # A run of consecutive blocks into consecutive slots (what a prefill's store usually is): the
            # torch path is one large copy_ per region, which torch runs on an intra-op pool of its own.
            first = int(rng.integers(0, n - self.batch))
            src, dst = np.arange(first, first + self.batch), np.arange(self.batch)
            await engine.submit_store(src, dst)
            self.copied += self.batch
            await asyncio.sleep(max(0.0, self.period_s - (time.perf_counter() - t0)))
        await engine.aclose()


def matmul_ms(iters: int, size: int) -> float:
    a, b = torch.randn(size, size), torch.randn(size, size)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        torch.mm(a, b)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def run(rounds: int = 3, iters: int = 150, size: int = 384, period_s: float = 0.03) -> dict:
    matmul_ms(20, size)  # warm the pool up
    per_mode: dict[str, list[float]] = {m: [] for m in MODES}
    copied: dict[str, list[float]] = {m: [] for m in MODES}
    cpu: dict[str, list[float]] = {m: [] for m in MODES}  # process CPU seconds per wall second
    for _ in range(rounds):
        for mode in MODES:
            with Copier(mode, period_s=period_s) as c:
                time.sleep(0.05)
                t0, c0 = time.perf_counter(), time.process_time()
                per_mode[mode].append(matmul_ms(iters, size))
                wall = time.perf_counter() - t0
                cpu[mode].append((time.process_time() - c0) / wall)
                copied[mode].append(c.copied / (wall + 0.05))
    med = {m: statistics.median(v) for m, v in per_mode.items()}
    return {
        "matmul_ms_median": med,
        "matmul_ms_runs": per_mode,
        "cpu_cores_busy": {m: statistics.median(v) for m, v in cpu.items()},
        "blocks_per_s": {m: statistics.median(v) for m, v in copied.items()},
        "slowdown_vs_none": {m: med[m] / med["none"] for m in MODES},
        "torch_threads": torch.get_num_threads(),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=150)
    p.add_argument("--size", type=int, default=384)
    p.add_argument("--period-ms", type=float, default=30.0, help="one batch of 64 blocks of 64 KiB per period")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    out = run(args.rounds, args.iters, args.size, args.period_ms / 1e3)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for m in MODES:
            print(f"{m:6} matmul median {out['matmul_ms_median'][m]:.3f} ms (x{out['slowdown_vs_none'][m]:.2f}), "
                  f"{out['cpu_cores_busy'][m]:.2f} cores busy, copies {out['blocks_per_s'][m]:.0f} blocks/s")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
