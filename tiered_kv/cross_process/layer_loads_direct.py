"""Layer-wise synchronous loads on CUDA (issue 46 item 9), through the direct road's native copier.

The host ranks' version is layer_loads.py (issue 39). Here one native call issues a step's synchronous
loads on the load stream: the last block of each job whole first, then event ("mark") 0; then each layer
group's rows of the other blocks, each followed by its own mark 1 + g. ``wait_layer(name)`` makes the
model's stream wait for that layer's mark only (``cuStreamWaitEvent``: the host does not block), so
attention on layer 0 can start before the last layer lands. ``wait_edges`` makes it wait for mark 0: the
block a hit that ends inside it may have the forward write (tails.py) has landed whole before the forward.

The owner (the ShardCopier) reports jobs through ``poll()``, which reads the copier's completion counter
(no thread of ours); ``wait`` blocks natively with the GIL released.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ..core import core
from ..errors import ConfigError, TransferError
from ..transfer.engines.direct import MAX_INFLIGHT, RawHandle, direct_eligible, region_geometry
from .layer_loads import copy_groups

_LOAD = 1
_NONE, _EVENT, _STREAM = 0, 1, 2


class DirectLayerLoads:
    """One rank's layered loads over (its GPU regions, its pinned CPU regions) on CUDA (or the fake driver)."""

    def __init__(
        self, gpu_regions: Sequence[torch.Tensor], cpu_regions: Sequence[torch.Tensor],
        groups: Mapping[str, list[int]], *, dma_rows: int | None = None, driver: str = "cuda",
        max_inflight: int = MAX_INFLIGHT,
    ) -> None:  # fmt: skip
        gpu, cpu = list(gpu_regions), list(cpu_regions)
        if not direct_eligible(gpu, cpu, min_row=0):
            raise ConfigError("layered CUDA loads need GPU rows with adjacent bytes and addressable CPU slab rows")
        self._groups, self._last_group = copy_groups(groups, len(gpu))
        self._fake = driver.startswith("fake:")
        self._device = gpu[0].device
        device = 0
        if not self._fake:
            torch.cuda.init()  # the primary context the copier retains is torch's
            device = int(self._device.index if self._device.index is not None else torch.cuda.current_device())
        self._copier = core.DirectCopier(driver, device, region_geometry(gpu, cpu), int(gpu[0].shape[0]),
                                         int(cpu[0].shape[0]), int(dma_rows or 0), max_inflight)  # fmt: skip
        self._started: deque[tuple[int, list[int], Callable[[int, bool], None]]] = deque()

    @property
    def num_groups(self) -> int:
        return len(self._groups)

    @property
    def stream_handle(self) -> int:
        """The raw load stream (tests hold it on the fake driver)."""
        return int(self._copier.stream(_LOAD))

    def start(self, jobs: Sequence[Any], done: Callable[[int, bool], None], *, ready: Any = None) -> DirectLayeredLoad:
        """Issue LOAD ``jobs`` (ShardJobs) as one layered call after ``ready`` (None: the current stream;
        a ``torch.cuda.Event``/``Stream`` or a ``RawHandle``); ``done(job_id, ok)`` is called from ``poll``."""
        slots = [np.asarray(j.cpu_slots, dtype=np.int64) for j in jobs]
        ids = [np.asarray(j.gpu_ids, dtype=np.int64) for j in jobs]
        edge: list[int] = []
        for s in slots:  # the last block of each job: copied whole before any layer group
            edge.extend([0] * (len(s) - 1) + [1] if len(s) else [])
        kind, handle = self._ready(ready)
        seq = self._copier.submit_layered(
            np.concatenate(slots) if slots else np.zeros(0, np.int64),
            np.concatenate(ids) if ids else np.zeros(0, np.int64), edge, self._groups, kind, handle,
        )  # fmt: skip
        self._started.append((seq, [j.job_id for j in jobs], done))
        return DirectLayeredLoad(self, seq, len(self._groups))

    def poll(self) -> list[int]:
        """Report every layered load that has completed (``done`` per job, in order); their job ids."""
        _, finished, errors = self._copier.poll()
        failed = {seq for d, seq, _ in errors if d == _LOAD}
        out: list[int] = []
        while self._started and self._started[0][0] <= finished:
            seq, job_ids, done = self._started.popleft()
            for job_id in job_ids:
                done(job_id, seq not in failed)
            out.extend(job_ids)
        return out

    def wait(self, timeout_s: float | None = None) -> list[int]:
        """Block (GIL released) until every started load completed, then ``poll``."""
        if self._started and not self._copier.wait(_LOAD, self._started[-1][0], -1.0 if timeout_s is None else timeout_s):
            raise TransferError(f"layered loads not landed after {timeout_s} s")
        return self.poll()

    def close(self) -> None:
        """Wait for every started load (their jobs are reported), then free the streams and events."""
        self.wait()
        self._copier.close()

    def _stream(self, stream: Any) -> int:
        if isinstance(stream, RawHandle):
            return int(stream.handle)
        if self._fake:
            raise TransferError("the fake driver's loads are waited on a RawHandle stream of core.fake_cuda's")
        return int((stream or torch.cuda.current_stream(self._device)).cuda_stream)

    def _ready(self, ready: Any) -> tuple[int, int]:
        if isinstance(ready, RawHandle):
            return (_STREAM if ready.stream else _EVENT), int(ready.handle)
        if ready is None:
            return (_NONE, 0) if self._fake else (_STREAM, int(torch.cuda.current_stream(self._device).cuda_stream))
        if isinstance(ready, torch.cuda.Stream):
            return _STREAM, int(ready.cuda_stream)
        if isinstance(ready, torch.cuda.Event):
            return _EVENT, int(ready.cuda_event)
        raise TransferError(f"ready of type {type(ready).__name__} cannot order a layered load")


class DirectLayeredLoad:
    """One step's layered load: make a stream wait for its edge blocks, one layer, or all of it."""

    def __init__(self, owner: DirectLayerLoads, seq: int, n_groups: int) -> None:
        self._owner = owner
        self.seq = seq
        self._n_groups = n_groups

    def wait_edges(self, timeout_s: float | None = None, *, stream: Any = None) -> None:
        """``stream`` (default: the current one) waits until the last block of every job landed whole."""
        self._wait_mark(0, timeout_s, stream, "the last blocks")

    def wait_layer(self, name: str, timeout_s: float | None = None, *, stream: Any = None) -> None:
        """``stream`` waits until ``name``'s rows landed (a name of no registered tensor: the whole load)."""
        g = self._owner._last_group.get(name)
        self._wait_mark(self._n_groups if g is None else 1 + g, timeout_s, stream, f"layer {name!r}")

    def _wait_mark(self, mark: int, timeout_s: float | None, stream: Any, what: str) -> None:
        # The host blocks only while the load is parked behind max_inflight others (until it is issued).
        handle = self._owner._stream(stream)
        if not self._owner._copier.wait_mark(self.seq, mark, handle, -1.0 if timeout_s is None else timeout_s):
            raise TransferError(f"{what} of a synchronous load not issued after {timeout_s} s")
