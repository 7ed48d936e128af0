"""Layer-wise synchronous loads on a host rank (issue 39 item 4): a step's CPU-hit loads copied layer group
by layer group, in layer order, with one event per group, so vLLM's ``wait_for_layer_load(layer)`` waits
for that layer's rows only and attention on layer 0 starts before the last layer has landed.

A layer group is the KV regions of one registered tensor (a layer's K and V), in the order vLLM registered
them (its layer order); a region several tensors share is copied with the first of them. Before any group,
the last block of each job is copied whole (every layer): it is the one block a step's forward may also
write (a hit that ends inside a block: tails.py), and vLLM writes a layer's new KV before it calls
``wait_for_layer_load`` for it, so that block must have landed before the forward starts.

The copies are numpy row copies on one thread of their own (no torch intra-op pool, as NumpyRowEngine);
a failed copy fails every job of the load and sets every event, so no waiter hangs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from ..errors import TransferError


def layer_groups(kv_caches: Mapping[str, Any], regions: Sequence[Any]) -> dict[str, list[int]]:
    """Each tensor's name -> the indices of the layout regions whose bytes lie in it (by address)."""
    spans = []
    for name, t in kv_caches.items():
        start = int(t.data_ptr())
        spans.append((name, start, start + int(t.numel()) * int(t.element_size())))
    out: dict[str, list[int]] = {name: [] for name, _, _ in spans}
    for i, region in enumerate(regions):
        ptr = int(region.data_ptr())
        for name, start, end in spans:
            if start <= ptr < end:
                out[name].append(i)
    return out


def copy_groups(groups: Mapping[str, list[int]], num_regions: int) -> tuple[list[list[int]], dict[str, int]]:
    """The region groups a layered load copies, in layer order, and each tensor's name -> the group after
    which all its regions have landed. A region several tensors share goes with the first of them; regions
    of no tensor form a last group."""
    seen: set[int] = set()
    out: list[list[int]] = []
    last: dict[str, int] = {}
    for name, regions in groups.items():
        new = [r for r in regions if r not in seen]
        seen.update(new)
        if new:
            out.append(new)
        if regions:
            last[name] = len(out) - 1
    rest = [r for r in range(num_regions) if r not in seen]
    if rest:
        out.append(rest)
    return out, last


class LayerLoads:
    """One rank's layered loads over (its GPU regions, its CPU sub-slab regions), host tensors only."""

    def __init__(
        self,
        gpu_regions: Sequence[Any],
        cpu_regions: Sequence[Any],
        groups: Mapping[str, list[int]],
        *,
        pace: Callable[[int], None] | None = None,
    ) -> None:
        self._gpu = [r.numpy() for r in gpu_regions]
        self._cpu = [r.numpy() for r in cpu_regions]
        self._groups, self._last_group = copy_groups(groups, len(self._gpu))
        self._pace = pace  # tests: called before each group's copies, with its index
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tiered-kv-layers")

    @property
    def num_groups(self) -> int:
        return len(self._groups)

    def start(self, jobs: Sequence[Any], done: Callable[[int, bool], None]) -> LayeredLoad:
        """Copy ``jobs`` (LOAD ShardJobs) layer group by group; ``done(job_id, ok)`` once each is over."""
        load = LayeredLoad(len(self._groups), self._last_group)
        self._pool.submit(self._copy, list(jobs), load, done)
        return load

    def poll(self) -> list[int]:
        """Nothing to report here: the copy thread calls ``done`` for each job itself."""
        return []

    def wait(self, timeout_s: float | None = None) -> list[int]:
        """As ``poll`` (the caller waits on its own jobs' reports); the direct road's loads block here."""
        return []

    def _copy(self, jobs: list[Any], load: LayeredLoad, done: Callable[[int, bool], None]) -> None:
        ok = True
        try:
            for job in jobs:  # the block the forward may write: every layer of it first
                self._rows(range(len(self._gpu)), job.cpu_slots[-1:], job.gpu_ids[-1:])
            load.edges.set()
            for g, regions in enumerate(self._groups):
                if self._pace is not None:
                    self._pace(g)
                for job in jobs:  # the last block landed: the forward may be writing it by now
                    self._rows(regions, job.cpu_slots[:-1], job.gpu_ids[:-1])
                load.events[g].set()
        except BaseException as exc:  # every waiter wakes; the jobs are reported failed
            ok = False
            load.error = exc
        finally:
            load.edges.set()
            for event in load.events:
                event.set()
            for job in jobs:
                done(job.job_id, ok)
            load.finished.set()

    def _rows(self, regions: Any, slots: np.ndarray, ids: np.ndarray) -> None:
        slots, ids = np.asarray(slots, dtype=np.int64), np.asarray(ids, dtype=np.int64)
        for r in regions:
            self._gpu[r][ids] = self._cpu[r][slots]

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class LayeredLoad:
    """One step's layered load: wait for its edge blocks, a layer, or all of it."""

    def __init__(self, n_groups: int, last_group: Mapping[str, int]) -> None:
        self.edges = threading.Event()
        self.events = [threading.Event() for _ in range(n_groups)]
        self.finished = threading.Event()
        self.error: BaseException | None = None
        self._last_group = last_group

    def wait_layer(self, name: str, timeout_s: float | None = None) -> None:
        """Until ``name``'s rows landed (a name of no registered tensor: the whole load)."""
        g = self._last_group.get(name)
        event = self.finished if g is None else self.events[g]
        if not event.wait(timeout_s):
            raise TransferError(f"layer {name!r} of a synchronous load not landed after {timeout_s} s")

    def wait_edges(self, timeout_s: float | None = None) -> None:
        if not self.edges.wait(timeout_s):
            raise TransferError(f"the last blocks of a synchronous load not landed after {timeout_s} s")
