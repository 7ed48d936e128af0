"""HostCopyEngine: the copy engine for CPU-only machines (and CI).

Each batch is one job (every region) on a single-worker executor per
direction, so batches of one direction finish in submission order while a
store and a load can overlap. torch releases the GIL inside the copy kernels,
so the event loop keeps running while a job copies.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from tiered_kv.errors import LayoutError, TransferError
from tiered_kv.transfer.base import CopyEngine, CopyHandle, Direction
from tiered_kv.transfer.plan import CopyPlan, build_plan

log = logging.getLogger(__name__)


class HostCopyEngine(CopyEngine):
    """Copies with torch CPU ops on worker threads the engine owns."""

    def __init__(self, gpu_regions: Sequence[torch.Tensor], cpu_regions: Sequence[torch.Tensor]) -> None:
        super().__init__(gpu_regions, cpu_regions)
        for side, regions in (("gpu", self._gpu), ("cpu", self._cpu)):
            for r, t in enumerate(regions):
                if t.device.type != "cpu":
                    raise LayoutError(
                        f"HostCopyEngine needs CPU tensors but {side} region {r} is on {t.device} (use the cuda engine)"
                    )
        self._executors = {
            d: ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"tiered-kv-{d.value}") for d in Direction
        }

    def _launch(
        self, direction: Direction, src: list[int], dst: list[int], handle: CopyHandle,
        loop: asyncio.AbstractEventLoop,
    ) -> None:  # fmt: skip
        plan = build_plan(src, dst, bytes_per_block=self.bytes_per_block, regions=len(self._gpu))
        if direction is Direction.STORE:
            src_regions, dst_regions = self._gpu, self._cpu
        else:
            src_regions, dst_regions = self._cpu, self._gpu
        self._executors[direction].submit(
            _run_job, plan, src_regions, dst_regions, handle, loop, self._resolve
        )

    def _release(self) -> None:
        # Every job has finished (aclose drained them), so the idle workers exit
        # promptly; wait=False keeps the join off the event loop.
        for executor in self._executors.values():
            executor.shutdown(wait=False)


def _run_job(
    plan: CopyPlan,
    src_regions: Sequence[torch.Tensor],
    dst_regions: Sequence[torch.Tensor],
    handle: CopyHandle,
    loop: asyncio.AbstractEventLoop,
    resolve,
) -> None:
    """Worker-thread body: copy, then report to the loop. Never raises."""
    error: BaseException | None = None
    try:
        plan.apply(src_regions, dst_regions)
    except Exception as exc:
        error = TransferError(f"{handle.direction.value} of {plan.count} blocks failed: {exc!r}")
        error.__cause__ = exc
    try:
        loop.call_soon_threadsafe(resolve, handle.future, error)
    except RuntimeError:  # the loop closed under us: nobody is left to tell but the log
        log.error(
            "event loop closed before a %s batch could be reported (error=%r)", handle.direction.value, error
        )
